r"""Pure tensor kernels for diagonal networks ``β = u ⊙ v`` with symmetry GL(1)^d.

Points are pairs ``(u, v)`` of equal shape with nonzero entries; tangent
vectors are pairs ``(ξ_u, ξ_v)``.  All operations are elementwise, so every
leading dimension is a batch dimension.  Formulas: §5.1 of the paper (metrics
Eq. 6/7, geodesics Eq. 24) and [Derivations][derivations-diagonal].
"""

from __future__ import annotations

import torch

from ..errors import GeodesicDomainError

__all__ = [
    "inner_terms",
    "horizontal_coefficient",
    "project",
    "egrad2rgrad",
    "christoffel",
    "geodesic",
]


def inner_terms(
    u: torch.Tensor,
    v: torch.Tensor,
    eu: torch.Tensor,
    ev: torch.Tensor,
    fu: torch.Tensor,
    fv: torch.Tensor,
    metric: str,
) -> torch.Tensor:
    r"""Per-coordinate metric terms (Eq. 6/7), to be summed over coordinates.

    inv: ``η_u ν_u / u² + η_v ν_v / v²``;  mix: ``η_u ν_u v² + η_v ν_v u²``.
    """
    if metric == "inv":
        return eu * fu / u**2 + ev * fv / v**2
    return eu * fu * v**2 + ev * fv * u**2


def horizontal_coefficient(
    u: torch.Tensor, v: torch.Tensor, eu: torch.Tensor, ev: torch.Tensor
) -> torch.Tensor:
    r"""``b = ½(η_u/u + η_v/v)``, the horizontal part in the basis ``(u, v)``.

    A vector is horizontal iff ``η_u/u = η_v/v``, for both metrics.
    """
    return 0.5 * (eu / u + ev / v)


def project(
    u: torch.Tensor, v: torch.Tensor, eu: torch.Tensor, ev: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Projection ``Π(η) = (b ⊙ u, b ⊙ v)``; orthogonal in both metrics."""
    b = horizontal_coefficient(u, v, eu, ev)
    return b * u, b * v


def egrad2rgrad(
    u: torch.Tensor, v: torch.Tensor, gu: torch.Tensor, gv: torch.Tensor, metric: str
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Horizontal Riemannian gradient.

    inv: ``Π(u² ⊙ ∂_u L, v² ⊙ ∂_v L)``;  mix: ``Π(∂_u L / v², ∂_v L / u²)``.
    """
    if metric == "inv":
        ru, rv = u**2 * gu, v**2 * gv
    else:
        ru, rv = gu / v**2, gv / u**2
    return project(u, v, ru, rv)


def christoffel(
    u: torch.Tensor,
    v: torch.Tensor,
    xu: torch.Tensor,
    xv: torch.Tensor,
    yu: torch.Tensor,
    yv: torch.Tensor,
    metric: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Symmetric bilinear Christoffel form ``Γ(ξ, η)``.

    inv: ``Γ_u = −ξ_u η_u / u``, ``Γ_v = −ξ_v η_v / v``.

    mix: ``Γ_u = ((ξ_u η_v + η_u ξ_v) v − u ξ_v η_v) / v²`` and
    ``Γ_v = ((ξ_u η_v + η_u ξ_v) u − v ξ_u η_u) / u²``.
    """
    if metric == "inv":
        return -xu * yu / u, -xv * yv / v
    cross = xu * yv + yu * xv
    return (cross * v - u * xv * yv) / v**2, (cross * u - v * xu * yu) / u**2


def geodesic(
    u: torch.Tensor,
    v: torch.Tensor,
    xu: torch.Tensor,
    xv: torch.Tensor,
    metric: str,
    t: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Closed-form geodesic ``γ(t)`` from ``(u, v)`` with velocity ``(ξ_u, ξ_v)``.

    inv: the metric decouples into ``du²/u²`` per coordinate, so
    $γ(t) = (u e^{tξ_u/u}, v e^{tξ_v/v})$; for horizontal ``ξ = (bu, bv)``
    this is Eq. 24, $(u e^{bt}, v e^{bt})$.

    mix: with ``β = |uv|`` and ``σ = log|u/v|`` the metric reads
    ``½(dβ² + β² dσ²)``, a flat plane in polar coordinates, so geodesics are
    straight lines ``z(t) = β₀ + t(β̇ + iβ₀σ̇)`` in the frame rotated by ``σ₀``.
    Then $|u(t)| = |u| √(|z|/β_{0}) e^{Δσ/2}$ and
    $|v(t)| = |v| √(|z|/β_{0}) e^{-Δσ/2}$ with ``Δσ = arg z``.  For horizontal
    ``ξ`` this is ``(u√(1+2bt), v√(1+2bt))``.  The line must not reach
    ``β = 0``, i.e. ``1 + 2bt > 0``; otherwise
    [`GeodesicDomainError`][quotient_manifolds.errors.GeodesicDomainError].
    """
    if metric == "inv":
        return u * torch.exp(t * xu / u), v * torch.exp(t * xv / v)
    su, sv = torch.sign(u), torch.sign(v)
    a, c = u.abs(), v.abs()
    xa, xc = su * xu, sv * xv
    beta0 = a * c
    beta_dot = xa * c + a * xc
    sigma_dot = xa / a - xc / c
    re = beta0 + t * beta_dot
    im = t * beta0 * sigma_dot
    _check_mix_domain(beta0, beta_dot, beta0 * sigma_dot, t)
    radius = torch.sqrt(torch.hypot(re, im) / beta0)
    half_angle = 0.5 * torch.atan2(im, re)
    return su * a * radius * torch.exp(half_angle), sv * c * radius * torch.exp(-half_angle)


def _check_mix_domain(
    beta0: torch.Tensor, beta_dot: torch.Tensor, im_dot: torch.Tensor, t: float
) -> None:
    # Closest approach of the segment z0 + s(ż), s ∈ [0, t], to the origin.
    speed2 = beta_dot**2 + im_dot**2
    s = (-beta0 * beta_dot / speed2.clamp_min(torch.finfo(beta0.dtype).tiny)).clamp(0.0, t)
    dist = torch.hypot(beta0 + s * beta_dot, s * im_dot)
    tol = torch.finfo(beta0.dtype).eps * beta0
    if bool((dist <= tol).any()):
        raise GeodesicDomainError(
            "the mix-metric geodesic reaches β = u·v = 0 (1 + 2b ≤ 0 for a horizontal "
            "velocity b): it leaves the manifold before t = 1.  Shorten the step "
            "(e.g. rho) or use retraction='second_order'."
        )
