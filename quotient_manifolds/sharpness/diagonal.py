r"""Exact geodesic and adaptive sharpness of diagonal networks, batched over a population.

A diagonal network predicts ``x ↦ xᵀ(u ⊙ v)``; write ``β = u ⊙ v``.  Its loss is

.. math::

    L(u, v) = c\,‖X(u ⊙ v) − y‖_2^2, \qquad c = 1 \ (\text{"sum"}, paper §5.1)
    \ \text{or}\ c = 1/(2n) \ (\text{"half_mean"}, Andriushchenko et al.).

Horizontal vectors are ``ξ = (b ⊙ u, b ⊙ v)``, ``b ∈ R^d`` (spec §5.2), so every geodesic
measure is a maximisation over ``b``:

.. math::

    S^ρ(u, v) = \max_{‖A ⊙ b‖_2 ≤ ρ,\ b ∈ \mathcal D} L(R_{(u,v)}(bu, bv)) − L(u, v),

with the perturbation ``R`` chosen by ``retraction`` (spec §6.3, §6.4.1):

* ``"exact"``: the closed-form geodesic, inv ``β e^{2b}``, mix ``β (1 + 2b)``
  (:class:`~quotient_manifolds.manifolds.DiagonalQuotient` with ``retraction="exact"``);
* ``"second_order"``: ``w + ξ − ½Γ_w(ξ, ξ)`` (Eq. 5);
* ``"first_order"``: ``w + ξ``, i.e. ``β(1 + b)²`` (App. G ablation (b)),

and the ball weights ``A`` chosen by ``ball`` (spec §5.2, §10.1, §12.7):

==================  ======================  ============================================
``ball``            inv                     mix
==================  ======================  ============================================
``"metric"``        ``A = √2``              ``A = √2 |β|`` (``‖ξ‖²_mix = 2‖β ⊙ b‖²``)
``"coefficient"``   ``A = 1``               ``A = 1`` (``‖b‖ ≤ ρ``, App. E's inv ball)
``"adaptive"``      ``A = √2``              ``A = √2`` (App. G ablation (a): ``‖ξ ⊘ |w|‖``)
==================  ======================  ============================================

For inv the metric norm *is* the adaptive norm (App. F), so ``"adaptive"`` = ``"metric"``
there, and ``"coefficient"`` only rescales ρ by √2.  For mix the three differ: with the
metric norm, ``β' − β = 2β ⊙ b`` ranges over a Euclidean ball of radius ``√2ρ`` whatever
the model, and only the domain below depends on it.

The ``"metric"`` row of mix is App. E's mix convention: App. E derives the mix closed form
with the β-weighted norm ``‖2 D_β b‖ = √2 ‖ξ‖_mix``, i.e. the metric ball up to √2 in ρ.
``‖b‖ ≤ ρ`` (``"coefficient"``) is App. E's *inv* convention (where it is the metric ball up
to √2 in ρ); applied to mix it is a different ball.

The mix geodesic ``u√(1 + 2b)`` needs ``1 + 2b > 0`` (spec §6.4.1), so its feasible set is
``𝒟 = {b_i ≥ −½ + δ}``.  The box contains 0 and is star-shaped about it, so "clamp, then
shrink radially" keeps both constraints.  Coordinates with ``u_i = 0`` or ``v_i = 0``
(outside the quotient ``R_*^d × R_*^d``) are masked: their ``b_i`` stays 0.

Adaptive sharpness (``measure="adaptive"``, Eq. 1) perturbs all ``2d`` weights:
``(u + |u| ⊙ z_u, v + |v| ⊙ z_v)`` with ``‖z‖₂ ≤ ρ``, i.e. ``‖δ ⊘ |w|‖₂ ≤ ρ``.

The worst case is found by Auto-PGD (spec §8) run for every member at once
(:func:`apgd_batched`), in the coordinates ``s = A ⊙ b`` (resp. ``z``) where the ball is
Euclidean: the step ``η ∇_s/‖∇_s‖`` is then the normalised Riemannian gradient step of
spec §8.3.  The average case (spec §7.2) draws ``s ~ N(0, ρ² I)``, i.e. Gaussian ξ with
covariance ``ρ²`` × the inverse of the ball's quadratic form on the horizontal space;
coordinates that leave the mix domain are redrawn (a truncated Gaussian).

**Unconstrained mix** (``domain=False``, exact mix only). The formula ``β' = β(1 + 2b)`` is a
polynomial that can be continued past the geodesic's domain: then ``β' = β + D s`` with
``s = A ⊙ b`` and ``D = diag(2β/A)``, and the loss increase
``f(s) = gᵀs + ½ sᵀ M s`` (``g = 2c D Xᵀ r``, ``M = 2c D XᵀX D``, ``r = Xβ − y``) is a convex
quadratic on the ball ``‖s‖ ≤ ρ``: a trust-region problem, solved exactly
(:func:`mix_trust_region`: eigendecomposition of ``M`` and the secular equation, with the
"hard case"). The average case then draws untruncated Gaussians.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..errors import InvalidRadiusError, ShapeError
from ..manifolds import DiagonalQuotient
from .apgd import checkpoints

__all__ = [
    "BALLS",
    "RETRACTIONS",
    "apgd_batched",
    "ball_scale",
    "diagonal_loss",
    "diagonal_sharpness",
    "mix_trust_region",
    "perturb_horizontal",
]

BALLS = ("metric", "coefficient", "adaptive")
RETRACTIONS = ("exact", "second_order", "first_order")


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

    Uses :class:`~quotient_manifolds.manifolds.DiagonalQuotient` (``retr``), so
    ``"exact"`` is the closed-form geodesic: inv ``β e^{2b}``, mix ``β(1 + 2b)``, and
    raises :class:`~quotient_manifolds.errors.GeodesicDomainError` if ``1 + 2b ≤ 0``
    for mix.  ``"second_order"`` gives inv ``β(1 + b + b²/2)²`` and mix
    ``β(1 + b − b²/2)²``; ``"first_order"`` gives ``β(1 + b)²`` for both metrics.
    """
    if retraction not in RETRACTIONS:
        raise ValueError(f"retraction must be one of {RETRACTIONS}, got {retraction!r}")
    M = DiagonalQuotient(metric, retraction, validate=False)
    x = M.pack_point(u, v)
    xi = M.pack_point(b * u, b * v)
    return M.invariant(M.retr(x, xi))


def ball_scale(
    u: torch.Tensor, v: torch.Tensor, metric: str, ball: str
) -> torch.Tensor:
    r"""The weights ``A`` of the ball ``‖A ⊙ b‖ ≤ ρ`` on horizontal coefficients (table above)."""
    if ball not in BALLS:
        raise ValueError(f"ball must be one of {BALLS}, got {ball!r}")
    if metric not in ("inv", "mix"):
        raise ValueError(f"metric must be 'inv' or 'mix', got {metric!r}")
    one = torch.ones_like(u)
    if ball == "coefficient":
        return one
    if ball == "metric" and metric == "mix":
        return math.sqrt(2.0) * (u * v).abs()
    return math.sqrt(2.0) * one


# -- Auto-PGD over a population ----------------------------------------------------------
def _project(s: torch.Tensor, rho: float, lo: torch.Tensor | None, mask: torch.Tensor):
    if lo is not None:
        s = torch.maximum(s, lo)
    s = s * mask
    n = torch.linalg.vector_norm(s, dim=-1, keepdim=True)
    return s * torch.clamp(rho / n.clamp_min(torch.finfo(s.dtype).tiny), max=1.0)


def apgd_batched(
    objective: Callable[[torch.Tensor], torch.Tensor],
    shape: Sequence[int],
    rho: float,
    *,
    lower: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    n_iter: int = 100,
    inits: Sequence[torch.Tensor] = (),
    momentum: float = 0.75,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Auto-PGD (spec §8.3, reference settings) on ``‖s‖₂ ≤ ρ, s ≥ lower``, per batch row.

    The same iteration as :func:`quotient_manifolds.sharpness.apgd.apgd`, with every
    scalar of its state (step ``η = 2ρ``, best value, improvement counter) kept per
    row: step ``z = P(s + η g/‖g‖)``, momentum ``s + α(z − s)``, checkpoints
    :func:`~quotient_manifolds.sharpness.apgd.checkpoints` with step halving and a
    restart from the row's best point when Condition 1 or 2 fires.  One run from zero
    plus one per tensor in ``inits``; the row-wise best over all runs is returned.

    Parameters
    ----------
    objective : callable
        ``(B, k) → (B,)``, differentiable, with ``objective(0) = 0`` (the loss increase).
    shape : (B, k)
    lower : tensor, optional
        Lower bound of ``s`` (``≤ 0``), broadcastable to ``shape``.
    mask : tensor, optional
        ``0/1`` entries; ``s`` is kept at 0 where ``mask = 0``.

    Returns
    -------
    best, best_s : ``(B,)`` and ``(B, k)``
    """
    B, k = shape
    mask = torch.ones(B, k, dtype=dtype) if mask is None else mask.to(dtype)
    W = set(checkpoints(n_iter))
    best = torch.zeros(B, dtype=dtype)
    best_s = torch.zeros(B, k, dtype=dtype)
    for init in (torch.zeros(B, k, dtype=dtype), *inits):
        s = _project(init.to(dtype), rho, lower, mask)
        eta = torch.full((B,), 2.0 * rho, dtype=dtype)
        run_best = torch.zeros(B, dtype=dtype)
        run_s = torch.zeros(B, k, dtype=dtype)
        n_imp = torch.zeros(B, dtype=dtype)
        k_last, eta_last, best_last = 0, eta.clone(), run_best.clone()
        for it in range(n_iter):
            s_req = s.detach().requires_grad_(True)
            val = objective(s_req)
            (g,) = torch.autograd.grad(val.sum(), s_req)
            val = val.detach()
            val = torch.where(torch.isfinite(val), val, torch.full_like(val, -math.inf))
            better = val > run_best
            run_best = torch.where(better, val, run_best)
            run_s = torch.where(better[:, None], s, run_s)
            n_imp = n_imp + better.to(dtype)
            g = torch.nan_to_num(g * mask)
            gn = torch.linalg.vector_norm(g, dim=-1, keepdim=True)
            direction = torch.where(gn > 0, g / gn.clamp_min(torch.finfo(dtype).tiny), 0.0)
            z = _project(s + eta[:, None] * direction, rho, lower, mask)
            s = z if it == 0 else s + momentum * (z - s)
            if it in W:
                cond1 = n_imp < 0.75 * (it - k_last)
                cond2 = (eta == eta_last) & (run_best == best_last)
                eta_last, best_last = eta.clone(), run_best.clone()
                fire = cond1 | cond2
                eta = torch.where(fire, 0.5 * eta, eta)
                s = torch.where(fire[:, None], run_s, s)
                n_imp = torch.zeros_like(n_imp)
                k_last = it
        take = run_best > best
        best = torch.where(take, run_best, best)
        best_s = torch.where(take[:, None], run_s, best_s)
    return best, best_s


def _half_or_sum(n: int, reduction: str) -> float:
    if reduction == "sum":
        return 1.0
    if reduction == "half_mean":
        return 1.0 / (2 * n)
    raise ValueError(f"reduction must be 'sum' or 'half_mean', got {reduction!r}")


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

    Maximises ``f(s) = gᵀs + ½ sᵀMs`` over ``‖s‖₂ ≤ ρ`` (module docstring; ``s = A ⊙ b``,
    ``A`` from :func:`ball_scale`, masked coordinates held at 0). ``M ⪰ 0``, so the maximum
    lies on the sphere; with ``M = Q Λ Qᵀ`` and ``a = Qᵀg`` the maximiser is
    ``z = (μ − Λ)⁻¹ a`` with ``μ > λ_max`` solving ``‖z(μ)‖ = ρ`` (bisection on
    ``(λ_max, λ_max + ‖a‖/ρ]``, where ``‖z‖`` is decreasing), or, in the hard case
    (``a`` orthogonal to the top eigenspace and ``‖z(λ_max)‖ < ρ``),
    ``z = (λ_max − Λ)^+ a + τ e_max`` on the sphere.

    Returns
    -------
    value, s : ``(B,)`` and ``(B, d)``
        The maximal loss increase and the maximiser in the ``s`` coordinates.
    """
    dt = torch.float64
    u, v, X, y = (t.to(dt) for t in (u, v, X, y))
    c = _half_or_sum(X.shape[0], reduction)
    beta = u * v
    A = ball_scale(u, v, "mix", ball)
    ok = (u != 0) & (v != 0) & (A > 0)
    D = torch.where(ok, 2 * beta / torch.where(ok, A, torch.ones_like(A)), torch.zeros_like(A))
    r = beta @ X.T - y
    g = 2 * c * D * (r @ X)
    M = 2 * c * D[:, :, None] * (X.T @ X) * D[:, None, :]
    lam, Q = torch.linalg.eigh(M)
    a = torch.einsum("bij,bi->bj", Q, g)
    lmax = lam[:, -1:]
    scale = lam.abs().amax(-1, keepdim=True).clamp_min(1.0)
    top = lam >= lmax - 1e-12 * scale
    anorm = a.norm(dim=-1, keepdim=True)
    # hard case: no weight on the top eigenspace and the interior point inside the ball
    gap = torch.where(top, torch.ones_like(lam), lmax - lam)
    z0 = torch.where(top, torch.zeros_like(a), a / gap)
    a_top = torch.where(top, a, torch.zeros_like(a)).norm(dim=-1)
    hard = (a_top <= 1e-12 * anorm.squeeze(-1).clamp_min(1e-300)) & (z0.norm(dim=-1) <= rho)
    lo = torch.zeros_like(lmax)
    hi = anorm / rho + 1e-300
    for _ in range(n_bisect):
        mid = 0.5 * (lo + hi)
        too_long = (a / (mid + lmax - lam)).norm(dim=-1, keepdim=True) > rho
        lo = torch.where(too_long, mid, lo)
        hi = torch.where(too_long, hi, mid)
    z = a / (hi + lmax - lam)
    fill = (rho**2 - (z0 * z0).sum(-1, keepdim=True)).clamp_min(0.0).sqrt()
    e_top = torch.zeros_like(a)
    e_top[:, -1] = 1.0
    z = torch.where(hard[:, None], z0 + fill * e_top, z)
    value = (a * z).sum(-1) + 0.5 * (lam * z * z).sum(-1)
    return value, torch.einsum("bij,bj->bi", Q, z)


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
        The batch the loss is measured on (the training set, spec §12.3).
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
        starts) or the mean over ``n_samples`` Gaussian draws (spec §7.2).
    seed : int or sequence of int
        Seed of the random starts / samples.  A sequence gives every row its own
        generator, so a member's value does not depend on which other rows are
        measured with it (what a cached, resumable population needs).
    reduction : {"half_mean", "sum"}
        Loss convention (:func:`diagonal_loss`); it scales every value by the same factor.
    domain_margin : float
        ``δ`` in the mix domain ``b ≥ −½ + δ``.
    domain : bool
        ``False`` (exact mix only): drop the domain constraint ``1 + 2b > 0`` and continue
        ``β(1 + 2b)`` past it (the unconstrained mix of the module docstring); the worst case
        is then solved exactly by :func:`mix_trust_region` (``n_iter``/``n_restarts``
        unused), the average case draws untruncated Gaussians.

    Returns
    -------
    tensor ``(B,)``
        ``L(perturbed) − L(u, v)`` at the maximiser (worst) or averaged (average).
    """
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
        gens = [torch.Generator().manual_seed(seed)]
    else:
        gens = [torch.Generator().manual_seed(int(sd)) for sd in seed]
        if len(gens) != B:
            raise ShapeError(f"got {len(gens)} seeds for {B} rows")

    def randn(k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, k)`` standard normals; with per-row seeds, only ``rows`` draw (others 0)."""
        if isinstance(seed, int):
            return torch.randn(B, k, generator=gens[0], dtype=dt)
        out = torch.zeros(B, k, dtype=dt)
        for i, g in enumerate(gens):
            if rows is None or bool(rows[i]):
                out[i] = torch.randn(k, generator=g, dtype=dt)
        return out

    if measure == "adaptive":
        au, av = u.abs(), v.abs()
        mask = torch.cat([au > 0, av > 0], dim=-1).to(dt)
        lower = None

        def beta_of(s):
            return (u + au * s[:, :d]) * (v + av * s[:, d:])

        k = 2 * d
    else:
        A = ball_scale(u, v, metric, ball)
        ok = (u != 0) & (v != 0) & (A > 0)
        mask = ok.to(dt)
        A = torch.where(ok, A, torch.ones_like(A))
        lower = ((-0.5 + domain_margin) * A
                 if metric == "mix" and retraction == "exact" and domain else None)

        # masked coordinates (u_i v_i = 0) stay at β_i; the geodesic only sees safe ones
        us, vs, beta0 = torch.where(ok, u, 1.0), torch.where(ok, v, 1.0), u * v

        def beta_of(s):
            if unconstrained:  # β(1 + 2b) continued past 1 + 2b > 0
                return beta0 * (1 + 2 * s / A * mask)
            return torch.where(ok, perturb_horizontal(us, vs, s / A * mask, metric, retraction),
                               beta0)

        k = d

    def objective(s):
        return diagonal_loss(beta_of(s), X, y, reduction) - base

    if kind == "worst":
        inits = []
        for _ in range(n_restarts):
            z = randn(k)
            inits.append(0.5 * rho * z / torch.linalg.vector_norm(z, dim=-1, keepdim=True))
        best, _ = apgd_batched(objective, (B, k), rho, lower=lower, mask=mask,
                               n_iter=n_iter, inits=inits, dtype=dt)
        return best
    total = torch.zeros(B, dtype=dt)
    with torch.no_grad():
        for _ in range(n_samples):
            s = rho * randn(k)
            if lower is not None:
                for _ in range(50):  # truncated Gaussian: redraw coordinates outside the domain
                    bad = s < lower
                    if not bool(bad.any()):
                        break
                    s = torch.where(bad, rho * randn(k, rows=bad.any(-1)), s)
                s = torch.maximum(s, lower)
            total += objective(s * mask)
    return total / n_samples
