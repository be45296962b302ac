"""Property tests of GLQuotient in float64."""

import pytest
import torch
from helpers import gl_point, random_gl_element, reference_projection
from hypothesis import given, settings
from hypothesis import strategies as st

import quotient_manifolds as qm
from quotient_manifolds.geometry import gl
from quotient_manifolds.geometry.ode import rk4_geodesic
from quotient_manifolds.manifolds.checks import christoffel_from_metric

METRICS = ["inv", "mix"]


@st.composite
def block_case(draw, max_rows=6):
    n = draw(st.integers(1, max_rows))
    m = draw(st.integers(1, max_rows))
    h = draw(st.integers(1, min(n, m)))
    batch = draw(st.sampled_from([(), (3,), (2, 2)]))
    metric = draw(st.sampled_from(METRICS))
    seed = draw(st.integers(0, 2**31 - 1))
    # Unbalanced factor scales exercise the parts of the metric that mix G and H.
    sg = draw(st.sampled_from([1e-2, 1.0, 10.0]))
    gen = torch.Generator().manual_seed(seed)
    M = qm.GLQuotient(n, m, metric=metric)
    x = gl_point(M, h, gen, batch, scale_g=sg)
    u = torch.randn(x.shape, generator=gen)
    v = torch.randn(x.shape, generator=gen)
    return M, x, u, v, gen


def close(a, b, scale=1.0, rtol=1e-9):
    torch.testing.assert_close(a, b, atol=rtol * scale, rtol=rtol)


@settings(max_examples=60, deadline=None)
@given(block_case())
def test_projection_is_metric_orthogonal_onto_horizontal_space(case):
    M, x, u, v, gen = case
    h = x.shape[-1]
    p = M.proju(x, u)
    omega = torch.randn(*x.shape[:-2], h, h, generator=gen)
    w = M.vertical(x, omega)
    scale = (M.norm(x, p) * M.norm(x, w)).max().item()
    close(M.inner(x, p, w), torch.zeros(x.shape[:-2]), scale)
    assert M.check_vector_on_tangent(x, p, atol=1e-8, rtol=1e-8)
    # u − Π(u) is vertical: it projects to zero.
    close(M.proju(x, u - p), torch.zeros_like(u), M.norm(x, u).max().item())
    close(M.proju(x, w), torch.zeros_like(w), M.norm(x, w).max().item())


@settings(max_examples=60, deadline=None)
@given(block_case())
def test_projection_idempotent_and_self_adjoint(case):
    M, x, u, v, _ = case
    p = M.proju(x, u)
    close(M.proju(x, p), p, M.norm(x, p).max().item())
    lhs, rhs = M.inner(x, p, v), M.inner(x, u, M.proju(x, v))
    close(lhs, rhs, (M.norm(x, u) * M.norm(x, v)).max().item())


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", [0.0, 0.5])
@pytest.mark.parametrize("seed", range(3))
def test_projection_matches_dense_reference(metric, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    M = qm.GLQuotient(4, 3, metric=metric, eps=eps)
    x = gl_point(M, 2, gen)
    u = torch.randn(x.shape, generator=gen)
    torch.testing.assert_close(M.proju(x, u), reference_projection(M, x, u))


def test_printed_sylvester_form_is_not_orthogonal():
    """The paper's A Λ + Λ Aᵀ = B fails orthogonality; ours passes."""
    gen = torch.Generator().manual_seed(0)
    M = qm.GLQuotient(5, 4, metric="inv")
    x = gl_point(M, 3, gen, scale_g=3.0)
    u = torch.randn(x.shape, generator=gen)
    G, H = M.split(x)
    uG, uH = M.split(u)
    grams = gl.grams(G, H)
    A = grams.P @ grams.Q
    B = gl.horizontal_residual(G, H, uG, uH, grams, "inv")
    eye = torch.eye(3)
    # vec(AΛ + ΛAᵀ) = (I⊗A + A⊗I) vec(Λ) (column-major vec)
    K = torch.kron(eye, A) + torch.kron(A, eye)
    lam = torch.linalg.solve(K, B.T.reshape(-1)).reshape(3, 3).T
    printed = torch.cat([uG + G @ lam, uH - H @ lam.T])
    omega = torch.randn(3, 3, generator=gen)
    w = M.vertical(x, omega)
    assert M.inner(x, printed, w).abs() > 1e-3 * M.norm(x, printed) * M.norm(x, w)
    assert M.inner(x, M.proju(x, u), w).abs() < 1e-10 * M.norm(x, u) * M.norm(x, w)


@settings(max_examples=60, deadline=None)
@given(block_case())
def test_riemannian_gradient_identity(case):
    M, x, g, v, _ = case
    vh = M.proju(x, v)
    r = M.egrad2rgrad(x, g)
    assert M.check_vector_on_tangent(x, r, atol=1e-8, rtol=1e-8)
    close(M.inner(x, r, vh), (g * vh).sum((-2, -1)), (M.norm(x, r) * M.norm(x, vh)).max().item())


@pytest.mark.parametrize("metric", METRICS)
def test_gradient_of_invariant_loss_is_horizontal_before_projection(metric):
    gen = torch.Generator().manual_seed(1)
    M = qm.GLQuotient(5, 4, metric=metric)
    x = gl_point(M, 3, gen, batch=(2,)).requires_grad_(True)
    T = torch.randn(2, 5, 4, generator=gen)
    loss = ((M.invariant(x) - T) ** 2).sum() + M.invariant(x).sin().sum()
    (g,) = torch.autograd.grad(loss, x)
    G, H = M.split(x.detach())
    grams = gl.grams(G, H)
    rG, rH = gl.egrad2rgrad(*M.split(g), grams, metric)
    res = gl.horizontal_residual(G, H, rG, rH, grams, metric)
    assert res.abs().max() < 1e-10 * (1 + g.abs().max())
    # A non-invariant loss gives a non-horizontal raw gradient (the check can fail).
    (g2,) = torch.autograd.grad((x**3).sum(), x)
    rG, rH = gl.egrad2rgrad(*M.split(g2), grams, metric)
    assert gl.horizontal_residual(G, H, rG, rH, grams, metric).abs().max() > 1e-3


@settings(max_examples=40, deadline=None)
@given(block_case())
def test_group_invariance_and_equivariance(case):
    M, x, u, v, gen = case
    h = x.shape[-1]
    A = random_gl_element(h, gen, x.shape[:-2])
    xa, ua, va = M.act(x, A), M.act(u, A), M.act(v, A)
    scale = (M.norm(x, u) * M.norm(x, v)).max().item()
    close(M.inner(xa, ua, va), M.inner(x, u, v), scale, rtol=1e-8)
    close(M.norm(xa, ua), M.norm(x, u), M.norm(x, u).max().item(), rtol=1e-8)
    p = M.proju(x, u)
    close(M.proju(xa, ua), M.act(p, A), M.norm(x, u).max().item(), rtol=1e-8)
    assert M.check_vector_on_tangent(xa, M.act(p, A), atol=1e-7, rtol=1e-7)
    close(M.invariant(xa), M.invariant(x), M.invariant(x).abs().max().item(), rtol=1e-8)
    close(M.christoffel(xa, ua, va), M.act(M.christoffel(x, u, v), A), scale, rtol=1e-7)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("horizontal", [True, False])
def test_second_order_perturbation_is_exactly_invariant(metric, horizontal):
    gen = torch.Generator().manual_seed(3)
    M = qm.GLQuotient(7, 6, metric=metric, retraction="second_order")
    x = gl_point(M, 3, gen, batch=(4,))
    u = 0.3 * torch.randn(x.shape, generator=gen)
    u = M.proju(x, u) if horizontal else u
    for scale in (1e-2, 1.0, 1e2):
        A = scale * random_gl_element(3, gen, (4,))
        y, ya = M.retr(x, u), M.retr(M.act(x, A), M.act(u, A))
        torch.testing.assert_close(M.invariant(ya), M.invariant(y), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("metric", METRICS)
def test_exact_geodesic_is_equivariant_and_stays_horizontal(metric):
    gen = torch.Generator().manual_seed(4)
    M = qm.GLQuotient(6, 5, metric=metric, retraction="exact", steps=16)
    x = gl_point(M, 3, gen, batch=(2,))
    u = M.proju(x, 0.3 * torch.randn(x.shape, generator=gen))
    A = random_gl_element(3, gen, (2,))
    torch.testing.assert_close(M.act(M.retr(x, u), A), M.retr(M.act(x, A), M.act(u, A)))
    y, vel = rk4_geodesic(x, u, lambda p, v: -M.christoffel(p, v), steps=256)
    assert M.check_vector_on_tangent(y, vel, atol=1e-8, rtol=1e-8)
    # speed is constant along a geodesic
    torch.testing.assert_close(M.norm(y, vel), M.norm(x, u), rtol=1e-8, atol=0)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", [0.0, 0.3])
@pytest.mark.parametrize("sizes", [(2, 2, 1), (3, 2, 2), (4, 3, 2)])
def test_christoffel_matches_metric_derivatives(metric, eps, sizes):
    """Γ from the closed forms equals ½ g^{λσ}(∂g + ∂g − ∂g) computed by autograd."""
    n, m, h = sizes
    gen = torch.Generator().manual_seed(5)
    M = qm.GLQuotient(n, m, metric=metric, eps=eps)
    x = gl_point(M, h, gen)
    u, v = torch.randn(2, *x.shape, generator=gen)
    gamma = christoffel_from_metric(M, x)
    ref = torch.einsum("lmn,m,n->l", gamma, u.reshape(-1), v.reshape(-1)).reshape(x.shape)
    torch.testing.assert_close(M.christoffel(x, u, v), ref)
    torch.testing.assert_close(M.christoffel(x, u), M.christoffel(x, u, u))
    torch.testing.assert_close(M.christoffel(x, u, v), M.christoffel(x, v, u))


@pytest.mark.parametrize("metric", METRICS)
def test_h1_reproduces_diagonal_quotient(metric):
    gen = torch.Generator().manual_seed(6)
    D = qm.DiagonalQuotient(metric=metric, retraction="exact")
    M = qm.GLQuotient(1, 1, metric=metric, retraction="exact", steps=64)
    xd = torch.randn(2, 7, generator=gen).abs() + 0.2
    ud = 0.1 * torch.randn(2, 7, generator=gen)
    vd = torch.randn(2, 7, generator=gen)

    def to_gl(t):  # (2, d) -> (d, 2, 1): one GL(1) block per coordinate
        return t.T.unsqueeze(-1)

    def from_gl(t):
        return t.squeeze(-1).T

    xg, ug, vg = to_gl(xd), to_gl(ud), to_gl(vd)
    torch.testing.assert_close(from_gl(M.proju(xg, ug)), D.proju(xd, ud))
    torch.testing.assert_close(from_gl(M.egrad2rgrad(xg, ug)), D.egrad2rgrad(xd, ud))
    torch.testing.assert_close(from_gl(M.christoffel(xg, ug, vg)), D.christoffel(xd, ud, vd))
    torch.testing.assert_close(M.inner(xg, ug, vg).sum(), D.inner(xd, ud, vd))
    torch.testing.assert_close(from_gl(M.expmap(xg, ug)), D.expmap(xd, ud), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("metric", METRICS)
def test_relaxation_handles_rank_deficient_blocks(metric):
    """PEFT initialises B = 0: eps > 0 makes the geometry defined (the ε relaxation)."""
    M = qm.GLQuotient(6, 5, metric=metric, eps=1e-3)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(11, 4, generator=gen)
    x[:6] = 0.0
    u = torch.randn(11, 4, generator=gen)
    p = M.proju(x, u)
    assert torch.isfinite(p).all()
    assert M.check_point_on_manifold(x)
    assert M.check_vector_on_tangent(x, p, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(M.proju(x, p), p)
    torch.testing.assert_close(p, reference_projection(M, x, u))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("metric", METRICS)
def test_low_precision_inputs_use_float64_small_solves(dtype, metric):
    gen = torch.Generator().manual_seed(8)
    M = qm.GLQuotient(16, 16, metric=metric, retraction="second_order")
    x = gl_point(M, 4, gen, batch=(3,))
    u = 0.1 * torch.randn(x.shape, generator=gen)
    ref = M.retr(x, M.egrad2rgrad(x, u))
    xl, ul = x.to(dtype), u.to(dtype)
    out = M.retr(xl, M.egrad2rgrad(xl, ul))
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=0.05, atol=0.05)
    assert M.inner(xl, ul).dtype == dtype


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("retraction", ["second_order", "exact"])
def test_retractions_are_differentiable(metric, retraction):
    """The sharpness engine differentiates the perturbed weights w.r.t. ξ and the base point."""
    gen = torch.Generator().manual_seed(9)
    M = qm.GLQuotient(3, 2, metric=metric, retraction=retraction, steps=4)
    x = gl_point(M, 2, gen).requires_grad_(True)
    u = (0.2 * torch.randn(x.shape, generator=gen)).requires_grad_(True)
    assert torch.autograd.gradcheck(M.retr, (x, u))
    assert torch.autograd.gradcheck(lambda x, u: M.inner(x, M.proju(x, u)), (x, u))
