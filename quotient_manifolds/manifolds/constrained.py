r"""The adaptive tangent space restricted to the complement of a set of orbit directions.

A translation symmetry acts on the weights outside the GL blocks by $w \mapsto w + V t$ with a
fixed linear map $V$. Its orbit directions $\operatorname{span} V$ are vertical: moving along
them does not change the function, so a perturbation with a component along them spends part of
the radius on nothing.
[`ConstrainedAdaptiveTangentSpace`][quotient_manifolds.manifolds.constrained.ConstrainedAdaptiveTangentSpace]
is the horizontal space $\mathcal H = \{\xi : \langle \xi, V t\rangle_w = 0\ \forall t\}$ of the
adaptive metric $\langle \xi, \zeta\rangle_w = \sum \xi\zeta/c^2$: every projection, gradient
and sample of
[`AdaptiveTangentSpace`][quotient_manifolds.manifolds.adaptive.AdaptiveTangentSpace] followed by
the metric-orthogonal projection

$$
\Pi_V \xi = \xi - V (V^\top M V)^{+} V^\top M \xi, \qquad M = \operatorname{diag}(1/c^2),
$$

which is idempotent and self-adjoint in $M$. The map $V$ is given by a
[`LinearConstraint`][quotient_manifolds.manifolds.constrained.LinearConstraint]: an object with
`project(u, m)`, the projection above for the diagonal weights `m` (the metric's $1/c^2$, or
$1/w_2$ for the norm of the adaptive-norm ball).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..geometry import adaptive as am
from .adaptive import AdaptiveEuclidean, AdaptiveTangentSpace
from .base import into

__all__ = ["ConstrainedAdaptiveTangentSpace", "LinearConstraint", "SlicedInvC2"]


class LinearConstraint(Protocol):
    """Orbit directions $V$ on a flat vector: `project(u, m)` is $\\Pi_V u$, orthogonal in
    $\\sum u v\\, m$ (`u` of shape `(..., D)`, `m` of shape `(D,)`, non-negative; entries with
    `m = 0` are frozen and never moved; `m` is a `SlicedInvC2` only for a constraint whose
    `reads_slices` is true). `inplace=True` allows the result to be written into `u`.
    `gradient=True` says that `u` is the Riemannian
    gradient of a loss invariant along the orbits: a constraint may then skip what it knows to
    be horizontal already."""

    def project(self, u: torch.Tensor, m: torch.Tensor | SlicedInvC2, gradient: bool = False,
                inplace: bool = False) -> torch.Tensor: ...


class SlicedInvC2:
    r"""$1/c^2$ of a flat adaptive space, made slice by slice when it is read (`m[a:b]`), so
    that a constraint which reads only the entries of its orbits keeps no vector of the
    weights (a stored $c^2$ and $1/c^2$ were 8 B per entry of the ascent state); the values
    are those of `inv_c2`."""

    def __init__(self, space: AdaptiveTangentSpace) -> None:
        self.space = space
        self.dtype, self.device = space.dtype, space.w.device
        self.shape = space.w.shape

    def __getitem__(self, key: slice) -> torch.Tensor:
        sp = self.space
        if "inv_c2" in sp.__dict__:
            return sp.inv_c2[key]
        inv = am.scale2(sp.w[key], sp.eps).reciprocal()
        return inv.nan_to_num_(nan=0.0, posinf=0.0) if sp.frozen else inv


class ConstrainedAdaptiveTangentSpace(AdaptiveTangentSpace):
    r"""[`AdaptiveTangentSpace`][quotient_manifolds.manifolds.adaptive.AdaptiveTangentSpace] at
    $w$ with the horizontal space $\{\xi : V^\top M \xi = 0\}$ (see the module docstring).

    `proju` and `egrad2rgrad` are $\Pi_V$ and $\Pi_V(c^2 \odot \nabla L)$ (the Riemannian
    gradient of the restricted metric), `proju_weighted(u, w2)` is the projection orthogonal in
    $\sum u^2/w_2$; `sample` and `sample_weighted` project their Gaussians the same way, so they
    are the standard Gaussians of $\mathcal H$. The metric, the Christoffel form and the
    retractions are those of the adaptive space ($\mathcal H$ is a linear subspace).

    With `invariant_gradients=True` the caller promises that every `egrad2rgrad` input is the
    gradient of a loss invariant along the orbits, at a point reached by $w + \xi$ (the
    sharpness engine's gradients); the constraint then skips the parts it knows to be
    horizontal already (`project(..., gradient=True)`). The default projects every input.
    """

    def __init__(self, manifold: AdaptiveEuclidean, x0: torch.Tensor,
                 constraint: LinearConstraint, invariant_gradients: bool = False) -> None:
        super().__init__(manifold, x0)
        self.constraint = constraint
        self.invariant_gradients = invariant_gradients
        self._weights: tuple[torch.Tensor, torch.Tensor] | None = None
        self._sliced: SlicedInvC2 | None = None

    @property
    def _m(self) -> torch.Tensor | SlicedInvC2:
        """The metric's weights as the constraint reads them: by slices where it can."""
        if self._flat and getattr(self.constraint, "reads_slices", False):
            if self._sliced is None:
                self._sliced = SlicedInvC2(self)
            return self._sliced
        return self.inv_c2

    def proju(self, u: torch.Tensor) -> torch.Tensor:
        return self.constraint.project(super().proju(u), self._m)

    def proju_weighted(self, u: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        if self._weights is None or self._weights[0] is not w2:  # one m per w2 (the cache
            m = torch.where(w2 > 0, 1.0 / torch.where(w2 > 0, w2, 1.0), 0.0).to(self.dtype)
            self._weights = (w2, m * self.live)  # of the constraint is keyed on it)
        return self.constraint.project(super().proju(u), self._weights[1])

    def egrad2rgrad(self, g: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        if g.dtype == self.dtype and getattr(self.constraint, "reads_slices", False):
            # c² ⊙ ∇L chunk by chunk into `out` (or a fresh vector), then projected there
            r = super().egrad2rgrad(g, out=out if out is not None else torch.empty_like(g))
            return self.constraint.project(r, self._m, gradient=self.invariant_gradients,
                                           inplace=True)
        r = super().egrad2rgrad(g)
        r = self.constraint.project(r.to(self.dtype), self._m,
                                    gradient=self.invariant_gradients)
        return into(r.to(g.dtype), out)

    def egrad2rgrad_and_norm2(self, g: torch.Tensor, *, out: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.egrad2rgrad(g, out=out)
        return r, self.inner(r)
