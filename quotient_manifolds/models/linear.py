r"""Linear maps and who reads a tensor: the linear structure that folds act through.

A fold that rescales or translates a tensor $y$ (a norm's output) compensates in the linear maps
that read $y$, so it needs to know them: the readers of
[`READERS`][quotient_manifolds.models.linear.READERS] look at one module call of a traced
forward pass and say which linear maps of that module read $y$
([`Consumer`][quotient_manifolds.models.linear.Consumer]s), or that the module is not theirs.
Built in: `nn.Linear` and GPT-2's transposed `Conv1D`, the input projections of
`nn.MultiheadAttention`, and the fused `qkv` with separate `q_bias`/`v_bias` of timm's BEiT and
EVA (which call `F.linear` on their own parameters). An architecture that reads a norm's
output through another linear layout adds a reader with
[`register_reader`][quotient_manifolds.models.linear.register_reader].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "READERS",
    "Consumer",
    "LinearLayer",
    "NotFoldable",
    "ReadQuery",
    "Reader",
    "is_conv1d",
    "linear_layer",
    "readers_of",
    "register_reader",
    "storage",
]

Params = Mapping[str, torch.Tensor]


def is_conv1d(m: nn.Module) -> bool:
    """Whether `m` is a transposed `Conv1D` (GPT-2: an `(in, out)` weight, `y = x W + b`)."""
    w = getattr(m, "weight", None)
    return (type(m).__name__ == "Conv1D" and isinstance(w, nn.Parameter) and w.dim() == 2
            and hasattr(m, "nf"))


@dataclass(frozen=True)
class LinearLayer:
    """The parameters of an `nn.Linear` or a transposed `Conv1D`."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    transposed: bool  # Conv1D: (in, out) storage
    in_features: int
    out_features: int


def linear_layer(m: object) -> LinearLayer | None:
    """The [`LinearLayer`][quotient_manifolds.models.linear.LinearLayer] of an `nn.Linear` or a
    transposed `Conv1D`, `None` for anything else."""
    if isinstance(m, nn.Linear):
        return LinearLayer(m.weight, m.bias, False, m.in_features, m.out_features)
    if isinstance(m, nn.Module) and is_conv1d(m):
        w = m.weight
        assert isinstance(w, torch.Tensor)
        b = getattr(m, "bias", None)
        return LinearLayer(w, b if isinstance(b, torch.Tensor) else None, True, w.shape[0],
                           w.shape[1])
    return None


def storage(t: object) -> int | None:
    """The data pointer of a floating tensor's storage (`None` for anything else): two tensors
    that share it are the same activation, whatever views were taken of it."""
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
    return None


@dataclass(frozen=True)
class Consumer:
    r"""A linear map that reads a norm's output: rows `start:stop` of a weight and its bias.

    Attributes
    ----------
    weight : str
        Parameter name of the weight.
    in_axis : int
        The weight's input axis: `1` for `nn.Linear` (`(out, in)`), `0` for the transposed
        `Conv1D` of GPT-2 (`(in, out)`).
    start, stop : int
        The output features that read the norm (all of them: `0, -1`; a slice of a fused
        `in_proj_weight`: e.g. `d, 2d` for the keys).
    bias : str or None
        Parameter name of the bias of these outputs, or None (no bias).
    bias_start : int or None
        Where the outputs' bias entries start in `bias` (None: at `start`, the same slice as
        the weight rows; `0` for the separate `q_bias`/`v_bias` of timm's BEiT and EVA).
    """

    weight: str
    in_axis: int = 1
    start: int = 0
    stop: int = -1
    bias: str | None = None
    bias_start: int | None = None

    def _bias_slice(self, stop: int) -> tuple[int, int]:
        b0 = self.start if self.bias_start is None else self.bias_start
        return b0, b0 + stop - self.start

    def _stop(self, t: torch.Tensor) -> int:
        return t.shape[1 - self.in_axis] if self.stop < 0 else self.stop

    def read(self, params: Params) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(M, b)`: the `(out, in)` matrix of the slice and its bias (or None)."""
        W = params[self.weight]
        stop = self._stop(W)
        M = W[self.start:stop] if self.in_axis == 1 else W[:, self.start:stop].transpose(0, 1)
        if self.bias is None:
            return M, None
        b0, b1 = self._bias_slice(stop)
        return M, params[self.bias].reshape(-1)[b0:b1]

    def write_bias(self, params: dict, b: torch.Tensor) -> None:
        """Out-of-place write of the bias slice `b` into `params` (the weight untouched)."""
        if self.bias is None:
            return
        t = params[self.bias]
        b0, b1 = self._bias_slice(self._stop(params[self.weight]))
        params[self.bias] = t.reshape(-1).slice_scatter(b.to(t.dtype), 0, b0, b1).view(t.shape)

    def write(self, params: dict, M: torch.Tensor, b: torch.Tensor | None) -> None:
        """Out-of-place write of `(M, b)` into `params`."""
        W = params[self.weight]
        stop = self._stop(W)
        if self.in_axis == 1:
            params[self.weight] = W.slice_scatter(M.to(W.dtype), 0, self.start, stop)
        else:
            params[self.weight] = W.slice_scatter(M.transpose(0, 1).to(W.dtype), 1, self.start,
                                                  stop)
        if b is not None and self.bias is not None:
            t = params[self.bias]
            b0, b1 = self._bias_slice(stop)
            flat = t.reshape(-1).slice_scatter(b.to(t.dtype), 0, b0, b1)
            params[self.bias] = flat.view(t.shape)


class NotFoldable(Exception):
    """Raised by a reader: the module reads the tensor, but not as linear maps a fold can
    compensate in."""


@dataclass(frozen=True)
class ReadQuery:
    """What a reader is asked: does a module call read the tensor of storage `ptr`, of width
    `d`? `name(p)` and `pname(p)` give a parameter's name (`pname`: `None` for `None` or a
    tensor that is no parameter; `name` raises `KeyError` for the latter)."""

    ptr: int | None
    d: int
    name: Callable[[torch.Tensor], str]
    pname: Callable[[torch.Tensor | None], str | None]

    def reads(self, t: object) -> bool:
        """Whether `t` is the tensor asked about."""
        return storage(t) == self.ptr


Reader = Callable[[nn.Module, tuple, dict, ReadQuery], "list[Consumer] | None"]
"""`reader(module, args, kwargs, query)`: the linear maps of the module that read the tensor
(`[]`: it does not read it), `None` if the module is not this reader's, or `NotFoldable`."""


def _first_input(args: tuple, kwargs: dict) -> object:
    return args[0] if args else kwargs.get("input", kwargs.get("x"))


def mha_reader(m: nn.Module, args: tuple, kwargs: dict, q: ReadQuery) -> list[Consumer] | None:
    """The query/key/value input projections of `nn.MultiheadAttention`."""
    if not isinstance(m, nn.MultiheadAttention):
        return None
    slots = [args[i] if len(args) > i else kwargs.get(k)
             for i, k in enumerate(("query", "key", "value"))]
    d_e = m.embed_dim
    out = []
    for i, t in enumerate(slots):
        if not q.reads(t):
            continue
        b = q.pname(m.in_proj_bias)
        if m._qkv_same_embed_dim:
            assert m.in_proj_weight is not None
            out.append(Consumer(q.name(m.in_proj_weight), 1, i * d_e, (i + 1) * d_e, b))
        else:
            w = (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)[i]
            if b is not None:
                raise NotFoldable("separate projection weights with a fused bias")
            assert w is not None
            out.append(Consumer(q.name(w), 1, 0, -1, None))
    return out


def qv_bias_reader(m: nn.Module, args: tuple, kwargs: dict, q: ReadQuery
                   ) -> list[Consumer] | None:
    """timm's BEiT/EVA: `F.linear(x, qkv.weight, cat(q_bias, k_bias, v_bias))` with a zero
    key-bias buffer, so the `qkv` module itself is never called."""
    qkv = getattr(m, "qkv", None)
    qb, vb = getattr(m, "q_bias", None), getattr(m, "v_bias", None)
    if not (isinstance(qkv, nn.Linear) and isinstance(qb, nn.Parameter)
            and isinstance(vb, nn.Parameter) and qkv.in_features == q.d
            and qkv.out_features == 3 * qb.numel()):
        return None
    if not q.reads(_first_input(args, kwargs)):
        return []
    a, wn = qb.numel(), q.name(qkv.weight)
    return [Consumer(wn, 1, 0, a, q.pname(qb), 0), Consumer(wn, 1, a, 2 * a),
            Consumer(wn, 1, 2 * a, 3 * a, q.pname(vb), 0)]


def linear_reader(m: nn.Module, args: tuple, kwargs: dict, q: ReadQuery
                  ) -> list[Consumer] | None:
    """`nn.Linear` and the transposed `Conv1D` of GPT-2 of input width `d`."""
    lin = linear_layer(m)
    if lin is None or lin.in_features != q.d:
        return None
    if not q.reads(_first_input(args, kwargs)):
        return []
    return [Consumer(q.name(lin.weight), 0 if lin.transposed else 1, 0, -1, q.pname(lin.bias))]


READERS: list[Reader] = [mha_reader, qv_bias_reader, linear_reader]
"""The readers, asked in order for every module call with parameters of its own."""


def register_reader(reader: Reader, *, index: int = 0) -> None:
    """Ask `reader` before the readers after `index` (default: before every other one)."""
    if not callable(reader):
        raise TypeError(f"a reader must be callable, got {reader!r}")
    READERS.insert(index, reader)


def readers_of(calls: Iterable[tuple[str, nn.Module, tuple, dict]], query: ReadQuery
               ) -> tuple[list[Consumer], list[str]] | None:
    """The linear maps that read the tensor of `query` in the traced `calls` (`(module name,
    module, args, kwargs)` of every call of a module with parameters of its own), and the names
    of their modules; `None` when a module that reads it is no linear map a reader knows, or
    is `NotFoldable`."""
    found: dict[tuple, Consumer] = {}
    mods: list[str] = []
    for name, m, args, kwargs in calls:
        cons = None
        for reader in READERS:
            try:
                cons = reader(m, args, kwargs, query)
            except NotFoldable:
                return None
            if cons is not None:
                break
        if cons is None:  # no reader knows the module: it must not read the tensor
            if query.reads(_first_input(args, kwargs)):
                return None
            continue
        for c in cons:
            found[(c.weight, c.start)] = c
        if cons:
            mods.append(name)
    return list(found.values()), mods
