"""Shared generators and reference computations for the geometry tests."""

from __future__ import annotations

import math

import torch

import quotient_manifolds as qm
from quotient_manifolds.manifolds.checks import metric_tensor


def conditioned_factor(rows: int, h: int, gen: torch.Generator, batch=(), scale: float = 1.0):
    """Random ``rows × h`` matrices with singular values in [0.3, 3]·scale (well conditioned)."""
    a = torch.randn(*batch, rows, h, generator=gen)
    b = torch.randn(*batch, h, h, generator=gen)
    U, _ = torch.linalg.qr(a)
    V, _ = torch.linalg.qr(b)
    s = torch.exp(torch.empty(*batch, h).uniform_(math.log(0.3), math.log(3.0), generator=gen))
    return scale * (U * s.unsqueeze(-2)) @ V.transpose(-1, -2)


def gl_point(M: qm.GLQuotient, h: int, gen: torch.Generator, batch=(), scale_g=1.0, scale_h=1.0):
    G = conditioned_factor(M.n, h, gen, batch, scale_g)
    H = conditioned_factor(M.m, h, gen, batch, scale_h)
    return torch.cat([G, H], dim=-2)


def diag_point(d: int, gen: torch.Generator, batch=()):
    mag = torch.exp(torch.empty(*batch, 2, d).uniform_(-1.0, 1.0, generator=gen))
    sign = torch.where(torch.rand(*batch, 2, d, generator=gen) < 0.5, -1.0, 1.0)
    return mag * sign


def random_gl_element(h: int, gen: torch.Generator, batch=()):
    """A well-conditioned random element of GL(h) (with random sign of det)."""
    return conditioned_factor(h, h, gen, batch)


def vertical_basis(M, x: torch.Tensor, k: int) -> torch.Tensor:
    """Columns spanning the vertical space at one point, via ``M.vertical`` on a basis."""
    shape = _omega_shape(M, x)
    return torch.stack([M.vertical(x, e.reshape(shape)).reshape(-1) for e in torch.eye(k)], dim=1)


def _omega_shape(M, x):
    if isinstance(M, qm.GLQuotient):
        return (x.shape[-1], x.shape[-1])
    return (x.shape[-1],)


def reference_projection(M, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Metric-orthogonal projection onto the complement of the vertical space, by dense algebra.

    Independent of the manifold's closed forms: it uses only ``inner`` (through the
    metric tensor) and ``vertical``.
    """
    k = x.shape[-1] ** 2 if isinstance(M, qm.GLQuotient) else x.shape[-1]
    V = vertical_basis(M, x, k)
    g = metric_tensor(M, x)
    coeff = torch.linalg.lstsq(V.T @ g @ V, V.T @ g @ u.reshape(-1, 1)).solution
    return (u.reshape(-1, 1) - V @ coeff).reshape(u.shape)
