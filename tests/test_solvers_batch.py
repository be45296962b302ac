"""The shared solver machinery on batches of problems: APGD restarts, the truncated Gaussian of
a feasible set with a domain, per-problem generators, the shared radius check."""

from __future__ import annotations

import math

import pytest
import torch
from model_zoo import MHANet, ce_loss, mha_data

import quotient_manifolds as qm
from quotient_manifolds.errors import InvalidRadiusError
from quotient_manifolds.manifolds import DiagonalQuotient
from quotient_manifolds.manifolds.product import ProductTangentSpace
from quotient_manifolds.sharpness import APGD, Average, MetricBall
from quotient_manifolds.sharpness.checks import check_rho
from quotient_manifolds.sharpness.diagonal import DiagonalGeometry, diagonal_sharpness

torch.set_num_threads(1)
F64 = torch.float64


class _Quadratic:
    """`loss(ξ) = ‖ξ‖²` per problem: ξ = 0 is a stationary point, the maximum is on the sphere."""

    def loss(self, xi):
        return (xi * xi).sum(-1)

    def loss_and_grad(self, xi):
        return self.loss(xi), 2 * xi


def _mix_ball(B=3, d=4, rho=0.5, seed=0, kind="exact"):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(B, d, generator=g, dtype=F64) + 0.5
    v = torch.rand(B, d, generator=g, dtype=F64) + 0.5
    v[:, 0] = 1e-3  # tiny β_0: b_0 = z/(√2|β_0|) leaves the mix domain most of the time
    M = DiagonalQuotient("mix", "exact")
    ts = M.at(M.pack_point(u, v))
    return ts, MetricBall(ProductTangentSpace([ts], (B,), kinds=[kind]), rho)


def test_apgd_restarts_leave_a_stationary_start():
    ts, ball = _mix_ball(kind="second_order")  # no domain: the ball is a plain metric ball
    zero = torch.zeros(3, dtype=F64)
    stuck, _, n0 = APGD(n_iter=10).solve(_Quadratic(), ball, zero)
    assert stuck.tolist() == [0.0, 0.0, 0.0] and n0 == 10
    best, xi, n = APGD(n_iter=10, restarts=2, seed=0).solve(
        _Quadratic(), ball, zero, torch.Generator().manual_seed(0))
    assert n == 30
    assert bool((best > 0).all())
    torch.testing.assert_close(best, (xi * xi).sum(-1))  # the maximiser is the best point
    assert bool((ball.norm(xi) <= ball.rho * (1 + 1e-12)).all())


def test_random_start_is_at_half_the_radius():
    ts, ball = _mix_ball(kind="second_order")
    z = ball.random_start(torch.Generator().manual_seed(1))
    torch.testing.assert_close(ball.norm(z), torch.full((3,), 0.25, dtype=F64))


def test_truncated_sample_stays_in_the_mix_domain_row_by_row():
    ts, ball = _mix_ball()
    gens = [torch.Generator().manual_seed(s) for s in (4, 5, 6)]
    for _ in range(20):
        b = ts.horizontal_coefficient(ball.space.split(ball.sample(gens))[0])
        assert bool((b >= -0.5 + 1e-6).all())
    # untruncated, the same Gaussian leaves the domain
    plain = [ts.horizontal_coefficient(
        ball.space.split(2 * ball.random_start(torch.Generator().manual_seed(k)))[0])
        for k in range(20)]
    assert bool((torch.stack(plain) < -0.5).any())
    # one generator per row: a row's draws (and its generator's state) do not depend on the
    # other rows, sample after sample
    mine = [torch.Generator().manual_seed(s) for s in (4, 5, 6)]
    other = [torch.Generator().manual_seed(s) for s in (9, 5, 9)]
    for _ in range(5):
        torch.testing.assert_close(ball.sample(mine)[1], ball.sample(other)[1], rtol=0, atol=0)


def test_sample_without_a_domain_is_the_plain_gaussian():
    ts, ball = _mix_ball(kind="second_order")
    a = ball.sample(torch.Generator().manual_seed(2))
    b = ball.space.sample(torch.Generator().manual_seed(2)) * ball.rho
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_engine_apgd_restarts_are_seeded_and_counted():
    model, data = MHANet(), mha_data(n_batches=2)
    plain = qm.geodesic_sharpness(model, ce_loss, data, rho=0.1, solver=APGD(n_iter=5))
    solver = APGD(n_iter=5, restarts=2, seed=3)
    r1 = qm.geodesic_sharpness(model, ce_loss, data, rho=0.1, solver=solver)
    r2 = qm.geodesic_sharpness(model, ce_loss, data, rho=0.1, solver=solver)
    assert r1.per_batch == r2.per_batch
    assert r1.n_evals == 3 * plain.n_evals
    assert all(a >= b for a, b in zip(r1.per_batch, plain.per_batch, strict=True))
    assert r1.settings["restarts"] == 2 and r1.settings["seed"] == 3
    assert "restarts" not in plain.settings


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, "x", None])
def test_one_radius_check(bad):
    with pytest.raises(InvalidRadiusError, match="rho must be a positive finite number"):
        check_rho(bad)
    with pytest.raises(InvalidRadiusError, match="radius must be a positive finite number"):
        check_rho(bad, "radius")
    u = torch.ones(1, 2, dtype=F64)
    with pytest.raises(InvalidRadiusError, match="rho="):
        diagonal_sharpness(u, u, torch.eye(2, dtype=F64), torch.ones(2, dtype=F64), rho=bad)
    assert check_rho(0.25) == 0.25


def test_diagonal_options_are_validated():
    with pytest.raises(ValueError, match="ball must be one of"):
        DiagonalGeometry(ball="ellipsoid")
    with pytest.raises(ValueError, match="domain_margin"):
        DiagonalGeometry(metric="mix", domain_margin=0.7)
    u = torch.ones(2, 3, dtype=F64)
    X, y = torch.eye(3, dtype=F64), torch.ones(3, dtype=F64)
    with pytest.raises(TypeError, match="APGD"):
        diagonal_sharpness(u, u, X, y, rho=0.1, solver=qm.sharpness.GeooptSolver(
            lambda ps: torch.optim.SGD(ps, lr=0.1)))
    with pytest.raises(qm.ShapeError, match="seeds"):
        diagonal_sharpness(u, u, X, y, rho=0.1, seed=[1, 2, 3])
    with pytest.raises(ValueError, match="measure"):
        diagonal_sharpness(u, u, X, y, rho=0.1, measure="euclidean")
    # the solver's seed is used when no seed is given; an explicit seed wins
    a = diagonal_sharpness(u, 1.3 * u, X, y, rho=0.1, solver=Average(n=3, seed=7))
    b = diagonal_sharpness(u, 1.3 * u, X, y, rho=0.1, solver=Average(n=3), seed=7)
    c = diagonal_sharpness(u, 1.3 * u, X, y, rho=0.1, solver=Average(n=3, seed=7), seed=8)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)
