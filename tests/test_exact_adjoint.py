"""The hand-written adjoint of the reduced RK4 geodesic (``gl.geodesic``), in float64.

``gl.geodesic`` differentiates its RK4 by an explicit discrete adjoint instead of the autograd
tape; finite differences (``gradcheck``) check it in every branch: both metrics, with and
without the Gram relaxation ``ε`` (which changes the ``Ṡ`` equation and the coefficients).
"""

import pytest
import torch
from helpers import gl_point

import quotient_manifolds as qm
from quotient_manifolds.geometry import gl


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_adjoint_matches_finite_differences(metric, eps):
    gen = torch.Generator().manual_seed(3)
    M = qm.GLQuotient(4, 3, metric=metric)
    x = gl_point(M, 2, gen, (2,))
    G, H = (t.clone().requires_grad_(True) for t in (x[..., :4, :], x[..., 4:, :]))
    uG, uH = (0.3 * torch.randn(t.shape, generator=gen, dtype=t.dtype).requires_grad_(True)
              for t in (G, H))

    def f(G, H, uG, uH):
        return gl.geodesic(G, H, uG, uH, metric, eps, steps=3)

    assert torch.autograd.gradcheck(f, (G, H, uG, uH))


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_adjoint_survives_retain_graph_and_matches_taped_rk4(metric):
    """Two backward passes on one graph agree, and at many steps the gradient agrees with
    that of RK4 on ``(γ, γ̇)`` in the full space, differentiated by autograd (a different
    discretisation of the same ODE: equal up to truncation error)."""
    gen = torch.Generator().manual_seed(5)
    M = qm.GLQuotient(5, 4, metric=metric, retraction="exact", steps=32)
    x = gl_point(M, 3, gen)
    u = M.proju(x, 0.05 * torch.randn(x.shape, generator=gen, dtype=x.dtype))
    w = torch.randn(x.shape, generator=gen, dtype=x.dtype)
    u1 = u.clone().requires_grad_(True)
    loss = (M.retr(x, u1) * w).sum()
    (g1,) = torch.autograd.grad(loss, u1, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, u1)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    from quotient_manifolds.geometry.ode import rk4_geodesic

    u2 = u.clone().requires_grad_(True)
    y, _ = rk4_geodesic(x, u2, lambda p, v: -M.christoffel(p, v), steps=32)
    (g_ref,) = torch.autograd.grad((y * w).sum(), u2)
    torch.testing.assert_close(g1, g_ref, rtol=1e-5, atol=1e-6)
