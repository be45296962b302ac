r"""Generic numerical checkers built from a manifold's metric alone.

In the spirit of Manopt's ``checkgradient``/``checkretraction``: these
functions know nothing about the closed forms of a manifold.  They build the
metric tensor ``g_ij(x) = ⟨e_i, e_j⟩_x`` from `inner` on the coordinate
basis, differentiate it with autograd, and contract the textbook formula

$$
Γ^λ_{μν} = \tfrac12 g^{λσ}(\partial _ν g_{σμ} + \partial _μ g_{σν} - \partial _σ g_{μν}).
$$

The tests use them as an independent oracle for ``christoffel`` and to
integrate reference geodesics with SciPy's DOP853.  Cost grows like ``N³``
in the number of coordinates ``N``: meant for small blocks.
"""

from __future__ import annotations

import warnings

import geoopt
import numpy as np
import torch

__all__ = ["metric_tensor", "christoffel_from_metric", "reference_geodesic"]


def metric_tensor(manifold: geoopt.Manifold, x: torch.Tensor) -> torch.Tensor:
    """``g_ij(x) = inner(x, e_i, e_j)`` for the coordinate basis of one point ``x``."""
    N = x.numel()
    basis = torch.eye(N, dtype=x.dtype, device=x.device).reshape(N, *x.shape)
    return manifold.inner(x, basis[:, None], basis[None, :]).reshape(N, N)


def christoffel_from_metric(manifold: geoopt.Manifold, x: torch.Tensor) -> torch.Tensor:
    """Christoffel symbols ``Γ[λ, μ, ν]`` of the metric at ``x``, by autograd."""
    N = x.numel()

    def g_flat(z: torch.Tensor) -> torch.Tensor:
        return metric_tensor(manifold, z.reshape(x.shape))

    z = x.detach().reshape(-1)
    g = g_flat(z)
    with warnings.catch_warnings():
        # torch 2.14 builds its forward-mode decompositions with the deprecated jit.script
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated")
        dg = torch.func.jacfwd(g_flat)(z)  # dg[σ, μ, ν] = ∂_ν g_{σμ}
    term = dg + dg.transpose(1, 2) - dg.permute(2, 0, 1)
    # term[σ, μ, ν] = ∂_ν g_{σμ} + ∂_μ g_{σν} − ∂_σ g_{μν}
    return 0.5 * torch.einsum("ls,smn->lmn", torch.linalg.inv(g), term).reshape(N, N, N)


def reference_geodesic(
    manifold: geoopt.Manifold, x: torch.Tensor, u: torch.Tensor, t: float = 1.0,
    tol: float = 1e-12,
) -> torch.Tensor:
    """``γ_u(t)`` integrated by SciPy's DOP853 with Γ from `christoffel_from_metric`.

    Independent of the manifold's closed-form Christoffel terms and of the
    library's own integrator.  Float64 only; one point at a time.
    """
    from scipy.integrate import solve_ivp

    shape, N = x.shape, x.numel()

    def rhs(_, y):
        pos = torch.from_numpy(y[:N]).reshape(shape).to(x.device)
        vel = torch.from_numpy(y[N:]).to(x.device)
        gamma = christoffel_from_metric(manifold, pos)
        acc = -torch.einsum("lmn,m,n->l", gamma, vel, vel)
        return np.concatenate([y[N:], acc.numpy(force=True)])

    y0 = np.concatenate([t_.detach().double().reshape(-1).numpy(force=True) for t_ in (x, u)])
    sol = solve_ivp(rhs, (0.0, t), y0, method="DOP853", rtol=tol, atol=tol)
    if not sol.success:
        raise RuntimeError(f"reference geodesic failed: {sol.message}")
    return torch.from_numpy(sol.y[:N, -1]).reshape(shape).to(x.device)
