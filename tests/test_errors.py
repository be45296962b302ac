"""Bad input raises a named exception that says what to do."""

import pytest
import torch
from helpers import diag_point, gl_point

import quotient_manifolds as qm


def test_wrong_shapes():
    M = qm.GLQuotient(4, 3)
    x = gl_point(M, 2, torch.Generator().manual_seed(0))
    with pytest.raises(qm.ShapeError, match=r"\(\.\.\., n \+ m, h\)"):
        M.proju(torch.randn(6, 2), torch.randn(6, 2))
    with pytest.raises(qm.ShapeError):
        M.inner(x, torch.randn(7, 3))
    with pytest.raises(qm.ShapeError, match="eps > 0"):
        M.proju(torch.randn(7, 4), torch.randn(7, 4))  # h = 4 > min(n, m)
    with pytest.raises(qm.ShapeError, match=r"\(\.\.\., 2, d\)"):
        qm.DiagonalQuotient().proju(torch.randn(3, 5), torch.randn(3, 5))
    assert issubclass(qm.ShapeError, ValueError)


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_rank_deficient_block_suggests_eps(metric):
    M = qm.GLQuotient(5, 4, metric=metric)
    x = gl_point(M, 3, torch.Generator().manual_seed(1))
    x[:5, 2] = x[:5, 0]  # G loses a rank
    u = torch.randn_like(x)
    with pytest.raises(qm.RankDeficientError, match="eps > 0"):
        M.proju(x, u)
    ok, reason = M.check_point_on_manifold(x, explain=True)
    assert not ok and "rank deficient" in reason
    x[:5] = 0.0
    with pytest.raises(qm.RankDeficientError, match="factor G"):
        M.egrad2rgrad(x, u)
    # the relaxation fixes it
    assert torch.isfinite(qm.GLQuotient(5, 4, metric=metric, eps=1e-4).proju(x, u)).all()


def test_mix_exact_geodesic_leaving_its_domain():
    M = qm.DiagonalQuotient(metric="mix", retraction="exact")
    x = diag_point(4, torch.Generator().manual_seed(2))
    b = torch.tensor([0.1, -0.2, 0.3, -0.5])  # 1 + 2b = 0 in the last coordinate
    xi = M.pack_point(b * x[0], b * x[1])
    with pytest.raises(qm.GeodesicDomainError, match="1 \\+ 2b"):
        M.retr(x, xi)
    b[-1] = -0.49  # just inside the domain: fine, and equal to u √(1 + 2b)
    xi = M.pack_point(b * x[0], b * x[1])
    torch.testing.assert_close(M.retr(x, xi), x * torch.sqrt(1 + 2 * b))
    # the second-order retraction has no domain restriction
    second = qm.DiagonalQuotient(metric="mix", retraction="second_order")
    assert torch.isfinite(second.retr(x, 2 * xi)).all()


def test_zero_weights_in_adaptive_without_eps():
    M = qm.AdaptiveEuclidean()
    w = torch.tensor([1.0, 0.0, -2.0])
    u = torch.ones(3)
    with pytest.raises(qm.ZeroWeightError, match="eps > 0"):
        M.inner(w, u)
    with pytest.raises(qm.ZeroWeightError):
        qm.AdaptiveEuclidean(retraction="exact").retr(w, u)
    # the gradient needs no division, and eps makes every operation defined
    torch.testing.assert_close(M.egrad2rgrad(w, u), w**2)
    Me = qm.AdaptiveEuclidean(eps=1e-2, retraction="exact")
    assert torch.isfinite(Me.inner(w, u)).all() and torch.isfinite(Me.retr(w, 0.1 * u)).all()
    ok, reason = M.check_point_on_manifold(w, explain=True)
    assert not ok and "zero weight" in reason


def test_zero_entry_in_diagonal_net():
    M = qm.DiagonalQuotient()
    x = torch.ones(2, 3)
    x[1, 2] = 0.0
    with pytest.raises(qm.RankDeficientError, match="zero entry"):
        M.inner(x, torch.ones(2, 3))


@pytest.mark.parametrize(
    "M,x",
    [
        (qm.GLQuotient(4, 3), gl_point(qm.GLQuotient(4, 3), 2, torch.Generator().manual_seed(3))),
        (qm.DiagonalQuotient(), torch.ones(2, 3)),
        (qm.AdaptiveEuclidean(), torch.ones(5)),
    ],
)
@pytest.mark.parametrize("where", ["point", "vector"])
def test_nan_inputs(M, x, where):
    u = torch.ones_like(x)
    if where == "point":
        x = x.clone()
        x.view(-1)[0] = float("nan")
    else:
        u.view(-1)[-1] = float("inf")
    for op in (M.inner, M.egrad2rgrad, M.christoffel):
        with pytest.raises(qm.NonFiniteError, match="NaN or Inf"):
            op(x, u)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="metric"):
        qm.GLQuotient(3, 3, metric="euclid")
    with pytest.raises(ValueError, match="retraction"):
        qm.DiagonalQuotient(retraction="third_order")
    with pytest.raises(ValueError, match="eps"):
        qm.AdaptiveEuclidean(eps=-1.0)
    with pytest.raises(ValueError, match="steps"):
        qm.GLQuotient(3, 3, retraction="exact", steps=0)


def test_weights_whose_square_underflows_count_as_zero():
    """float32 weights below ~1e-22 square to 0; the metric ξ²/w² would be 0/0 there."""
    M = qm.AdaptiveEuclidean()
    w = torch.tensor([1.0, 1e-30, -2.0], dtype=torch.float32)
    with pytest.raises(qm.ZeroWeightError, match="underflows"):
        M.inner(w, torch.ones(3, dtype=torch.float32))
