r"""A tiny tensor type that lets the library's torch kernels run on SymPy expressions.

The kernels in [`geometry.gl`][quotient_manifolds.geometry.gl] and
[`geometry.diagonal`][quotient_manifolds.geometry.diagonal] only use ``@``, ``+``, ``-``,
``*``, ``/``, ``**``, ``x.transpose(-1, -2)``, ``x.unsqueeze(d)``,
``x.sum(dims)``, ``x.to(dtype)`` and ``x.dtype``.
[`SymTensor`][quotient_manifolds.symbolic.tensor.SymTensor] implements exactly these on a NumPy
object array of SymPy expressions, with torch semantics (elementwise ``*``, broadcasting, matrix
product ``@``). Calling a kernel with [`SymTensor`][quotient_manifolds.symbolic.tensor.SymTensor]
arguments therefore evaluates *the code itself* symbolically, not a transcription of it.

Python floats met on the way (``0.5 * …``) are turned into exact rationals,
so no floating-point coefficient ever enters a symbolic proof.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import sympy as sp

__all__ = ["SymTensor", "as_sym", "exact", "scalar"]


def exact(value: Any) -> Any:
    """Convert a Python ``float`` to the exact ``sympy.Rational`` it stores."""
    if isinstance(value, float):
        return sp.Rational(value)
    return value


def _entry(value: Any) -> sp.Basic:
    """Every entry is a SymPy object, so ``1/2`` is never Python's ``0.5``."""
    return sp.Rational(value) if isinstance(value, float) else sp.sympify(value)


_SYMPIFY = np.frompyfunc(_entry, 1, 1)


def _raw(value: Any) -> Any:
    if isinstance(value, SymTensor):
        return value.data
    return exact(value)


class SymTensor:
    """Torch-like tensor of SymPy expressions (NumPy object array underneath).

    Parameters
    ----------
    data : array_like
        Nested sequence, NumPy object array or ``sympy.Matrix``.

    Notes
    -----
    ``dtype`` is the string ``"sympy"``; ``to(...)`` is the identity, so the
    kernels' ``t.to(gr.P.dtype)`` conversions are no-ops.
    """

    __array_priority__ = 1000  # make ``ndarray op SymTensor`` defer to us
    dtype = "sympy"

    def __init__(self, data: Any) -> None:
        if isinstance(data, sp.MatrixBase):
            data = data.tolist()
        arr = np.empty(np.shape(data), dtype=object)
        arr[...] = data
        self.data = _SYMPIFY(arr) if arr.ndim else np.array(_entry(arr[()]), dtype=object)

    # -- conversion ------------------------------------------------------------
    @classmethod
    def from_matrix(cls, matrix: sp.MatrixBase) -> SymTensor:
        """Wrap a ``sympy.Matrix``."""
        return cls(matrix.tolist())

    def to_matrix(self) -> sp.Matrix:
        """Return the 2-D tensor as a ``sympy.Matrix``."""
        if self.data.ndim == 1:
            return sp.Matrix(list(self.data))
        return sp.Matrix(self.data.tolist())

    def tolist(self) -> list:
        """Nested Python list of the entries."""
        return self.data.tolist()

    def flat(self) -> list[sp.Expr]:
        """Entries in row-major order (the order of ``torch.flatten``)."""
        return [sp.sympify(e) for e in self.data.reshape(-1)]

    def applyfunc(self, fn: Callable[[sp.Expr], sp.Expr]) -> SymTensor:
        """Apply ``fn`` to every entry."""
        out = np.empty(self.data.shape, dtype=object)
        for idx in np.ndindex(self.data.shape):
            out[idx] = fn(sp.sympify(self.data[idx]))
        return SymTensor(out)

    # -- torch-like surface ------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def to(self, *args: Any, **kwargs: Any) -> SymTensor:
        return self

    def transpose(self, dim0: int, dim1: int) -> SymTensor:
        return SymTensor(np.swapaxes(self.data, dim0, dim1))

    def unsqueeze(self, dim: int) -> SymTensor:
        return SymTensor(np.expand_dims(self.data, dim))

    def sum(self, dims: int | Sequence[int] | None = None) -> SymTensor:
        axis = tuple(dims) if isinstance(dims, Iterable) else dims
        return SymTensor(self.data.sum(axis=axis))

    def item(self) -> sp.Expr:
        """The single entry of a one-element tensor."""
        if self.data.size != 1:
            raise ValueError(f"item() needs one element, tensor has shape {self.shape}")
        return sp.sympify(self.data.reshape(-1)[0])

    def __getitem__(self, idx: Any) -> SymTensor:
        return SymTensor(self.data[idx])

    # -- arithmetic ----------------------------------------------------------------
    def __matmul__(self, other: Any) -> SymTensor:
        return SymTensor(np.matmul(self.data, _raw(other)))

    def __rmatmul__(self, other: Any) -> SymTensor:
        return SymTensor(np.matmul(_raw(other), self.data))

    def __add__(self, other: Any) -> SymTensor:
        return SymTensor(self.data + _raw(other))

    def __radd__(self, other: Any) -> SymTensor:
        return SymTensor(_raw(other) + self.data)

    def __sub__(self, other: Any) -> SymTensor:
        return SymTensor(self.data - _raw(other))

    def __rsub__(self, other: Any) -> SymTensor:
        return SymTensor(_raw(other) - self.data)

    def __mul__(self, other: Any) -> SymTensor:
        return SymTensor(self.data * _raw(other))

    def __rmul__(self, other: Any) -> SymTensor:
        return SymTensor(_raw(other) * self.data)

    def __truediv__(self, other: Any) -> SymTensor:
        return SymTensor(self.data / _raw(other))

    def __rtruediv__(self, other: Any) -> SymTensor:
        return SymTensor(_raw(other) / self.data)

    def __pow__(self, other: Any) -> SymTensor:
        return SymTensor(self.data ** _raw(other))

    def __neg__(self) -> SymTensor:
        return SymTensor(-self.data)

    def __repr__(self) -> str:
        return f"SymTensor({self.data.tolist()!r})"


def scalar(value: Any) -> sp.Expr:
    """A SymPy expression from a one-element
    [`SymTensor`][quotient_manifolds.symbolic.tensor.SymTensor] or an expression."""
    if isinstance(value, SymTensor):
        return value.item()
    return sp.sympify(value)


def as_sym(value: Any) -> SymTensor:
    """Wrap a matrix, sequence or [`SymTensor`][quotient_manifolds.symbolic.tensor.SymTensor] as
    a [`SymTensor`][quotient_manifolds.symbolic.tensor.SymTensor]."""
    if isinstance(value, SymTensor):
        return value
    if isinstance(value, sp.MatrixBase):
        return SymTensor.from_matrix(value)
    return SymTensor(value)
