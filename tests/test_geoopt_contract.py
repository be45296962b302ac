"""geoopt's generic manifold invariants, plain and under Scaled."""

import geoopt
import pytest
import torch
from helpers import diag_point, gl_point, reference_projection

import quotient_manifolds as qm


def _gl(metric, retraction):
    def case(gen):
        M = qm.GLQuotient(4, 3, metric=metric, retraction=retraction)
        return M, (lambda b=(): gl_point(M, 2, gen, b))
    return case


def _diag(metric, retraction):
    def case(gen):
        M = qm.DiagonalQuotient(metric=metric, retraction=retraction)
        return M, (lambda b=(): diag_point(5, gen, b))
    return case


def _adaptive(retraction):
    def case(gen):
        M = qm.AdaptiveEuclidean(eps=0.0, retraction=retraction, ndim=2)
        return M, (lambda b=(): torch.randn(*b, 3, 4, generator=gen).abs() + 0.1)
    return case


CASES = {
    f"{name}-{r}": f
    for r in ("first_order", "second_order", "exact")
    for name, f in (
        ("gl-inv", _gl("inv", r)), ("gl-mix", _gl("mix", r)),
        ("diag-inv", _diag("inv", r)), ("diag-mix", _diag("mix", r)),
        ("adaptive", _adaptive(r)),
    )
}


@pytest.fixture(params=sorted(CASES))
def case(request):
    return request.param, CASES[request.param]


@pytest.fixture(params=[False, True], ids=["plain", "scaled"])
def scaled(request):
    return request.param


@pytest.mark.parametrize("seed", range(2))
def test_generic_invariants(case, scaled, seed):
    name, make = case
    gen = torch.Generator().manual_seed(seed)
    base, point = make(gen)
    M = geoopt.Scaled(base, 2.0) if scaled else base
    x = point()
    ev = torch.randn(x.shape, generator=gen)
    v = 0.1 * base.proju(x, ev)
    # 1-2. projection identity, validity
    assert torch.equal(M.projx(x), x)
    M.assert_check_point_on_manifold(M.projx(x))
    # 3. proju is tangent and equals an independent dense reference
    M.assert_check_vector_on_tangent(x, M.proju(x, ev))
    torch.testing.assert_close(M.proju(x, ev), reference_projection(base, x, ev))
    # 4-7. batched == per element
    X = torch.stack([point() for _ in range(4)])
    U = 0.1 * torch.randn(X.shape, generator=gen)
    V = torch.randn(X.shape, generator=gen)
    U = M.proju(X, U)
    per = lambda f, *ts: torch.stack([f(*(t[i] for t in ts)) for i in range(4)])  # noqa: E731
    torch.testing.assert_close(M.projx(X), per(M.projx, X))
    torch.testing.assert_close(M.proju(X, V), per(M.proju, X, V))
    Y = M.retr(X, U)
    torch.testing.assert_close(Y, per(M.retr, X, U))
    M.assert_check_point_on_manifold(Y)
    T = M.transp_follow_retr(X, U, V)
    torch.testing.assert_close(T, per(M.transp_follow_retr, X, U, V))
    M.assert_check_vector_on_tangent(Y, T, atol=1e-8, rtol=1e-8)
    Y2, T2 = M.retr_transp(X, U, V)
    torch.testing.assert_close(Y2, Y)
    torch.testing.assert_close(T2, T)
    # Scaled keeps tangent vectors in scaled coordinates: retr(x, u) = base.retr(x, u/s).
    if scaled:
        torch.testing.assert_close(M.retr(x, v), base.retr(x, v / 2.0))
        torch.testing.assert_close(M.expmap(x, v), base.expmap(x, v / 2.0))
    assert M.reversible is False


def test_random_and_origin_are_valid_points(case):
    name, make = case
    base, point = make(torch.Generator().manual_seed(0))
    shape = point((2,)).shape
    for M in (base, geoopt.Scaled(base, 2.0)):
        for p in (M.random(*shape), M.origin(*shape)):
            assert isinstance(p, geoopt.ManifoldTensor)
            assert p.manifold is M or p.manifold is base
            base.assert_check_point_on_manifold(p)
        o = M.origin(*shape)
        state = torch.random.get_rng_state()
        torch.testing.assert_close(M.origin(*shape), o)
        assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize(
    "M,shape",
    [(qm.GLQuotient(4, 3), (6, 2)), (qm.GLQuotient(4, 3), (7,)), (qm.DiagonalQuotient(), (3, 5)),
     (qm.AdaptiveEuclidean(ndim=2), (4,))],
)
def test_random_rejects_bad_shapes(M, shape):
    with pytest.raises(ValueError):
        M.random(*shape)
    with pytest.raises(ValueError):
        geoopt.ManifoldParameter(torch.ones(shape), manifold=M)


def test_repr_and_scaled_forwarding():
    M = qm.GLQuotient(4, 3, metric="mix", eps=1e-3, retraction="exact")
    assert "mix" in repr(M) and "exact" in repr(M)
    S = geoopt.Scaled(M, 3.0)
    assert "GLQuotient" in repr(S)
    x = gl_point(M, 2, torch.Generator().manual_seed(0))
    assert S.invariant(x).shape == (4, 3)  # forwarded unscaled
