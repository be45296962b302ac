"""Diagonal-network sharpness against the closed forms and the quick experiment.

No τ value is asserted anywhere: τ is the experiment's output, not a property of the code.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from quotient_manifolds.errors import GeodesicDomainError, InvalidRadiusError
from quotient_manifolds.manifolds import DiagonalQuotient
from quotient_manifolds.manifolds.product import ProductTangentSpace
from quotient_manifolds.sharpness import APGD, AdaptiveNormBall, Average, MetricBall, apgd
from quotient_manifolds.sharpness.diagonal import (
    DIAGONAL_BALLS,
    DiagonalGeometry,
    _coefficient_weights,
    _geodesic_set,
    diagonal_loss,
    diagonal_sharpness,
    mix_trust_region,
    perturb_horizontal,
)

torch.set_num_threads(1)
F64 = torch.float64


def _orthogonal_problem(d=4, B=3, seed=0, spread=0.1):
    """X orthogonal (XᵀX = I, n = d), y = Xβ*, and B trained points near β*."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=F64))
    bstar = torch.rand(d, generator=g, dtype=F64) + 0.5
    u = torch.rand(B, d, generator=g, dtype=F64) + 0.5
    beta0 = bstar + spread * torch.randn(B, d, generator=g, dtype=F64)
    return Q, Q @ bstar, bstar, u, beta0 / u


def test_loss_reductions():
    X, y, bstar, u, v = _orthogonal_problem()
    beta = u * v
    s = diagonal_loss(beta, X, y, "sum")
    torch.testing.assert_close(s, ((beta - bstar) ** 2).sum(-1))  # XᵀX = I
    torch.testing.assert_close(diagonal_loss(beta, X, y), s / (2 * X.shape[0]))
    with pytest.raises(ValueError):
        diagonal_loss(beta, X, y, "mean")


def test_exact_geodesics_match_closed_forms():
    """§6.4.1 / §10.1: inv β e^{2b} (Eq. 25), mix β(1 + 2b) (exactly quadratic loss change)."""
    X, y, bstar, u, v = _orthogonal_problem()
    beta0 = u * v
    b = 0.2 * torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    L0 = diagonal_loss(beta0, X, y, "sum")
    inv = diagonal_loss(perturb_horizontal(u, v, b, "inv", "exact"), X, y, "sum") - L0
    eq25 = (beta0**2 * (torch.exp(4 * b) - 1)).sum(-1) - 2 * (
        beta0 * (torch.exp(2 * b) - 1) * bstar).sum(-1)
    torch.testing.assert_close(inv, eq25)
    mix = diagonal_loss(perturb_horizontal(u, v, b, "mix", "exact"), X, y, "sum") - L0
    quad = 4 * (b * beta0 * (beta0 - bstar)).sum(-1) + 4 * ((beta0 * b) ** 2).sum(-1)
    torch.testing.assert_close(mix, quad)
    # first/second order: β(1+b)², inv β(1+b+b²/2)², mix β(1+b−b²/2)²
    torch.testing.assert_close(perturb_horizontal(u, v, b, "inv", "first_order"),
                               beta0 * (1 + b) ** 2)
    torch.testing.assert_close(perturb_horizontal(u, v, b, "inv", "second_order"),
                               beta0 * (1 + b + b**2 / 2) ** 2)
    torch.testing.assert_close(perturb_horizontal(u, v, b, "mix", "second_order"),
                               beta0 * (1 + b - b**2 / 2) ** 2)


def test_mix_geodesic_domain_error():
    u = torch.ones(1, 3, dtype=F64)
    b = torch.tensor([[0.1, -0.6, 0.0]], dtype=F64)
    with pytest.raises(GeodesicDomainError):
        perturb_horizontal(u, u, b, "mix", "exact")


@pytest.mark.parametrize("rho", [0.01, 0.1])
def test_mix_metric_ball_closed_form(rho):
    """Metric ball 2‖β⊙b‖² ≤ ρ²: S = 2√2 ρ‖β₀ − β*‖ + 2ρ² (XᵀX = I, sum loss, domain inactive)."""
    X, y, bstar, u, v = _orthogonal_problem()
    S = diagonal_sharpness(u, v, X, y, rho=rho, geometry=DiagonalGeometry(metric="mix"),
                           reduction="sum")
    expected = 2 * math.sqrt(2) * rho * (u * v - bstar).norm(dim=-1) + 2 * rho**2
    torch.testing.assert_close(S, expected, rtol=1e-6, atol=1e-12)


def test_mix_coefficient_ball_trust_region():
    """Coefficient ball ‖b‖ ≤ ρ (App. E's inv convention): max of 4bᵀD r' + 4bᵀD²b, a
    trust-region problem (secular equation)."""
    from scipy.optimize import brentq

    X, y, bstar, u, v = _orthogonal_problem(B=2)
    rho = 0.05
    S = diagonal_sharpness(u, v, X, y, rho=rho,
                           geometry=DiagonalGeometry(metric="mix", ball="coefficient"),
                           reduction="sum", solver=APGD(n_iter=200, restarts=3, seed=0))
    for k in range(2):
        beta0 = (u * v)[k]
        g, h = 4 * beta0 * (beta0 - bstar), 8 * beta0**2  # f(b) = gᵀb + ½ bᵀ diag(h) b
        # boundary maximiser b(λ) = g / (λ − h), λ > max h, with ‖b(λ)‖ = ρ
        lam = brentq(lambda t, g=g, h=h: float((g / (t - h)).norm()) - rho,
                     float(h.max()) + 1e-12, float(h.max()) + 1e6)
        b = g / (lam - h)
        best = float(g @ b + 0.5 * (h * b * b).sum())
        assert S[k].item() == pytest.approx(best, rel=1e-6)


def test_inv_zero_residual_closed_form():
    """β₀ = β*: S = max_i β_i² (e^{2ρ/√2} − 1)² (Eq. 8 case (b) before its expansion)."""
    X, y, bstar, u, _ = _orthogonal_problem()
    v = bstar / u
    rho = 0.05
    S = diagonal_sharpness(u, v, X, y, rho=rho, geometry=DiagonalGeometry(metric="inv"),
                           reduction="sum")
    expected = bstar.max() ** 2 * (math.exp(2 * rho / math.sqrt(2)) - 1) ** 2
    torch.testing.assert_close(S, expected.expand(3), rtol=1e-6, atol=1e-14)


def test_inv_first_order_regime():
    """r ≠ 0, small ρ: S = 4(ρ/√2)‖β₀ ⊙ (β₀ − β*)‖ + O(ρ²) (Eq. 8 case (a))."""
    X, y, bstar, u, v = _orthogonal_problem(spread=0.3)
    beta0 = u * v
    lead = 4 * (1 / math.sqrt(2)) * (beta0 * (beta0 - bstar)).norm(dim=-1)
    errs = []
    for rho in (1e-3, 1e-4):
        S = diagonal_sharpness(u, v, X, y, rho=rho, geometry=DiagonalGeometry(metric="inv"),
                               reduction="sum")
        errs.append(((S / rho - lead) / lead).abs().max().item())
    assert errs[1] < 2e-4 and errs[1] < errs[0] / 5  # the relative error is O(ρ)


def test_ball_norms_match_the_table():
    """The three balls on horizontal ξ = (bu, bv): ‖A ⊙ b‖ with the module docstring's A."""
    u = torch.tensor([[2.0, -1.0]], dtype=F64)
    v = torch.tensor([[0.5, 3.0]], dtype=F64)
    b = torch.tensor([[0.3, -0.2]], dtype=F64)
    r2 = math.sqrt(2)
    for metric, A in (("inv", torch.full_like(u, r2)), ("mix", r2 * (u * v).abs())):
        M = DiagonalQuotient(metric)
        ts = M.at(M.pack_point(u, v))
        xi = ProductTangentSpace([ts], (1,)).join([M.pack_point(b * u, b * v)])
        metric_ball = MetricBall(ProductTangentSpace([ts], (1,)), 1.0)
        torch.testing.assert_close(metric_ball.norm(xi), (A * b).norm(dim=-1))
        space = ProductTangentSpace([ts], (1,))
        adaptive = AdaptiveNormBall(space, 1.0, space.join([ts.x0**2]))
        torch.testing.assert_close(adaptive.norm(xi), r2 * b.norm(dim=-1))
        # the per-coordinate weights the unconstrained mix solve reads off each ball
        for ball in DIAGONAL_BALLS:
            _, ts_b, fs, _ = _geodesic_set(u, v, 1.0, DiagonalGeometry(metric, "exact", ball,
                                                                       domain_margin=1e-6))
            torch.testing.assert_close(fs.norm(xi) ** 2,
                                       (_coefficient_weights(fs, ts_b) * b * b).sum(-1))


def test_batched_apgd_respects_domain_and_ball():
    """Rows of one batched APGD: max −b₀ hits the mix domain b ≥ −½ + δ, max 0.6 b₀ + 0.8 b₁
    the metric ball 2‖b‖² ≤ 1; each row keeps its own step size and best point."""
    M = DiagonalQuotient("mix", "exact")
    one = torch.ones(2, 2, dtype=F64)
    ts = M.at(M.pack_point(one, one))
    space = ProductTangentSpace([ts], (2,), kinds=["exact"])
    ball = MetricBall(space, 1.0)
    w = torch.tensor([[-1.0, 0.0], [0.6, 0.8]], dtype=F64)

    def objective(xi):
        x = xi.detach().requires_grad_(True)
        val = (ts.horizontal_coefficient(space.split(x)[0]) * w).sum(-1)
        (g,) = torch.autograd.grad(val.sum(), x)
        return val.detach(), g

    res = apgd(objective, ball, torch.zeros(2, dtype=F64), n_iter=50)
    assert res.best_loss[0].item() == pytest.approx(0.5 - 1e-6, abs=1e-9)
    assert res.best_loss[1].item() == pytest.approx(1 / math.sqrt(2), abs=1e-6)
    b = ts.horizontal_coefficient(space.split(res.best_xi)[0])
    assert bool((b >= -0.5).all())
    assert bool((ball.norm(res.best_xi) <= 1 + 1e-12).all())


def test_mix_respects_domain_and_masks_zeros():
    """Tiny β coordinates never cross zero; exact zeros are masked, not an error."""
    X, y, _, u, v = _orthogonal_problem()
    v = v.clone()
    v[:, 0] = 1e-9
    v[0, 1] = 0.0
    for ball in ("metric", "coefficient"):
        S = diagonal_sharpness(u, v, X, y, rho=0.3, geometry=DiagonalGeometry(metric="mix",
                                                                             ball=ball))
        assert bool(torch.isfinite(S).all())
    S = diagonal_sharpness(u, v, X, y, rho=0.3, geometry=DiagonalGeometry(metric="mix"),
                           solver=Average(n=20, seed=0))
    assert bool(torch.isfinite(S).all())
    # a masked coordinate (β₁ = 0 held fixed) is the same as deleting it from the network
    keep = [0, 2, 3]
    for kw in ({"geometry": DiagonalGeometry(metric="inv")},
               {"geometry": DiagonalGeometry(metric="mix", ball="coefficient")},
               {"measure": "adaptive"}):
        full = diagonal_sharpness(u[:1], v[:1], X, y, rho=0.1, **kw)
        red = diagonal_sharpness(u[:1, keep], v[:1, keep], X[:, keep], y, rho=0.1, **kw)
        assert full.item() > 0
        assert full.item() == pytest.approx(red.item(), rel=1e-5)
    with pytest.raises(InvalidRadiusError):
        diagonal_sharpness(u, v, X, y, rho=0.0)


def test_adaptive_is_rescaling_invariant():
    """Adaptive and geodesic sharpness do not move along an orbit (α u, v / α)."""
    X, y, _, u, v = _orthogonal_problem()
    a = torch.exp(torch.randn(3, 4, generator=torch.Generator().manual_seed(3), dtype=F64))
    for kw in ({"measure": "adaptive"}, {"geometry": DiagonalGeometry(metric="inv")},
               {"geometry": DiagonalGeometry(metric="mix")}):
        s1 = diagonal_sharpness(u, v, X, y, rho=0.05, **kw)
        s2 = diagonal_sharpness(a * u, v / a, X, y, rho=0.05, **kw)
        torch.testing.assert_close(s1, s2, rtol=1e-6, atol=1e-12)


def test_population_sampler_and_data():
    from quotient_manifolds.experiments.diagonal import make_data, sample_population

    X, y, Xt, yt, theta = make_data()
    assert X.shape == (80, 200) and Xt.shape == (1000, 200)
    assert int((theta != 0).sum()) == 20 and bool((theta >= 0).all())
    assert theta.norm().item() == pytest.approx(1.0)
    torch.testing.assert_close(y, X @ theta)
    full = sample_population(50)
    assert sample_population(8) == full[:8]  # member i does not depend on the population size
    for c in full:
        assert 0.01 <= c["alpha"] <= 1
        lo, hi = (0.01, 0.3) if c["optimizer"] == "sgd" else (0.03, 2.0)
        assert lo <= c["lr"] <= hi


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    from quotient_manifolds.experiments import diagonal

    out = tmp_path_factory.mktemp("diag")
    return out, diagonal.run(out, quick=True, progress=False)


def test_quick_results_structure(quick_results):
    out, res = quick_results
    on_disk = json.loads((out / "diagonal" / "results.json").read_text())
    assert on_disk["experiment"] == "diagonal"
    assert on_disk["n_members"] == len(on_disk["members"]) >= 3
    assert on_disk["n_members"] + on_disk["n_dropped"] == 8
    for name in ("adaptive", "geodesic_inv", "geodesic_mix", "geodesic_mix_coefficient",
                 "geodesic_mix_unconstrained",
                 "ablation_inv_first_order", "ablation_mix_adaptive_norm", "geodesic_inv_avg"):
        m = on_disk["measures"][name]
        assert math.isfinite(m["tau"]) and math.isfinite(m["p_value"])
        assert len(m["ci95"]) == 2 and m["rho"] == 0.1
    for h in ("alpha", "lr", "optimizer"):
        assert h in on_disk["baselines"]
    for mem in on_disk["members"]:
        assert mem["train_loss"] < 1e-5 and math.isfinite(mem["gap"])
        for vals in mem["measures"].values():
            assert all(math.isfinite(x) for x in vals.values())
    for png in ("scatter.png", "tau_vs_rho.png", "landscape.png"):
        assert (out / "diagonal" / png).stat().st_size > 1000
    assert on_disk["guard"]["masked_coordinates"] >= 0


@pytest.mark.parametrize("kw", [
    {"geometry": DiagonalGeometry(metric="inv"), "kind": "worst"},
    {"geometry": DiagonalGeometry(metric="mix"), "kind": "average"},
    {"geometry": DiagonalGeometry(metric="mix", ball="coefficient"), "kind": "average"},
    {"measure": "adaptive", "kind": "worst"}])
def test_per_row_seeds_make_rows_independent(kw):
    """With one seed per row, a row's value does not depend on the other rows (resumable)."""
    X, y, _, u, v = _orthogonal_problem(B=3, spread=0.3)
    v = v.clone()
    v[:, 0] = 1e-6  # near-zero β: the mix average case redraws coordinates
    kw = dict(kw)
    solver = APGD(n_iter=15, restarts=3) if kw.pop("kind") == "worst" else Average(n=10)
    opts = {"rho": 0.3, "solver": solver, **kw}
    full = diagonal_sharpness(u, v, X, y, seed=[11, 12, 13], **opts)
    alone = diagonal_sharpness(u[1:2], v[1:2], X, y, seed=[12], **opts)
    torch.testing.assert_close(full[1:2], alone, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("ball", ["metric", "coefficient"])
def test_unconstrained_mix_trust_region_is_the_global_maximum(ball):
    """domain=False: the exact solve beats (or ties) every feasible point APGD and sampling find,
    sits on the sphere, and is never below the domain-constrained maximum."""
    X, y, _, u, v = _orthogonal_problem(d=5, B=3, spread=0.3)
    g = torch.Generator().manual_seed(7)
    X = X + 0.3 * torch.randn(5, 5, generator=g, dtype=F64)  # non-orthogonal XᵀX
    rho = 0.2
    val, b = mix_trust_region(u, v, X, y, rho=rho, ball=ball)
    beta = u * v
    # the ball's norm, written out: √2‖β ⊙ b‖ (metric) or ‖b‖ (coefficient)
    ball_norm = (math.sqrt(2) * beta * b if ball == "metric" else b).norm(dim=-1)
    torch.testing.assert_close(ball_norm, torch.full((3,), rho, dtype=F64))
    base = diagonal_loss(beta, X, y)

    def f_b(b):
        return diagonal_loss(beta * (1 + 2 * b), X, y) - base

    torch.testing.assert_close(f_b(b), val)
    z = torch.randn(4000, 3, 5, generator=g, dtype=F64)
    z = rho * z / z.norm(dim=-1, keepdim=True)
    A = math.sqrt(2) * beta.abs() if ball == "metric" else torch.ones_like(beta)
    sampled = torch.stack([f_b(zk / A) for zk in z]).amax(0)
    assert bool((val >= sampled - 1e-12).all())
    # APGD on the same ball without the domain (the second-order manifold clips nothing;
    # the perturbed predictor is β(1 + 2b) whatever the retraction)
    M = DiagonalQuotient("mix", "second_order")
    ts = M.at(M.pack_point(u, v))
    space = ProductTangentSpace([ts], (3,), kinds=["second_order"])
    feasible = (MetricBall(space, rho) if ball == "metric"
                else AdaptiveNormBall(space, math.sqrt(2) * rho, space.join([ts.x0**2])))

    def objective(xi):
        x = xi.detach().requires_grad_(True)
        val = f_b(ts.horizontal_coefficient(space.split(x)[0]))
        (grad,) = torch.autograd.grad(val.sum(), x)
        return val.detach(), grad

    found = apgd(objective, feasible, torch.zeros(3, dtype=F64), n_iter=300).best_loss
    assert bool((val >= found - 1e-12).all())
    assert val.tolist() == pytest.approx(found.tolist(), rel=1e-6)  # APGD finds it here
    constrained = diagonal_sharpness(u, v, X, y, rho=rho,
                                     geometry=DiagonalGeometry(metric="mix", ball=ball))
    assert bool((val >= constrained - 1e-12).all())
    via_api = diagonal_sharpness(u, v, X, y, rho=rho,
                                 geometry=DiagonalGeometry(metric="mix", ball=ball, domain=False))
    torch.testing.assert_close(via_api, val)


def test_unconstrained_mix_hard_case():
    """g orthogonal to the top eigenvector of M: the maximiser fills the sphere along it."""
    X = torch.diag(torch.tensor([2.0, 1.0, 0.5], dtype=F64))
    bstar = torch.tensor([1.0, 1.0, 1.0], dtype=F64)
    u = torch.ones(1, 3, dtype=F64)
    v = torch.tensor([[1.0, 1.0, 1.1]], dtype=F64)  # residual only on the smallest direction
    y = X @ bstar
    rho = 0.5
    val, b = mix_trust_region(u, v, X, y, rho=rho, ball="coefficient", reduction="sum")
    # M = 8 diag(β² x²) = diag(32, 8, 2.42); g = 4 β x² r / ... only in coordinate 2
    beta = u * v
    M = 8 * beta**2 * torch.diag(X) ** 2
    gvec = 4 * beta * torch.diag(X) ** 2 * (beta - bstar)
    z2 = gvec[0, 2] / (M[0, 0] - M[0, 2])
    expected = gvec[0, 2] * z2 + 0.5 * M[0, 2] * z2**2 + 0.5 * M[0, 0] * (rho**2 - z2**2)
    assert val.item() == pytest.approx(expected.item(), rel=1e-10)
    assert b.norm().item() == pytest.approx(rho, rel=1e-10)


def test_unconstrained_mix_rejects_other_measures():
    X, y, _, u, v = _orthogonal_problem()
    with pytest.raises(ValueError, match="domain=False"):
        diagonal_sharpness(u, v, X, y, rho=0.1,
                           geometry=DiagonalGeometry(metric="inv", domain=False))
    avg = diagonal_sharpness(u, v, X, y, rho=0.1,
                             geometry=DiagonalGeometry(metric="mix", domain=False),
                             solver=Average(n=50, seed=0))
    assert bool(torch.isfinite(avg).all())
