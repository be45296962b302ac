"""GLQuotient(subalgebra=...) through the public class: geoopt contract, optimizers, retractions.

The kernels are tested in ``test_subgroup.py``; these tests check the wiring of the manifold
class (and its frozen tangent spaces ``M.at(x)``) to them.
"""

import math

import geoopt
import numpy as np
import pytest
import torch
from helpers import conditioned_factor, gl_point

import quotient_manifolds as qm
from quotient_manifolds.errors import ShapeError
from quotient_manifolds.geometry import gl
from quotient_manifolds.geometry import subgroup as sg
from quotient_manifolds.manifolds.checks import metric_tensor, reference_geodesic
from quotient_manifolds.manifolds.gl_quotient import GLTangentSpace, SubgroupTangentSpace

RC = sg.RotaryCommutant
SUBS = {"rope4": RC.rotate_half(4), "partial": RC.rotate_half(4, 2),
        "interleaved": RC.interleaved(4, 2)}
N_ROWS, M_ROWS, H = 6, 5, 4


def manifold(sub, metric="inv", retraction="second_order", eps=0.0, **kw):
    return qm.GLQuotient(N_ROWS, M_ROWS, metric=metric, eps=eps, retraction=retraction,
                         subalgebra=sub, **kw)


def point(M, gen, batch=()):
    return gl_point(M, H, gen, batch)


def restricted_reference(M, sub, x, u):
    """ξ − V (Vᵀ g V)⁻¹ Vᵀ g ξ with V = [vertical(x, B)] over a basis B of k (dense)."""
    g = metric_tensor(M, x)
    V = torch.stack([M.vertical(x, B).reshape(-1) for B in sub.basis()], 1)
    c = torch.linalg.solve(V.T @ g @ V, V.T @ g @ u.reshape(-1))
    return (u.reshape(-1) - V @ c).reshape(u.shape)


@pytest.fixture(params=sorted(SUBS))
def sub(request):
    return SUBS[request.param]


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("retraction", ["first_order", "second_order", "exact"])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
def test_generic_invariants(sub, metric, retraction, scaled):
    gen = torch.Generator().manual_seed(0)
    base = manifold(sub, metric, retraction)
    M = geoopt.Scaled(base, 2.0) if scaled else base
    x = point(base, gen)
    ev = torch.randn(x.shape, generator=gen)
    assert torch.equal(M.projx(x), x)
    M.assert_check_point_on_manifold(x)
    p = M.proju(x, ev)
    M.assert_check_vector_on_tangent(x, p)
    torch.testing.assert_close(p, restricted_reference(base, sub, x, ev))
    # the kernel is what the class calls
    G, Hf = base.split(x)
    kG, kH = sg.project(G, Hf, *base.split(ev), gl.grams(G, Hf), metric, sub)
    torch.testing.assert_close(p, torch.cat([kG, kH], -2))
    # batched == per element
    X = torch.stack([point(base, gen) for _ in range(3)])
    U = M.proju(X, 0.1 * torch.randn(X.shape, generator=gen))
    V = torch.randn(X.shape, generator=gen)
    per = lambda f, *ts: torch.stack([f(*(t[i] for t in ts)) for i in range(3)])  # noqa: E731
    torch.testing.assert_close(M.proju(X, V), per(M.proju, X, V))
    Y = M.retr(X, U)
    torch.testing.assert_close(Y, per(M.retr, X, U))
    T = M.transp_follow_retr(X, U, V)
    M.assert_check_vector_on_tangent(Y, T, atol=1e-8, rtol=1e-8)
    Y2, T2 = M.retr_transp(X, U, V)
    torch.testing.assert_close(Y2, Y)
    torch.testing.assert_close(T2, T)
    if scaled:
        v = 0.1 * base.proju(x, ev)
        torch.testing.assert_close(M.retr(x, v), base.retr(x, v / 2.0))


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_restricted_horizontal_space_is_larger_than_gl(sub, metric):
    gen = torch.Generator().manual_seed(1)
    M, F = manifold(sub, metric), qm.GLQuotient(N_ROWS, M_ROWS, metric=metric)
    x = point(M, gen)
    u = torch.randn(x.shape, generator=gen)
    p = M.proju(x, u)
    assert M.check_vector_on_tangent(x, p, atol=1e-8, rtol=1e-8)
    assert not F.check_vector_on_tangent(x, p, atol=1e-8, rtol=1e-8)
    assert M.check_vector_on_tangent(x, F.proju(x, u), atol=1e-8, rtol=1e-8)
    # k-vertical vectors are removed, vertical vectors outside k are not
    Xk = sub.random_algebra_element(gen)
    torch.testing.assert_close(M.proju(x, M.vertical(x, Xk)), torch.zeros_like(x))
    Y = torch.randn(H, H, generator=gen)
    assert M.proju(x, M.vertical(x, Y - sub.project(Y))).abs().max() > 1e-3


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_gradient_identity_and_equivariance(sub, metric):
    gen = torch.Generator().manual_seed(2)
    M = manifold(sub, metric)
    x = point(M, gen, (2,))
    g = torch.randn(x.shape, generator=gen)
    r = M.egrad2rgrad(x, g)
    assert M.check_vector_on_tangent(x, r, atol=1e-8, rtol=1e-8)
    eta = M.proju(x, torch.randn(x.shape, generator=gen))
    torch.testing.assert_close(M.inner(x, r, eta), (g * eta).sum((-2, -1)))
    A = sub.random_element(gen, batch=(2,))
    xa, ua = M.act(x, A), M.act(g, A)
    torch.testing.assert_close(M.proju(xa, ua), M.act(M.proju(x, g), A))
    torch.testing.assert_close(M.invariant(xa), M.invariant(x))


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_frozen_tangent_space_uses_the_subgroup(sub, metric):
    gen = torch.Generator().manual_seed(3)
    M = manifold(sub, metric)
    x = point(M, gen)
    T = M.at(x)
    u = torch.randn(x.shape, generator=gen)
    torch.testing.assert_close(T.proju(u), M.proju(x, u))
    torch.testing.assert_close(T.egrad2rgrad(u), M.egrad2rgrad(x, u))
    s = T.sample(gen)
    assert M.check_vector_on_tangent(x, s, atol=1e-8, rtol=1e-8)
    w = torch.rand(x.shape, generator=gen) + 0.5
    pw = T.proju_weighted(u, w)
    assert M.check_vector_on_tangent(x, pw, atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(T.proju_weighted(pw, w), pw)


@pytest.mark.parametrize(
    "cls,kw", [(geoopt.optim.RiemannianSGD, {"momentum": 0.9}),
               (geoopt.optim.RiemannianAdam, {})], ids=["sgd-momentum", "adam"])
@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_optimizer_steps_stay_horizontal(cls, kw, metric):
    """geoopt keeps its buffers in the k-horizontal space and the loss goes down."""
    sub = RC.rotate_half(4, 2)
    gen = torch.Generator().manual_seed(4)
    M = manifold(sub, metric, "first_order")
    x0 = point(M, gen)
    x = geoopt.ManifoldParameter(x0.clone(), manifold=M)
    R = sub.rotation(torch.tensor([0.7]))
    target = conditioned_factor(N_ROWS, H, gen) @ R @ conditioned_factor(M_ROWS, H, gen).T

    def loss_fn():  # a RoPE-like logit of the block: K-invariant, not GL-invariant
        G, Hf = M.split(x)
        return 0.5 * ((G @ R @ Hf.T - target) ** 2).sum()

    opt = cls([x], lr=1e-2 if metric == "inv" else 1e-3, **kw)
    start = loss_fn().item()
    for _ in range(20):
        opt.zero_grad()
        loss_fn().backward()
        prev = x.detach().clone()
        g = x.grad.detach().clone()
        opt.step()
        buf = opt.state[x].get("momentum_buffer")
        if buf is not None:
            assert M.check_vector_on_tangent(x.detach(), buf, atol=1e-8, rtol=1e-8)
        if cls is geoopt.optim.RiemannianAdam:
            assert M.check_vector_on_tangent(x.detach(), opt.state[x]["exp_avg"], atol=1e-8,
                                             rtol=1e-8)
        # the raw Riemannian gradient of this K-invariant loss is already k-horizontal
        assert M.check_vector_on_tangent(prev, M.egrad2rgrad(prev, g), atol=1e-8, rtol=1e-8)
    assert loss_fn().item() < start


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_retraction_order_unchanged(metric):
    """Γ is the GL one: second order ≈ geodesic to O(t³), first order to O(t²)."""
    sub = RC.rotate_half(2)
    gen = torch.Generator().manual_seed(11)
    make = lambda r: qm.GLQuotient(3, 2, metric=metric, retraction=r, steps=8,  # noqa: E731
                                   subalgebra=sub)
    exact = make("exact")
    x = gl_point(exact, 2, gen)
    u = exact.proju(x, torch.randn(x.shape, generator=gen))
    u = u / exact.norm(x, u)
    steps = [0.4, 0.2, 0.1, 0.05]
    errs = {"first_order": [], "second_order": []}
    for s in steps:
        ref = reference_geodesic(exact, x, s * u, tol=1e-13)
        for name in errs:
            errs[name].append((make(name).retr(x, s * u) - ref).abs().max().item())
        assert (exact.retr(x, s * u) - ref).abs().max().item() < 1e-7
    slope = lambda e: np.polyfit(np.log(steps), np.log(e), 1)[0]  # noqa: E731
    assert 1.8 < slope(errs["first_order"]) < 2.3, errs
    assert 2.7 < slope(errs["second_order"]) < 3.4, errs
    assert all(math.isfinite(e) for e in errs["second_order"])


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_the_subgroup_is_a_subclass_of_the_gl_tangent_space(sub, metric):
    """`at` picks the class from `subalgebra`; the GL class never consults a subalgebra."""
    gen = torch.Generator().manual_seed(8)
    M = manifold(sub, metric)
    full = qm.GLQuotient(N_ROWS, M_ROWS, metric=metric)
    x = point(M, gen)
    u = torch.randn(x.shape, generator=gen)
    w = torch.rand(x.shape, generator=gen) + 0.5
    T, T_gl = M.at(x), full.at(x)
    assert type(T) is SubgroupTangentSpace and T.subalgebra is sub
    assert type(T_gl) is GLTangentSpace
    # a GLTangentSpace built on the subgroup manifold is the full GL(h) quotient's
    T_forced = GLTangentSpace(M, x)
    for name in ("proju", "egrad2rgrad", "horizontal_residual", "horizontal_residual_scale"):
        torch.testing.assert_close(getattr(T_forced, name)(u), getattr(T_gl, name)(u),
                                   rtol=0, atol=0)
    torch.testing.assert_close(T_forced.proju_weighted(u, w), T_gl.proju_weighted(u, w),
                               rtol=0, atol=0)
    # ... and the subclass answers with the subgroup's kernels
    torch.testing.assert_close(T.horizontal_residual(u), sg.horizontal_residual(
        T.G, T.H, *T.split(u), T.grams, metric, sub), rtol=0, atol=0)
    torch.testing.assert_close(T.horizontal_residual_scale(u), sg.horizontal_residual_scale(
        T.G, T.H, *T.split(u), T.grams, metric, sub), rtol=0, atol=0)
    assert float(T.horizontal_residual(T.proju(u)).abs().max()) < 1e-5
    assert not torch.allclose(T.proju(u), T_gl.proju(u))
    # what the metric, Γ and the retractions see is shared
    v = T.proju(u)
    torch.testing.assert_close(T.inner(v), T_gl.inner(v), rtol=0, atol=0)
    torch.testing.assert_close(T.christoffel(v), T_gl.christoffel(v), rtol=0, atol=0)


def test_subgroup_tangent_space_checks_its_subalgebra():
    gen = torch.Generator().manual_seed(9)
    full = qm.GLQuotient(N_ROWS, M_ROWS)
    x = point(full, gen)
    with pytest.raises(ValueError, match="subalgebra"):
        SubgroupTangentSpace(full, x)
    with pytest.raises(ShapeError, match="h = 6"):
        SubgroupTangentSpace(manifold(RC.rotate_half(6)), x)


def test_mismatched_head_dimension_is_a_named_error():
    M = qm.GLQuotient(6, 5, subalgebra=RC.rotate_half(4))
    x = gl_point(M, 3, torch.Generator().manual_seed(5))
    with pytest.raises(ShapeError):
        M.proju(x, torch.ones_like(x))
    assert "subalgebra" in repr(M) or "RotaryCommutant" in repr(M)


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_tangent_check_can_fail_at_every_factor_scale(metric, scale):
    """The horizontality check of the class uses the subgroup residual and its own scale."""
    sub = RC.rotate_half(4, 2)
    gen = torch.Generator().manual_seed(6)
    M = manifold(sub, metric)
    x = gl_point(M, H, gen, scale_g=scale)
    p = M.proju(x, torch.randn(x.shape, generator=gen))
    assert M.check_vector_on_tangent(x, p, atol=0.0, rtol=1e-8)
    w = M.vertical(x, sub.random_algebra_element(gen))  # k-vertical: maximally non-horizontal
    w = w * (M.norm(x, p) / M.norm(x, w))
    assert not M.check_vector_on_tangent(x, w, atol=0.0, rtol=1e-5)
    assert not M.check_vector_on_tangent(x, p + 1e-3 * w, atol=0.0, rtol=1e-5)
