r"""Products of tangent spaces on flat packed tangent vectors.

A tangent vector of a product is one tensor of shape `(*problems, D)`: the parts of the
factor tangent spaces, each flattened, side by side along the last dimension. `problems` are
leading dimensions of independent problems (e.g. the members of a population of diagonal
networks, each with its own base point); every reduction (`inner`, `norm`) returns one value
per problem. One flat tensor lets the optimizer work with a handful of fused elementwise
operations instead of one per parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import Generator, TangentSpace

__all__ = ["ProductTangentSpace"]


class ProductTangentSpace:
    r"""The product of tangent spaces $T_{x_1} \times \dots \times T_{x_K}$ on flat vectors.

    Parameters
    ----------
    spaces : sequence of TangentSpace
        The factors; each base point has shape `(*problems, *part_shape)`.
    problems : tuple of int
        Leading dimensions of independent problems (`()` for one model).
    kinds : sequence of str, optional
        The retraction of each factor (default: each manifold's own), used by `retract` and
        `clip_to_domain`.
    labels : sequence of str, optional
        A label per factor (e.g. `"blocks"`, `"adaptive"`);
        [`inner_by_label`][quotient_manifolds.manifolds.product.ProductTangentSpace.inner_by_label]
        sums the parts of each label.

    Notes
    -----
    The inner product is the sum of the factors' ones, so the product metric is the one of
    the paper's total norm (App. C): $\|\xi\|^2 = \sum_k \|\xi_k\|^2_{x_k}$.
    """

    def __init__(self, spaces: Sequence[TangentSpace], problems: tuple[int, ...] = (),
                 labels: Sequence[str] | None = None,
                 kinds: Sequence[str | None] | None = None) -> None:
        self.spaces = list(spaces)
        self.kinds = [None] * len(self.spaces) if kinds is None else list(kinds)
        self.problems = tuple(int(p) for p in problems)
        p = len(self.problems)
        for s in self.spaces:
            if tuple(s.x0.shape[:p]) != self.problems:
                raise ValueError(f"a factor's base point has shape {tuple(s.x0.shape)}, which "
                                 f"does not start with the problem shape {self.problems}")
        self.shapes = [tuple(s.x0.shape[p:]) for s in self.spaces]
        self.sizes = [math.prod(sh) for sh in self.shapes]
        self.D = sum(self.sizes)
        self.labels = list(labels) if labels is not None else ["total"] * len(self.spaces)
        x0s = [s.x0 for s in self.spaces]
        self.dtype = x0s[0].dtype if x0s else torch.float32
        self.device = x0s[0].device if x0s else torch.empty(0).device

    # -- packing ---------------------------------------------------------------
    def split(self, xi: torch.Tensor) -> list[torch.Tensor]:
        """Views of the factors' parts of `xi` `(*problems, D)`, each shaped like its base point."""
        lead = xi.shape[:-1]
        return [t.view(*lead, *sh)
                for t, sh in zip(torch.split(xi, self.sizes, dim=-1), self.shapes, strict=True)]

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The flat vector of per-factor parts (the inverse of `split`)."""
        p = len(self.problems)
        flat = [t.reshape(*t.shape[:p], -1) for t in parts]
        if not flat:
            return torch.zeros(*self.problems, 0, dtype=self.dtype, device=self.device)
        return flat[0] if len(flat) == 1 else torch.cat(flat, dim=-1)

    def zeros(self) -> torch.Tensor:
        """The zero tangent vector, `(*problems, D)`."""
        return torch.zeros(*self.problems, self.D, dtype=self.dtype, device=self.device)

    def points(self) -> list[torch.Tensor]:
        """The base points of the factors."""
        return [s.x0 for s in self.spaces]

    def _map(self, fn, *vectors: torch.Tensor) -> torch.Tensor:
        views = [self.split(v) for v in vectors]
        return self.join([fn(s, *vs) for s, *vs in zip(self.spaces, *views, strict=True)])

    def _map_into(self, fn, u: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`fn(space, part)` of every part written into `out` (which may be `u`)."""
        for s, a, o in zip(self.spaces, self.split(u), self.split(out), strict=True):
            r = fn(s, a, o)
            if r is not o:
                o.copy_(r)
        return out

    # -- the metric ---------------------------------------------------------------
    def _to_problems(self, t: torch.Tensor) -> torch.Tensor:
        p = len(self.problems)
        return t.sum(dim=tuple(range(p, t.dim()))) if t.dim() > p else t

    def inners(self, u: torch.Tensor, v: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each factor's inner product, reduced to `(*problems)`."""
        us = self.split(u)
        vs = us if v is None else self.split(v)
        return [self._to_problems(s.inner(a, None if v is None else b))
                for s, a, b in zip(self.spaces, us, vs, strict=True)]

    def inner(self, u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        r"""$\sum_k \langle u_k, v_k\rangle_{x_k}$, shape `(*problems)`."""
        parts = self.inners(u, v)
        if not parts:
            return torch.zeros(self.problems, dtype=u.dtype, device=u.device)
        return torch.stack(parts).sum(0)

    def inner_by_label(self, u: torch.Tensor) -> dict[str, torch.Tensor]:
        r"""$\|u\|^2$ summed over the factors of each label, `{label: (*problems)}`."""
        out: dict[str, torch.Tensor] = {}
        for lab, val in zip(self.labels, self.inners(u), strict=True):
            out[lab] = out[lab] + val if lab in out else val
        return out

    def norm(self, u: torch.Tensor) -> torch.Tensor:
        r"""$\|u\|$, shape `(*problems)`."""
        return self.inner(u).clamp_min(0).sqrt()

    def vertical_norm2(self, u: torch.Tensor) -> torch.Tensor:
        r"""$\|\Pi u - u\|^2$ (the squared distance of `u` from the horizontal space), factor by
        factor: one factor's vector at a time, never one of the whole length."""
        total = torch.zeros(self.problems, dtype=u.dtype, device=u.device)
        for s, a in zip(self.spaces, self.split(u), strict=True):
            d = s.proju(a)
            own = d.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
            d = d.sub_(a) if own else d - a
            total = total + self._to_problems(s.inner(d))
        return total

    # -- projections, gradients, retractions ----------------------------------------
    def proju(self, u: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        r"""The metric-orthogonal horizontal projection, factor by factor (into `out`, which
        may be `u`, if given)."""
        if out is not None:
            return self._map_into(lambda s, a, o: s.proju(a), u, out)
        return self._map(lambda s, a: s.proju(a), u)

    def proju_weighted(self, u: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        r"""The horizontal projection orthogonal in $\sum u^2/w_2$, factor by factor."""
        return self._map(lambda s, a, w: s.proju_weighted(a, w), u, w2)

    def egrad2rgrad_and_norm2(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The Riemannian gradient written over `g`, and its squared norm.

        Each factor answers for its own part
        ([`TangentSpace.egrad2rgrad_and_norm2`][quotient_manifolds.manifolds.base.TangentSpace.egrad2rgrad_and_norm2]):
        by default with the gradient identity $\|r\|^2_x = \langle g, r\rangle_E$ (Euclidean)
        for $r = \Pi(g^{-1}\nabla)$, which needs no metric product. One value per problem.
        """
        total = None
        for s, a in zip(self.spaces, self.split(g), strict=True):
            _, terms = s.egrad2rgrad_and_norm2(a, out=a)
            n2 = self._to_problems(terms)
            total = n2 if total is None else total + n2
        if total is None:
            total = torch.zeros(self.problems, dtype=g.dtype, device=g.device)
        return g, total

    def egrad2rgrad(self, g: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The horizontal Riemannian gradient, factor by factor (into `out`, which may be `g`,
        if given)."""
        if out is not None:
            return self._map_into(lambda s, a, o: s.egrad2rgrad(a, out=o), g, out)
        return self._map(lambda s, a: s.egrad2rgrad(a), g)

    def clip_to_domain(self, u: torch.Tensor) -> torch.Tensor:
        """`u` moved into the domain of every factor's retraction."""
        if not any(type(s).clip_to_domain is not TangentSpace.clip_to_domain
                   for s in self.spaces):
            return u
        return self.join([s.clip_to_domain(a, k) for s, a, k in
                          zip(self.spaces, self.split(u), self.kinds, strict=True)])

    def retract(self, u: torch.Tensor, kinds: Sequence[str | None] | None = None
                ) -> list[torch.Tensor]:
        """The points reached along `u`, one per factor, by the retraction `kinds[k]` of each
        factor (default: `self.kinds`; `None`: the factor manifold's own)."""
        kinds = self.kinds if kinds is None else list(kinds)
        return [s.retract(a, k) for s, a, k in zip(self.spaces, self.split(u), kinds,
                                                   strict=True)]

    # -- sampling -------------------------------------------------------------------
    def sample(self, generator: Generator = None) -> torch.Tensor:
        """A standard Gaussian horizontal vector of the product metric."""
        return self.join([s.sample(generator) for s in self.spaces])

    def sample_weighted(self, w2: torch.Tensor, generator: Generator = None) -> torch.Tensor:
        r"""A standard Gaussian horizontal vector of the norm $\sum u^2 / w_2$."""
        return self.join([s.sample_weighted(w, generator)
                          for s, w in zip(self.spaces, self.split(w2), strict=True)])
