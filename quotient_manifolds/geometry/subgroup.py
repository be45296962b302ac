r"""Lie subalgebras $\mathfrak k \subseteq \mathfrak{gl}(h)$ for quotients by subgroups of GL(h).

When only a subgroup $K \subseteq GL(h)$ leaves a block's function unchanged (rotary position
embeddings allow only the rotations' commutant on Q/K), the vertical space shrinks to
$\{(G X, -H X^\top) : X \in \mathfrak k\}$; the metrics and the Christoffel form are those of
the full GL(h) quotient.

This module is pure tensor code; it imports nothing from the manifold layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RotaryCommutant", "Subalgebra"]


@dataclass(frozen=True)
class Subalgebra:
    r"""A Lie subalgebra $\mathfrak k \subseteq \mathfrak{gl}(h)$ (hashable, so blocks can be
    batched by it)."""

    h: int

    def dim(self) -> int:
        """$\\dim \\mathfrak k$."""
        raise NotImplementedError

    def project(self, X: torch.Tensor) -> torch.Tensor:
        """Frobenius-orthogonal projection of `X` `(..., h, h)` onto $\\mathfrak k$."""
        raise NotImplementedError


@dataclass(frozen=True)
class RotaryCommutant(Subalgebra):
    r"""The commutant of rotary position embeddings.

    Elements act on each rotary pair $(i, j)$ as a scaled rotation
    $\begin{pmatrix} a & -b \\ b & a \end{pmatrix}$ in the $(i, j)$ plane, and as an arbitrary
    matrix on the indices in no pair (partial rotary); pairs and free indices do not mix.

    Attributes
    ----------
    h : int
        Head dimension.
    pairs : tuple of (int, int)
        The coordinate pairs that the embedding rotates together: $(i, i + r/2)$ for
        $i < r/2$ in the rotate-half layout (HF Llama, GPT-NeoX; $r$ rotary dimensions),
        $(2i, 2i + 1)$ in the interleaved layout (GPT-J, timm EVA).
    """

    pairs: tuple[tuple[int, int], ...] = ()

    def free(self) -> tuple[int, ...]:
        """Indices in no pair."""
        used = {i for p in self.pairs for i in p}
        return tuple(i for i in range(self.h) if i not in used)

    def dim(self) -> int:
        return 2 * len(self.pairs) + len(self.free()) ** 2

    def project(self, X: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(X)
        free = list(self.free())
        if free:
            idx = torch.tensor(free, device=X.device)
            out[..., idx[:, None], idx[None, :]] = X[..., idx[:, None], idx[None, :]]
        for i, j in self.pairs:
            a = 0.5 * (X[..., i, i] + X[..., j, j])
            b = 0.5 * (X[..., j, i] - X[..., i, j])
            out[..., i, i], out[..., j, j] = a, a
            out[..., j, i], out[..., i, j] = b, -b
        return out
