r"""Exact geodesic and adaptive sharpness of diagonal networks, batched over a population.

A diagonal network predicts ``x ↦ xᵀ(u ⊙ v)``; write ``β = u ⊙ v``.  Its loss is

$$
L(u, v) = c\,\|X(u \odot v) - y\|_2^2, \qquad c = 1 \ (\text{"sum"}, paper §5.1)
\ \text{or}\ c = 1/(2n) \ (\text{"half_mean"}, Andriushchenko et al.).
$$

Horizontal vectors are ``ξ = (b ⊙ u, b ⊙ v)``, ``b ∈ R^d`` (§5.1, Eq. 6/7), so every geodesic
measure is a maximisation over ``b``:

$$
S^ρ(u, v) = \max_{\|A \odot b\|_2 \le ρ,\ b \in \mathcal D} L(R_{(u,v)}(bu, bv)) - L(u, v),
$$

with the perturbation ``R`` chosen by the ``retraction`` of
[`DiagonalGeometry`][quotient_manifolds.sharpness.diagonal.DiagonalGeometry] (Eq. 5; Eq. 24):

* ``"exact"``: the closed-form geodesic, inv $β e^{2b}$, mix ``β (1 + 2b)``
  (the tangent space of [`DiagonalQuotient`][quotient_manifolds.manifolds.DiagonalQuotient]);
* ``"second_order"``: ``w + ξ − ½Γ_w(ξ, ξ)`` (Eq. 5);
* ``"first_order"``: ``w + ξ``, i.e. ``β(1 + b)²`` (App. G ablation (b)),

and the ball weights ``A`` chosen by its ``ball`` (§5.1, Eq. 6/7; App. E;
[√2 constants][sqrt2-constants]; App. G, H.2):

| ``ball`` | inv | mix |
|---|---|---|
| ``"metric"`` | ``A = √2`` | ``A = √2 |β|`` (``‖ξ‖²_mix = 2‖β ⊙ b‖²``) |
| ``"coefficient"`` | ``A = 1`` | ``A = 1`` (``‖b‖ ≤ ρ``, App. E's inv ball) |
| ``"adaptive"`` | ``A = √2`` | ``A = √2`` (App. G ablation (a): ``‖ξ ⊘ |w|‖``) |

For inv the metric norm *is* the adaptive norm (App. F), so ``"adaptive"`` = ``"metric"``
there, and ``"coefficient"`` only rescales ρ by √2.  For mix the three differ: with the
metric norm, ``β' − β = 2β ⊙ b`` ranges over a Euclidean ball of radius ``√2ρ`` whatever
the model, and only the domain below depends on it.

The ``"metric"`` row of mix is App. E's mix convention: App. E derives the mix closed form
with the β-weighted norm ``‖2 D_β b‖ = √2 ‖ξ‖_mix``, i.e. the metric ball up to √2 in ρ.
``‖b‖ ≤ ρ`` (``"coefficient"``) is App. E's *inv* convention (where it is the metric ball up
to √2 in ρ); applied to mix it is a different ball.

The mix geodesic ``u√(1 + 2b)`` needs ``1 + 2b > 0`` (Eq. 24), so its feasible set is
``𝒟 = {b_i ≥ −½ + δ}``.  The box contains 0 and is star-shaped about it, so "clamp, then
shrink radially" keeps both constraints.  Coordinates with ``u_i = 0`` or ``v_i = 0``
(outside the quotient ``R_*^d × R_*^d``) are masked: their ``b_i`` stays 0.

Adaptive sharpness (``measure="adaptive"``, Eq. 1) perturbs all ``2d`` weights:
``(u + |u| ⊙ z_u, v + |v| ⊙ z_v)`` with ``‖z‖₂ ≤ ρ``, i.e. ``‖δ ⊘ |w|‖₂ ≤ ρ``.

The population is one batch of independent problems,
[`DiagonalPopulation`][quotient_manifolds.sharpness.diagonal.DiagonalPopulation]: the tangent
vectors of all members are one ``(B, 2d)`` tensor of the product tangent space of
``DiagonalQuotient(...).at(x0)`` (resp. ``AdaptiveEuclidean().at(w)``), the feasible set is the
model engine's [`MetricBall`][quotient_manifolds.sharpness.feasible.MetricBall]
(``ball="metric"``) or [`AdaptiveNormBall`][quotient_manifolds.sharpness.feasible.AdaptiveNormBall]
with ``c = |w|`` (``"adaptive"``; ``"coefficient"`` is the same ball at radius ``√2ρ``, since
``‖ξ ⊘ |w|‖² = 2‖b‖²``), and the solver is the model engine's: the worst case by
[`APGD`][quotient_manifolds.sharpness.solvers.APGD] (Auto-PGD with one step size and best point
per member, zero start plus random restarts), the average case by
[`Average`][quotient_manifolds.sharpness.solvers.Average], whose samples are ``ρ`` times a
standard Gaussian of the ball's norm on the horizontal space; in the mix domain the coordinates
that leave it are redrawn (a truncated Gaussian, the feasible set's `sample`).

**Unconstrained mix** (``DiagonalGeometry(domain=False)``, exact mix only). The formula
``β' = β(1 + 2b)`` is a polynomial that can be continued past the geodesic's domain. Every
ball above is diagonal in ``b`` (``‖ξ‖² = Σ A_i² b_i²``, the weights ``A`` of the table), so
with ``s = A ⊙ b`` and ``D = diag(2β/A)``, ``β' = β + D s`` and the loss increase
``f(s) = gᵀs + ½ sᵀ M s`` (``g = 2c D Xᵀ r``, ``M = 2c D XᵀX D``, ``r = Xβ − y``) is a convex
quadratic on the ball ``‖s‖ ≤ ρ``: a trust-region problem, solved exactly
([`mix_trust_region`][quotient_manifolds.sharpness.diagonal.mix_trust_region]:
eigendecomposition of ``M`` and the secular equation, with the "hard case"). The average case
then draws untruncated Gaussians.

```python
from quotient_manifolds.sharpness import Average
from quotient_manifolds.sharpness.diagonal import DiagonalGeometry, diagonal_sharpness

mix = DiagonalGeometry(metric="mix", ball="coefficient")
worst = diagonal_sharpness(u, v, X, y, rho=0.1, geometry=mix)          # (B,)
avg = diagonal_sharpness(u, v, X, y, rho=0.1, geometry=mix, solver=Average(n=100),
                         seed=[1000 + i for i in range(len(u))])      # one stream per member
```
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ShapeError
from ..manifolds import AdaptiveEuclidean, DiagonalQuotient
from ..manifolds.base import RETRACTIONS
from ..manifolds.diagonal import DiagonalTangentSpace
from ..manifolds.product import ProductTangentSpace
from ..models.config import check_choice
from .checks import check_rho
from .feasible import AdaptiveNormBall, FeasibleSet, MetricBall
from .solvers import APGD, Average

__all__ = [
    "DIAGONAL_BALLS",
    "DiagonalGeometry",
    "DiagonalPopulation",
    "diagonal_loss",
    "diagonal_sharpness",
    "mix_trust_region",
    "perturb_horizontal",
]

DIAGONAL_BALLS = ("metric", "coefficient", "adaptive")
"""The radius conventions of
[`DiagonalGeometry`][quotient_manifolds.sharpness.diagonal.DiagonalGeometry] (the table of
[`diagonal`][quotient_manifolds.sharpness.diagonal])."""
_MEASURES = ("geodesic", "adaptive")
_REDUCTIONS = ("half_mean", "sum")


def diagonal_loss(
    beta: torch.Tensor, X: torch.Tensor, y: torch.Tensor, reduction: str = "half_mean"
) -> torch.Tensor:
    r"""``c ‖X β − y‖²`` for a batch of predictors ``β`` of shape ``(..., d)``.

    ``reduction="sum"``: ``c = 1`` (paper); ``"half_mean"``: ``c = 1/(2n)``.
    """
    r = beta @ X.T - y
    s = (r * r).sum(-1)
    if reduction == "sum":
        return s
    if reduction == "half_mean":
        return s / (2 * X.shape[0])
    raise ValueError(f"reduction must be 'sum' or 'half_mean', got {reduction!r}")


def perturb_horizontal(
    u: torch.Tensor, v: torch.Tensor, b: torch.Tensor, metric: str, retraction: str
) -> torch.Tensor:
    r"""``β`` after moving ``(u, v)`` along the horizontal vector ``(b ⊙ u, b ⊙ v)``.

    Uses the tangent space of [`DiagonalQuotient`][quotient_manifolds.manifolds.DiagonalQuotient],
    so ``"exact"`` is the closed-form geodesic: inv $β e^{2b}$, mix ``β(1 + 2b)``, and
    raises [`GeodesicDomainError`][quotient_manifolds.errors.GeodesicDomainError] if ``1 + 2b ≤ 0``
    for mix.  ``"second_order"`` gives inv ``β(1 + b + b²/2)²`` and mix
    ``β(1 + b − b²/2)²``; ``"first_order"`` gives ``β(1 + b)²`` for both metrics.
    """
    check_choice("retraction", retraction, RETRACTIONS)
    M = DiagonalQuotient(metric, retraction, validate=False)
    x = M.pack_point(u, v)
    return M.invariant(M.at(x).retract(M.pack_point(b * u, b * v)))


def _check_shapes(u: torch.Tensor, v: torch.Tensor, X: torch.Tensor) -> None:
    if u.shape != v.shape or u.ndim != 2 or X.ndim != 2 or X.shape[1] != u.shape[1]:
        raise ShapeError(
            f"expected u, v of shape (B, d) and X of shape (n, d); got u {tuple(u.shape)}, "
            f"v {tuple(v.shape)}, X {tuple(X.shape)}"
        )


@dataclass(frozen=True)
class DiagonalGeometry:
    r"""The geodesic measure of a diagonal network: metric, perturbation, ball and domain.

    The diagonal counterpart of [`Geometry`][quotient_manifolds.sharpness.config.Geometry];
    frozen and validated, so one instance can be shared by many calls.

    Attributes
    ----------
    metric : {"inv", "mix"}
        The metric of [`DiagonalQuotient`][quotient_manifolds.manifolds.DiagonalQuotient]
        (§5.1, Eq. 6 / Eq. 7).
    retraction : {"exact", "second_order", "first_order"}
        How ``(u, v)`` moves along ``ξ``: the closed-form geodesic (inv $β e^{2b}$, mix
        ``β(1 + 2b)``, Eq. 24), ``w + ξ − ½Γ_w(ξ, ξ)`` (Eq. 5) or ``w + ξ`` (App. G ablation
        (b)).
    ball : {"metric", "coefficient", "adaptive"}
        The radius convention ([`diagonal`][quotient_manifolds.sharpness.diagonal]): the metric
        norm ``‖ξ‖_w ≤ ρ``, the coefficient ball ``‖b‖ ≤ ρ`` (App. E's inv convention) or the
        adaptive norm ``‖ξ ⊘ |w|‖ ≤ ρ`` (App. G ablation (a)).
    domain : bool
        ``False`` (exact mix only): drop the domain constraint ``1 + 2b > 0`` and continue
        ``β(1 + 2b)`` past it (the unconstrained mix); the worst case is then solved exactly by
        [`mix_trust_region`][quotient_manifolds.sharpness.diagonal.mix_trust_region], the
        average case draws untruncated Gaussians.
    domain_margin : float
        ``δ`` in the mix domain ``b ≥ −½ + δ``.
    """

    metric: str = "inv"
    retraction: str = "exact"
    ball: str = "metric"
    domain: bool = True
    domain_margin: float = 1e-6

    def __post_init__(self) -> None:
        check_choice("metric", self.metric, ("inv", "mix"))
        check_choice("retraction", self.retraction, RETRACTIONS)
        check_choice("ball", self.ball, DIAGONAL_BALLS)
        if not (0.0 <= self.domain_margin < 0.5):
            raise ValueError(f"domain_margin must be in [0, 0.5), got {self.domain_margin!r} "
                             "(the mix domain is b ≥ −1/2 + domain_margin)")
        if not self.domain and (self.metric != "mix" or self.retraction != "exact"):
            raise ValueError(
                "domain=False only applies to the exact mix geodesic (metric='mix', "
                f"retraction='exact'), got metric={self.metric!r}, "
                f"retraction={self.retraction!r}; drop domain=False for other geometries"
            )

    def replace(self, **changes: Any) -> DiagonalGeometry:
        """A copy with `changes` applied (validated)."""
        return dataclasses.replace(self, **changes)


class DiagonalPopulation:
    r"""A population of diagonal networks as one batch of independent problems.

    A [`BatchProblem`][quotient_manifolds.sharpness.solvers.BatchProblem] of the solvers
    ([`APGD`][quotient_manifolds.sharpness.solvers.APGD],
    [`Average`][quotient_manifolds.sharpness.solvers.Average]) with one problem per row of
    ``u``, ``v``: the perturbation is one ``(B, D)`` tensor of the product tangent space (``D =
    2d``: the horizontal ``(b ⊙ u, b ⊙ v)`` of the geodesic measure, or the perturbation of all
    ``2d`` weights of the adaptive one), and `loss` is the loss increase of every member, so the
    solvers' base loss is 0 and their best (or mean) loss is the sharpness.

    Parameters
    ----------
    u, v : tensor ``(B, d)``
        Trained factors; ``β = u ⊙ v``. Coordinates with ``u_i v_i = 0`` are masked (held at
        their base value).
    X, y : tensor ``(n, d)``, ``(n,)``
        The batch the loss is measured on.
    measure : {"geodesic", "adaptive"}
        Geodesic sharpness (Eq. 4) over horizontal ``b``, or adaptive sharpness (Eq. 1) over
        all ``2d`` weights, ``(u + δ_u, v + δ_v)`` with ``‖δ ⊘ |w|‖₂ ≤ ρ`` (``geometry`` is
        then unused).
    geometry : DiagonalGeometry, optional
        Metric, retraction, ball and domain of the geodesic measure; default
        ``DiagonalGeometry()`` (inv, exact geodesic, metric ball).
    reduction : {"half_mean", "sum"}
        Loss convention ([`diagonal_loss`][quotient_manifolds.sharpness.diagonal.diagonal_loss]).

    Attributes
    ----------
    base_loss : tensor ``(B,)``
        The loss of every member at ``ξ = 0``.
    space : ProductTangentSpace
        The tangent space of the perturbations, with problems ``(B,)``.
    """

    def __init__(self, u: torch.Tensor, v: torch.Tensor, X: torch.Tensor, y: torch.Tensor, *,
                 measure: str = "geodesic", geometry: DiagonalGeometry | None = None,
                 reduction: str = "half_mean") -> None:
        _check_shapes(u, v, X)
        check_choice("measure", measure, _MEASURES)
        check_choice("reduction", reduction, _REDUCTIONS)
        geometry = DiagonalGeometry() if geometry is None else geometry
        if not isinstance(geometry, DiagonalGeometry):
            raise TypeError(f"geometry must be a DiagonalGeometry, got {type(geometry).__name__}")
        if measure == "adaptive" and not geometry.domain:
            raise ValueError("domain=False only applies to the exact mix geodesic "
                             "(measure='geodesic'), not to measure='adaptive'")
        self.measure, self.geometry, self.reduction = measure, geometry, reduction
        dt = torch.float64
        u, v, X, y = (t.to(dt) for t in (u, v, X, y))
        self.X, self.y, self.beta = X, y, u * v
        self.base_loss = diagonal_loss(self.beta, X, y, reduction)
        B, d = u.shape
        self._d = d
        if measure == "adaptive":
            self._w = torch.cat([u, v], dim=-1)
            self._ok = self._w != 0
            w_safe = torch.where(self._ok, self._w, 1.0)
            ts = AdaptiveEuclidean(0.0, "first_order", ndim=1, validate=False).at(w_safe)
            self.space = ProductTangentSpace([ts], (B,))
        else:
            self._manifold, self._tangent, self.space, self._ok = _geodesic_space(u, v, geometry)

    def feasible_set(self, rho: float) -> FeasibleSet:
        """The ball of radius `rho` of every member (the ball convention of the geometry)."""
        rho = check_rho(rho)
        if self.measure == "adaptive":
            return MetricBall(self.space, rho, self._ok)
        return _geodesic_ball(self.space, self._tangent, rho, self.geometry.ball, self._ok)

    def perturbed(self, xi: torch.Tensor) -> torch.Tensor:
        """The predictors ``β`` `(B, d)` of the members moved along `xi` `(B, D)`; masked
        coordinates stay at their base value."""
        if self.measure == "adaptive":  # w + ξ (ξ = 0 on zero weights)
            p = self._w + xi
            return p[:, : self._d] * p[:, self._d:]
        if not self.geometry.domain:  # β(1 + 2b) continued past 1 + 2b > 0
            b = self._tangent.horizontal_coefficient(self.space.split(xi)[0])
            return torch.where(self._ok, self.beta * (1 + 2 * b), self.beta)
        (pt,) = self.space.retract(xi)
        return torch.where(self._ok, self._manifold.invariant(pt), self.beta)

    def loss(self, xi: torch.Tensor) -> torch.Tensor:
        """The loss increase ``L(β(ξ)) − L(β)`` of every member, `(B,)` (differentiable in
        `xi` when grad mode is on)."""
        return diagonal_loss(self.perturbed(xi), self.X, self.y, self.reduction) - self.base_loss

    def loss_and_grad(self, xi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`loss` and its gradient in `xi`; a non-finite increase is returned as −∞ (never a
        best point) and the gradient through `torch.nan_to_num`."""
        x = xi.detach().requires_grad_(True)
        with torch.enable_grad():
            val = self.loss(x)
            (g,) = torch.autograd.grad(val.sum(), x)
        val = val.detach()
        return torch.where(torch.isfinite(val), val, -math.inf), torch.nan_to_num(g)


def _generators(seed: int | Sequence[int] | None, B: int
                ) -> torch.Generator | list[torch.Generator]:
    """One generator seeded with `seed` (a fresh random seed if `None`), or one per row."""
    if seed is None:
        g = torch.Generator()
        g.seed()
        return g
    if isinstance(seed, int):
        return torch.Generator().manual_seed(seed)
    gens = [torch.Generator().manual_seed(int(sd)) for sd in seed]
    if len(gens) != B:
        raise ShapeError(f"got {len(gens)} seeds for {B} rows; pass one seed per row of u, v "
                         "(or one int for the whole population)")
    return gens


_DEFAULT_SOLVER = APGD(n_iter=100, restarts=3, seed=0)
"""The default solver of `diagonal_sharpness`: Auto-PGD, 100 iterations, zero start plus 3
random starts, seed 0."""


# -- public entry point -----------------------------------------------------------------
def diagonal_sharpness(
    u: torch.Tensor,
    v: torch.Tensor,
    X: torch.Tensor,
    y: torch.Tensor,
    *,
    rho: float,
    measure: str = "geodesic",
    geometry: DiagonalGeometry | None = None,
    solver: APGD | Average | None = None,
    seed: int | Sequence[int] | None = None,
    reduction: str = "half_mean",
) -> torch.Tensor:
    r"""Sharpness of a population of diagonal networks, one value per row of ``u``, ``v``.

    The population is one
    [`DiagonalPopulation`][quotient_manifolds.sharpness.diagonal.DiagonalPopulation], solved
    for all members at once by the model engine's solver.

    Parameters
    ----------
    u, v : tensor ``(B, d)``
        Trained factors; ``β = u ⊙ v``.
    X, y : tensor ``(n, d)``, ``(n,)``
        The batch the loss is measured on (the training set).
    rho : float
        Radius.
    measure : {"geodesic", "adaptive"}
        Geodesic sharpness (Eq. 4) over horizontal ``b``, or adaptive sharpness (Eq. 1)
        over all ``2d`` weights (``geometry`` is then unused).
    geometry : DiagonalGeometry, optional
        Metric, retraction, ball (radius convention) and mix domain of the geodesic measure
        ([`DiagonalGeometry`][quotient_manifolds.sharpness.diagonal.DiagonalGeometry]); default
        ``DiagonalGeometry()``: inv metric, exact geodesic, metric ball.
    solver : APGD or Average, optional
        The worst case by [`APGD`][quotient_manifolds.sharpness.solvers.APGD] (default
        ``APGD(n_iter=100, restarts=3, seed=0)``: zero start plus 3 random starts) or the mean
        over Gaussian draws by [`Average`][quotient_manifolds.sharpness.solvers.Average]
        (e.g. ``Average(n=100)``). With ``geometry.domain=False`` the worst case is the exact
        [`mix_trust_region`][quotient_manifolds.sharpness.diagonal.mix_trust_region] (the
        solver's settings are then unused).
    seed : int or sequence of int, optional
        Seed of the random starts / samples; default: the solver's `seed` (a fresh random one
        if that is `None` too).  A sequence gives every row its own generator, so a member's
        value does not depend on which other rows are measured with it (what a cached,
        resumable population needs).
    reduction : {"half_mean", "sum"}
        Loss convention ([`diagonal_loss`][quotient_manifolds.sharpness.diagonal.diagonal_loss]);
        it scales every value by the same factor.

    Returns
    -------
    tensor ``(B,)``
        ``L(perturbed) − L(u, v)`` at the maximiser (worst) or averaged (average).
    """
    rho = check_rho(rho)
    solver = _DEFAULT_SOLVER if solver is None else solver
    if not isinstance(solver, (APGD, Average)):
        raise TypeError(f"solver must be APGD(...) or Average(...), got {type(solver).__name__} "
                        "(a population is one batch of problems, which these two solve)")
    pop = DiagonalPopulation(u, v, X, y, measure=measure, geometry=geometry, reduction=reduction)
    B = u.shape[0]
    gens = _generators(solver.seed if seed is None else seed, B) if (
        solver.random or seed is not None) else None
    if not pop.geometry.domain and solver.kind == "worst":
        return mix_trust_region(u, v, X, y, rho=rho, ball=pop.geometry.ball,
                                reduction=reduction)[0]
    best, _, _ = solver.solve(pop, pop.feasible_set(rho), torch.zeros(B, dtype=torch.float64),
                             gens)
    return best


def _geodesic_space(u: torch.Tensor, v: torch.Tensor, geometry: DiagonalGeometry
                    ) -> tuple[DiagonalQuotient, DiagonalTangentSpace, ProductTangentSpace,
                               torch.Tensor]:
    """The manifold, its tangent space at ``(u, v)`` (zeros replaced by 1), the product space of
    the population and the mask ``u_i v_i ≠ 0``."""
    ok = (u != 0) & (v != 0)
    M = DiagonalQuotient(geometry.metric, geometry.retraction, validate=False,
                         domain_margin=geometry.domain_margin)
    ts = M.at(M.pack_point(torch.where(ok, u, 1.0), torch.where(ok, v, 1.0)))
    # the unconstrained mix evaluates β(1 + 2b) itself, never a retraction: its space has no
    # domain (the second-order retraction has none), so nothing clips or truncates b
    kind = geometry.retraction if geometry.domain else "second_order"
    return M, ts, ProductTangentSpace([ts], (u.shape[0],), kinds=[kind]), ok


def _geodesic_ball(space: ProductTangentSpace, ts: DiagonalTangentSpace, rho: float, ball: str,
                   ok: torch.Tensor) -> FeasibleSet:
    """The feasible set of `ball` on the horizontal vectors of the population."""
    mask = torch.cat([ok, ok], dim=-1)
    if ball == "metric":
        return MetricBall(space, rho, mask)
    # ‖ξ ⊘ |w|‖² = 2‖b‖²: "coefficient" (‖b‖ ≤ ρ) is the adaptive ball of radius √2ρ
    r = rho * math.sqrt(2.0) if ball == "coefficient" else rho
    return AdaptiveNormBall(space, r, space.join([ts.x0 * ts.x0]), mask)


def _geodesic_set(u: torch.Tensor, v: torch.Tensor, rho: float, geometry: DiagonalGeometry
                  ) -> tuple[DiagonalQuotient, DiagonalTangentSpace, FeasibleSet, torch.Tensor]:
    """The manifold, its tangent space, the feasible set of radius `rho` and the mask."""
    M, ts, space, ok = _geodesic_space(u, v, geometry)
    return M, ts, _geodesic_ball(space, ts, rho, geometry.ball, ok), ok


def _coefficient_weights(feasible: FeasibleSet, ts: DiagonalTangentSpace) -> torch.Tensor:
    r"""``A²`` of shape ``(B, d)`` with ``‖(b ⊙ u, b ⊙ v)‖² = Σ A_i² b_i²`` in the norm of the
    feasible set (every ball of the table is diagonal in ``b``): the per-coordinate terms of
    the squared norm of ``ξ(b = 1) = (u, v)``. The metric's terms are the inner products of
    the one-coordinate tangent spaces at ``(u_i, v_i)`` (the metric acts coordinatewise)."""
    u, v = ts.u, ts.v
    if isinstance(feasible, AdaptiveNormBall):
        a, c = ts.manifold.split(feasible.space.split(feasible.inv_w2)[0])
        return u * u * a + v * v * c
    M = ts.manifold
    x = M.pack_point(u[..., None], v[..., None])  # (B, d, 2): d points of dimension one
    return M.at(x).inner(x)


def mix_trust_region(
    u: torch.Tensor,
    v: torch.Tensor,
    X: torch.Tensor,
    y: torch.Tensor,
    *,
    rho: float,
    ball: str = "metric",
    reduction: str = "half_mean",
    n_bisect: int = 200,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Exact maximum of the unconstrained mix loss increase over the ball, per row.

    Maximises ``f(s) = gᵀs + ½ sᵀMs`` over ``‖s‖₂ ≤ ρ`` (the unconstrained mix of
    [`diagonal`][quotient_manifolds.sharpness.diagonal]; ``s = A ⊙ b``
    with the weights of the ball's norm, masked coordinates held at 0). ``M ⪰ 0``, so the
    maximum lies on the sphere; with ``M = Q Λ Qᵀ`` and ``a = Qᵀg`` the maximiser is
    ``z = (μ − Λ)⁻¹ a`` with ``μ > λ_max`` solving ``‖z(μ)‖ = ρ`` (bisection on
    ``(λ_max, λ_max + ‖a‖/ρ]``, where ``‖z‖`` is decreasing), or, in the hard case
    (``a`` orthogonal to the top eigenspace and ``‖z(λ_max)‖ < ρ``),
    ``z = (λ_max − Λ)^+ a + τ e_max`` on the sphere.

    Returns
    -------
    value, b : ``(B,)`` and ``(B, d)``
        The maximal loss increase and the maximiser's horizontal coefficients ``b``
        (the perturbed predictor is ``β(1 + 2b)``).
    """
    rho = check_rho(rho)
    _check_shapes(u, v, X)
    check_choice("reduction", reduction, _REDUCTIONS)
    geometry = DiagonalGeometry("mix", "exact", ball, domain=False, domain_margin=0.0)
    dt = torch.float64
    u, v, X, y = (t.to(dt) for t in (u, v, X, y))
    c = 1.0 / (2 * X.shape[0]) if reduction == "half_mean" else 1.0
    _, ts, feasible, ok = _geodesic_set(u, v, rho, geometry)
    radius = feasible.rho
    A = torch.where(ok, _coefficient_weights(feasible, ts).clamp_min(0).sqrt(), 1.0)
    beta = u * v
    D = torch.where(ok, 2 * beta / A, 0.0)
    r = beta @ X.T - y
    g = 2 * c * D * (r @ X)
    Mq = 2 * c * D[:, :, None] * (X.T @ X) * D[:, None, :]
    lam, Q = torch.linalg.eigh(Mq)
    a = torch.einsum("bij,bi->bj", Q, g)
    lmax = lam[:, -1:]
    scale = lam.abs().amax(-1, keepdim=True).clamp_min(1.0)
    top = lam >= lmax - 1e-12 * scale
    anorm = a.norm(dim=-1, keepdim=True)
    # hard case: no weight on the top eigenspace and the interior point inside the ball
    gap = torch.where(top, torch.ones_like(lam), lmax - lam)
    z0 = torch.where(top, torch.zeros_like(a), a / gap)
    a_top = torch.where(top, a, torch.zeros_like(a)).norm(dim=-1)
    hard = (a_top <= 1e-12 * anorm.squeeze(-1).clamp_min(1e-300)) & (z0.norm(dim=-1) <= radius)
    lo = torch.zeros_like(lmax)
    hi = anorm / radius + 1e-300
    for _ in range(n_bisect):
        mid = 0.5 * (lo + hi)
        too_long = (a / (mid + lmax - lam)).norm(dim=-1, keepdim=True) > radius
        lo = torch.where(too_long, mid, lo)
        hi = torch.where(too_long, hi, mid)
    z = a / (hi + lmax - lam)
    fill = (radius**2 - (z0 * z0).sum(-1, keepdim=True)).clamp_min(0.0).sqrt()
    e_top = torch.zeros_like(a)
    e_top[:, -1] = 1.0
    z = torch.where(hard[:, None], z0 + fill * e_top, z)
    value = (a * z).sum(-1) + 0.5 * (lam * z * z).sum(-1)
    s = torch.einsum("bij,bj->bi", Q, z)
    return value, torch.where(ok, s / A, 0.0)
