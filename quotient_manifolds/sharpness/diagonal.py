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

with the perturbation ``R`` chosen by ``retraction`` (Eq. 5; Eq. 24):

* ``"exact"``: the closed-form geodesic, inv $β e^{2b}$, mix ``β (1 + 2b)``
  (the tangent space of [`DiagonalQuotient`][quotient_manifolds.manifolds.DiagonalQuotient]);
* ``"second_order"``: ``w + ξ − ½Γ_w(ξ, ξ)`` (Eq. 5);
* ``"first_order"``: ``w + ξ``, i.e. ``β(1 + b)²`` (App. G ablation (b)),

and the ball weights ``A`` chosen by ``ball`` (§5.1, Eq. 6/7; App. E;
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

The population is one batch of independent problems: the tangent vectors of all members are
one ``(B, 2d)`` tensor of the product tangent space of ``DiagonalQuotient(...).at(x0)`` (resp.
``AdaptiveEuclidean().at(w)``), the feasible set is the model engine's
[`MetricBall`][quotient_manifolds.sharpness.feasible.MetricBall] (``ball="metric"``) or
[`AdaptiveNormBall`][quotient_manifolds.sharpness.feasible.AdaptiveNormBall] with ``c = |w|``
(``"adaptive"``; ``"coefficient"`` is the same ball at radius ``√2ρ``, since
``‖ξ ⊘ |w|‖² = 2‖b‖²``), and the worst case is found by the model engine's Auto-PGD
([`apgd`][quotient_manifolds.sharpness.apgd.apgd]), whose state has one entry per member. The
average case draws ``ρ`` times a standard Gaussian of the ball's norm on the horizontal space;
coordinates that leave the mix domain are redrawn (a truncated Gaussian).

**Unconstrained mix** (``domain=False``, exact mix only). The formula ``β' = β(1 + 2b)`` is a
polynomial that can be continued past the geodesic's domain. Every ball above is diagonal in
``b`` (``‖ξ‖² = Σ A_i² b_i²``, the weights ``A`` of the table), so with ``s = A ⊙ b`` and
``D = diag(2β/A)``, ``β' = β + D s`` and the loss increase
``f(s) = gᵀs + ½ sᵀ M s`` (``g = 2c D Xᵀ r``, ``M = 2c D XᵀX D``, ``r = Xβ − y``) is a convex
quadratic on the ball ``‖s‖ ≤ ρ``: a trust-region problem, solved exactly
(`mix_trust_region`: eigendecomposition of ``M`` and the secular equation, with the
"hard case"). The average case then draws untruncated Gaussians.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import InvalidRadiusError, ShapeError
from ..manifolds import AdaptiveEuclidean, DiagonalQuotient
from ..manifolds.adaptive import AdaptiveTangentSpace
from ..manifolds.base import RETRACTIONS
from ..manifolds.diagonal import DiagonalTangentSpace
from ..manifolds.product import ProductTangentSpace
from .apgd import apgd
from .feasible import AdaptiveNormBall, FeasibleSet, MetricBall

__all__ = [
    "BALLS",
    "diagonal_loss",
    "diagonal_sharpness",
    "mix_trust_region",
    "perturb_horizontal",
]

BALLS = ("metric", "coefficient", "adaptive")


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
    if retraction not in RETRACTIONS:
        raise ValueError(f"retraction must be one of {RETRACTIONS}, got {retraction!r}")
    M = DiagonalQuotient(metric, retraction, validate=False)
    x = M.pack_point(u, v)
    return M.invariant(M.at(x).retract(M.pack_point(b * u, b * v)))


def _check(u, v, X, rho, measure, kind, ball, metric, retraction) -> None:
    if not (isinstance(rho, (int, float)) and math.isfinite(rho) and rho > 0):
        raise InvalidRadiusError(f"rho must be a positive finite number, got {rho!r}")
    if u.shape != v.shape or u.ndim != 2 or X.ndim != 2 or X.shape[1] != u.shape[1]:
        raise ShapeError(
            f"expected u, v of shape (B, d) and X of shape (n, d); got u {tuple(u.shape)}, "
            f"v {tuple(v.shape)}, X {tuple(X.shape)}"
        )
    if measure not in ("geodesic", "adaptive"):
        raise ValueError(f"measure must be 'geodesic' or 'adaptive', got {measure!r}")
    if kind not in ("worst", "average"):
        raise ValueError(f"kind must be 'worst' or 'average', got {kind!r}")
    if ball not in BALLS:
        raise ValueError(f"ball must be one of {BALLS}, got {ball!r}")
    if metric not in ("inv", "mix"):
        raise ValueError(f"metric must be 'inv' or 'mix', got {metric!r}")
    if retraction not in RETRACTIONS:
        raise ValueError(f"retraction must be one of {RETRACTIONS}, got {retraction!r}")


# -- public entry point -----------------------------------------------------------------
def diagonal_sharpness(
    u: torch.Tensor,
    v: torch.Tensor,
    X: torch.Tensor,
    y: torch.Tensor,
    *,
    rho: float,
    measure: str = "geodesic",
    metric: str = "inv",
    retraction: str = "exact",
    ball: str = "metric",
    kind: str = "worst",
    n_iter: int = 100,
    n_restarts: int = 3,
    n_samples: int = 100,
    seed: int | Sequence[int] = 0,
    reduction: str = "half_mean",
    domain_margin: float = 1e-6,
    domain: bool = True,
) -> torch.Tensor:
    r"""Sharpness of a population of diagonal networks, one value per row of ``u``, ``v``.

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
        over all ``2d`` weights (``metric``, ``retraction``, ``ball`` are then unused).
    metric : {"inv", "mix"}
    retraction : {"exact", "second_order", "first_order"}
    ball : {"metric", "coefficient", "adaptive"}
        The radius convention (module docstring): the metric norm ``‖ξ‖_w ≤ ρ``, the
        coefficient ball ``‖b‖ ≤ ρ`` (App. E's inv convention), or the adaptive norm
        ``‖ξ ⊘ |w|‖ ≤ ρ`` (App. G ablation (a)).
    kind : {"worst", "average"}
        Auto-PGD maximum (``n_iter`` steps, zero start plus ``n_restarts`` random
        starts) or the mean over ``n_samples`` Gaussian draws.
    seed : int or sequence of int
        Seed of the random starts / samples.  A sequence gives every row its own
        generator, so a member's value does not depend on which other rows are
        measured with it (what a cached, resumable population needs).
    reduction : {"half_mean", "sum"}
        Loss convention (`diagonal_loss`); it scales every value by the same factor.
    domain_margin : float
        ``δ`` in the mix domain ``b ≥ −½ + δ``.
    domain : bool
        ``False`` (exact mix only): drop the domain constraint ``1 + 2b > 0`` and continue
        ``β(1 + 2b)`` past it (the unconstrained mix of the module docstring); the worst case
        is then solved exactly by `mix_trust_region` (``n_iter``/``n_restarts``
        unused), the average case draws untruncated Gaussians.

    Returns
    -------
    tensor ``(B,)``
        ``L(perturbed) − L(u, v)`` at the maximiser (worst) or averaged (average).
    """
    _check(u, v, X, rho, measure, kind, ball, metric, retraction)
    unconstrained = not domain
    if unconstrained and (measure != "geodesic" or metric != "mix" or retraction != "exact"):
        raise ValueError("domain=False only applies to the exact mix geodesic (measure="
                         "'geodesic', metric='mix', retraction='exact')")
    if unconstrained and kind == "worst":
        return mix_trust_region(u, v, X, y, rho=rho, ball=ball, reduction=reduction)[0]
    dt = torch.float64
    u, v, X, y = (t.to(dt) for t in (u, v, X, y))
    B, d = u.shape
    base = diagonal_loss(u * v, X, y, reduction)
    if isinstance(seed, int):
        gens: torch.Generator | list[torch.Generator] = torch.Generator().manual_seed(seed)
    else:
        gens = [torch.Generator().manual_seed(int(sd)) for sd in seed]
        if len(gens) != B:
            raise ShapeError(f"got {len(gens)} seeds for {B} rows")

    ts: AdaptiveTangentSpace | DiagonalTangentSpace
    if measure == "adaptive":
        w = torch.cat([u, v], dim=-1)
        ok = w != 0
        w_safe = torch.where(ok, w, 1.0)
        ts = AdaptiveEuclidean(0.0, "first_order", ndim=1, validate=False).at(w_safe)
        space = ProductTangentSpace([ts], (B,))
        feasible: FeasibleSet = MetricBall(space, rho, ok)

        def beta_of(xi):  # w + ξ (ξ = 0 on zero weights)
            p = w + xi
            return p[:, :d] * p[:, d:]
    else:
        M, dts, feasible, ok = _geodesic_set(u, v, rho, metric, retraction, ball,
                                             domain_margin)
        ts = dts
        space = feasible.space
        beta0 = u * v

        def beta_of(xi):  # masked coordinates (u_i v_i = 0) stay at β_i
            if unconstrained:  # β(1 + 2b) continued past 1 + 2b > 0
                return torch.where(ok, beta0 * (1 + 2 * dts.horizontal_coefficient(
                    space.split(xi)[0])), beta0)
            (pt,) = space.retract(xi)
            return torch.where(ok, M.invariant(pt), beta0)

    def increase(xi):
        return diagonal_loss(beta_of(xi), X, y, reduction) - base

    if kind == "worst":
        return _worst(increase, feasible, gens, n_iter, n_restarts)
    in_domain = measure == "geodesic" and metric == "mix" and retraction == "exact" and domain
    return _average(increase, feasible, ts, gens, n_samples, in_domain, domain_margin)


def _geodesic_set(u: torch.Tensor, v: torch.Tensor, rho: float, metric: str, retraction: str,
                  ball: str, domain_margin: float
                  ) -> tuple[DiagonalQuotient, DiagonalTangentSpace, FeasibleSet, torch.Tensor]:
    """The manifold, its tangent space at ``(u, v)`` (zeros replaced by 1), the feasible set of
    ``ball`` on the horizontal vectors of the population and the mask ``u_i v_i ≠ 0``."""
    B = u.shape[0]
    ok = (u != 0) & (v != 0)
    M = DiagonalQuotient(metric, retraction, validate=False, domain_margin=domain_margin)
    x0 = M.pack_point(torch.where(ok, u, 1.0), torch.where(ok, v, 1.0))
    ts = M.at(x0)
    space = ProductTangentSpace([ts], (B,), kinds=[retraction])
    mask = torch.cat([ok, ok], dim=-1)
    if ball == "metric":
        return M, ts, MetricBall(space, rho, mask), ok
    # ‖ξ ⊘ |w|‖² = 2‖b‖²: "coefficient" (‖b‖ ≤ ρ) is the adaptive ball of radius √2ρ
    r = rho * math.sqrt(2.0) if ball == "coefficient" else rho
    return M, ts, AdaptiveNormBall(space, r, space.join([x0 * x0]), mask), ok


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

    Maximises ``f(s) = gᵀs + ½ sᵀMs`` over ``‖s‖₂ ≤ ρ`` (module docstring; ``s = A ⊙ b``
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
    _check(u, v, X, rho, "geodesic", "worst", ball, "mix", "exact")
    dt = torch.float64
    u, v, X, y = (t.to(dt) for t in (u, v, X, y))
    if reduction not in ("sum", "half_mean"):
        raise ValueError(f"reduction must be 'sum' or 'half_mean', got {reduction!r}")
    c = 1.0 / (2 * X.shape[0]) if reduction == "half_mean" else 1.0
    _, ts, feasible, ok = _geodesic_set(u, v, rho, "mix", "exact", ball, 0.0)
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


def _worst(increase, feasible: FeasibleSet, gens, n_iter: int, n_restarts: int) -> torch.Tensor:
    def objective(xi):
        x = xi.detach().requires_grad_(True)
        val = increase(x)
        (g,) = torch.autograd.grad(val.sum(), x)
        val = val.detach()
        return torch.where(torch.isfinite(val), val, -math.inf), torch.nan_to_num(g)

    inits = [feasible.random_start(gens) for _ in range(n_restarts)]  # at half the radius
    zero = torch.zeros(feasible.problems, dtype=feasible.space.dtype)
    best = zero
    for init in (None, *inits):
        best = torch.maximum(best, apgd(objective, feasible, zero, n_iter=n_iter,
                                        init=init).best_loss)
    return best


def _average(increase, feasible: FeasibleSet, ts, gens, n_samples: int, domain: bool,
             margin: float) -> torch.Tensor:
    """Mean increase over Gaussian perturbations of the ball's norm; in the mix domain, the
    coordinates that leave it are redrawn (a truncated Gaussian, at most 50 times)."""
    per_row = not isinstance(gens, torch.Generator)
    shape = ts.noise_shape

    def noise(rows: torch.Tensor | None = None) -> torch.Tensor:
        """Standard normals; with per-row seeds, only ``rows`` draw (the others are 0)."""
        if not per_row:
            return torch.randn(shape, generator=gens, dtype=ts.x0.dtype)
        out = torch.zeros(shape, dtype=ts.x0.dtype)
        for i, g in enumerate(gens):
            if rows is None or bool(rows[i]):
                out[i] = torch.randn(shape[1:], generator=g, dtype=ts.x0.dtype)
        return out

    mask = feasible.mask
    assert mask is not None  # both feasible sets of this module are built with a mask

    def to_tangent(z: torch.Tensor) -> torch.Tensor:
        if isinstance(feasible, AdaptiveNormBall):
            xi = ts.sample_weighted(feasible.space.split(feasible.w2)[0], noise=z)
        else:
            xi = ts.sample(noise=z)
        return feasible.space.join([xi]) * feasible.rho * mask

    total = torch.zeros(feasible.problems, dtype=ts.x0.dtype)
    with torch.no_grad():
        for _ in range(n_samples):
            z = noise()
            xi = to_tangent(z)
            if domain:
                for _ in range(50):  # redraw the coordinates outside the domain
                    bad = ts.horizontal_coefficient(feasible.space.split(xi)[0]) < -0.5 + margin
                    if not bool(bad.any()):
                        break
                    z = torch.where(bad, noise(rows=bad.any(-1)), z)
                    xi = to_tangent(z)
                xi = feasible.space.clip_to_domain(xi)
            total += increase(xi)
    return total / n_samples
