"""Property tests of DiagonalQuotient and AdaptiveEuclidean."""

import pytest
import torch
from helpers import diag_point, reference_projection
from hypothesis import given, settings
from hypothesis import strategies as st

import quotient_manifolds as qm
from quotient_manifolds.geometry import adaptive as am
from quotient_manifolds.geometry import diagonal as dm
from quotient_manifolds.manifolds.checks import christoffel_from_metric

METRICS = ["inv", "mix"]


@st.composite
def diag_case(draw):
    d = draw(st.integers(1, 12))
    batch = draw(st.sampled_from([(), (3,)]))
    metric = draw(st.sampled_from(METRICS))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = diag_point(d, gen, batch)
    u, v = torch.randn(2, *x.shape, generator=gen)
    return qm.DiagonalQuotient(metric=metric), x, u, v, gen


@settings(max_examples=60, deadline=None)
@given(diag_case())
def test_diagonal_projection_gradient_and_invariance(case):
    M, x, u, v, gen = case
    p = M.proju(x, u)
    w = M.vertical(x, torch.randn(x.shape[:-2] + x.shape[-1:], generator=gen))
    scale = (M.norm(x, p) * M.norm(x, w)).max().item()
    zero = torch.zeros(x.shape[:-2])
    torch.testing.assert_close(M.inner(x, p, w), zero, atol=1e-10 * scale, rtol=0)
    torch.testing.assert_close(M.proju(x, p), p)
    torch.testing.assert_close(M.inner(x, p, v), M.inner(x, u, M.proju(x, v)))
    assert M.check_vector_on_tangent(x, p)
    r, vh = M.egrad2rgrad(x, u), M.proju(x, v)
    torch.testing.assert_close(M.inner(x, r, vh), (u * vh).sum((-2, -1)))
    d = x.shape[-1]
    alpha = torch.exp(torch.randn(d, generator=gen)) * torch.sign(torch.randn(d, generator=gen))
    xa = M.act(x, alpha)
    pa = M.act(p, alpha)
    torch.testing.assert_close(M.inner(xa, pa), M.inner(x, p))
    torch.testing.assert_close(M.proju(xa, M.act(u, alpha)), pa)
    torch.testing.assert_close(M.invariant(xa), M.invariant(x))


@pytest.mark.parametrize("metric", METRICS)
def test_diagonal_projection_matches_dense_reference(metric):
    gen = torch.Generator().manual_seed(0)
    M = qm.DiagonalQuotient(metric=metric)
    x = diag_point(5, gen)
    u = torch.randn(x.shape, generator=gen)
    torch.testing.assert_close(M.proju(x, u), reference_projection(M, x, u))


@pytest.mark.parametrize("metric", METRICS)
def test_diagonal_horizontal_norms(metric):
    """‖ξ‖²_inv = 2‖b‖², ‖ξ‖²_mix = 2‖β ⊙ b‖² for ξ = (b u, b v)."""
    gen = torch.Generator().manual_seed(1)
    M = qm.DiagonalQuotient(metric=metric)
    x = diag_point(6, gen)
    b = torch.randn(6, generator=gen)
    xi = M.pack_point(b * x[0], b * x[1])
    expected = 2 * (b**2).sum() if metric == "inv" else 2 * ((M.invariant(x) * b) ** 2).sum()
    torch.testing.assert_close(M.inner(x, xi), expected)
    torch.testing.assert_close(M.horizontal_coefficient(x, xi), b)


@pytest.mark.parametrize("metric", METRICS)
def test_diagonal_christoffel_matches_metric_derivatives(metric):
    gen = torch.Generator().manual_seed(2)
    M = qm.DiagonalQuotient(metric=metric)
    x = diag_point(3, gen)
    u, v = torch.randn(2, *x.shape, generator=gen)
    gamma = christoffel_from_metric(M, x)
    ref = torch.einsum("lmn,m,n->l", gamma, u.reshape(-1), v.reshape(-1)).reshape(x.shape)
    torch.testing.assert_close(M.christoffel(x, u, v), ref)


def _geodesic_residual(path, christoffel, t):
    """γ̈(t) + Γ_{γ(t)}(γ̇, γ̇) for a closed-form path, with derivatives by autograd."""
    t = torch.tensor(t)
    pos = path(t)
    vel = torch.func.jacfwd(path)(t)
    acc = torch.func.jacfwd(torch.func.jacfwd(path))(t)
    return acc + christoffel(pos, vel)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("horizontal", [True, False])
def test_closed_form_diagonal_geodesics_solve_the_geodesic_equation(metric, horizontal):
    gen = torch.Generator().manual_seed(3)
    M = qm.DiagonalQuotient(metric=metric)
    x = diag_point(5, gen)
    xi = 0.3 * torch.randn(x.shape, generator=gen)
    xi = M.proju(x, xi) if horizontal else xi
    a, c = M.split(x)
    xa, xc = M.split(xi)

    def path(t):
        return M.pack_point(*dm.geodesic(a, c, xa, xc, metric, t))

    for t in (0.0, 0.4, 1.0):
        res = _geodesic_residual(path, lambda p, v: M.christoffel(p, v), t)
        torch.testing.assert_close(res, torch.zeros_like(x), atol=1e-10, rtol=0)
    torch.testing.assert_close(path(torch.tensor(0.0)), x)
    torch.testing.assert_close(torch.func.jacfwd(path)(torch.tensor(0.0)), xi)
    if horizontal:  # spec Eq. 24: u e^{bt} and u √(1 + 2bt)
        b = M.horizontal_coefficient(x, xi)
        factor = torch.exp(b) if metric == "inv" else torch.sqrt(1 + 2 * b)
        torch.testing.assert_close(M.expmap(x, xi), x * factor)


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_adaptive_geodesic_solves_the_geodesic_equation(eps):
    gen = torch.Generator().manual_seed(4)
    M = qm.AdaptiveEuclidean(eps=eps, ndim=1)
    w = torch.randn(7, generator=gen)
    xi = 0.5 * torch.randn(7, generator=gen)

    def path(t):
        return am.geodesic(w, xi, eps, t)

    for t in (0.0, 0.5, 1.0):
        res = _geodesic_residual(path, lambda p, v: M.christoffel(p, v), t)
        torch.testing.assert_close(res, torch.zeros_like(w), atol=1e-10, rtol=0)
    torch.testing.assert_close(torch.func.jacfwd(path)(torch.tensor(0.0)), xi)
    if eps == 0:
        torch.testing.assert_close(M.expmap(w, xi), w * torch.exp(xi / w))


def test_adaptive_metric_gradient_and_christoffel():
    gen = torch.Generator().manual_seed(5)
    M = qm.AdaptiveEuclidean(eps=0.0, ndim=2)
    w = torch.randn(3, 4, generator=gen)
    u, g = torch.randn(2, 3, 4, generator=gen)
    torch.testing.assert_close(M.norm(w, u), (u / w.abs()).norm())
    torch.testing.assert_close(M.inner(w, M.egrad2rgrad(w, g), u), (g * u).sum())
    gamma = christoffel_from_metric(M, w)
    ref = torch.einsum("lmn,m,n->l", gamma, u.reshape(-1), u.reshape(-1)).reshape(w.shape)
    torch.testing.assert_close(M.christoffel(w, u), ref)
    # the second-order retraction of the paper's App. F remark: w + ξ + ξ²/(2w)
    M2 = qm.AdaptiveEuclidean(retraction="second_order", ndim=2)
    torch.testing.assert_close(M2.retr(w, u), w + u + u**2 / (2 * w))
    # the scaling w -> αw (with ξ -> αξ) is an isometry
    alpha = torch.rand(3, 4, generator=gen) + 0.5
    torch.testing.assert_close(M.inner(M.act(w, alpha), M.act(u, alpha)), M.inner(w, u))
    assert torch.equal(M.proju(w, u), u)
