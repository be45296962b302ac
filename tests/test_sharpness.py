"""Sharpness engine: nothing lost, invariance (paper §6.2), bad input, APGD, TangentBall."""

from __future__ import annotations

import math

import geoopt
import pytest
import torch
from model_zoo import (
    MHANet,
    bert_data,
    ce_loss,
    hf_loss,
    image_data,
    mha_data,
    minilm,
    minilm_data,
    minilm_loss,
    small_bert,
    small_timm_vit,
    vit_loss,
)
from torch import nn

import quotient_manifolds as qm
from quotient_manifolds.sharpness import checkpoints
from quotient_manifolds.sharpness.feasible import _ellipsoid_projection
from quotient_manifolds.tree import tree_map


def _snapshot(model):
    return (
        {n: p.detach().clone() for n, p in model.named_parameters()},
        {n: b.detach().clone() for n, b in model.named_buffers()},
        {n: p.requires_grad for n, p in model.named_parameters()},
        {n: m.training for n, m in model.named_modules()},
        {n: p.grad for n, p in model.named_parameters()},
    )


def _assert_same(model, snap):
    params, bufs, rg, modes, grads = snap
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
        assert p.requires_grad == rg[n] and p.grad is grads[n], n
    for n, b in model.named_buffers():
        assert torch.equal(b, bufs[n]), n
    assert {n: m.training for n, m in model.named_modules()} == modes


def test_checkpoints_match_reference():
    assert checkpoints(20) == [5, 9, 12, 15, 16, 18, 19, 20]
    assert checkpoints(100) == [22, 41, 58, 70, 80, 87, 93, 99, 105]


def test_nothing_lost_normal_exception_and_interrupt():
    model = MHANet()
    model.train()  # BatchNorm in train mode: the call must still use eval and restore
    model.head.weight.requires_grad_(False)
    snap = _snapshot(model)
    data = mha_data()
    r = qm.geodesic_sharpness(model, ce_loss, data, rho=0.1, n_iter=5)
    assert r.value > 0
    _assert_same(model, snap)
    qm.adaptive_sharpness(model, ce_loss, data, rho=0.1, n_iter=5)
    _assert_same(model, snap)
    for exc in (RuntimeError, KeyboardInterrupt):
        calls = {"n": 0}

        def bad_loss(m, b, exc=exc, calls=calls):
            calls["n"] += 1
            assert not m.training  # computation runs in eval mode
            if calls["n"] == 4:
                raise exc("stop")
            return ce_loss(m, b)

        with pytest.raises(exc):
            qm.geodesic_sharpness(model, bad_loss, data, rho=0.1, n_iter=5)
        _assert_same(model, snap)


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_invariance_mha(metric):
    model = MHANet(d=8, heads=2).eval()
    data = mha_data(n_batches=1)
    ref = qm.geodesic_sharpness(model, ce_loss, data, rho=0.2, metric=metric, n_iter=8)
    ad_ref = qm.adaptive_sharpness(model, ce_loss, data, rho=0.2, n_iter=8)
    assert ref.value > 0
    ad_changes = []
    for a in (1e-2, 1.0, 1e2):
        new = qm.reparametrize(model, a=a, generator=torch.Generator().manual_seed(7))
        torch.testing.assert_close(new(data[0][0]), model(data[0][0]), rtol=1e-8, atol=1e-10)
        r = qm.geodesic_sharpness(new, ce_loss, data, rho=0.2, metric=metric, n_iter=8)
        assert abs(r.value / ref.value - 1) < 1e-6, (a, r.value, ref.value)
        ad = qm.adaptive_sharpness(new, ce_loss, data, rho=0.2, n_iter=8)
        ad_changes.append(abs(ad.value / ad_ref.value - 1))
    assert max(ad_changes) > 1e-3  # adaptive sharpness is not invariant


@pytest.mark.parametrize("which", ["bert", "timm_vit"])
@pytest.mark.parametrize("symmetry", ["full", "complete"])
def test_invariance_transformers(which, symmetry):
    """float32 models under the full group; the complete group on the float64 models (its
    translations of 100 times the weights lose too many digits in a LayerNorm's centring in
    float32)."""
    if which == "bert":
        model, data, lf = small_bert().eval(), bert_data(n_batches=1), hf_loss
    else:
        model, data, lf = small_timm_vit().eval(), image_data(n_batches=1), vit_loss
    if symmetry == "complete":
        model = model.double()
        data = [tree_map(lambda t: t.double() if t.is_floating_point() else t, b) for b in data]
    kw = dict(rho=0.1, n_iter=6, geometry=qm.Geometry(symmetry=symmetry))
    ref = qm.geodesic_sharpness(model, lf, data, **kw)
    kw.pop("geometry")
    ad_ref = qm.adaptive_sharpness(model, lf, data, **kw)
    for a in (1e-2, 1e2):
        new = qm.reparametrize(model, a=a, symmetry=symmetry,
                               generator=torch.Generator().manual_seed(11))
        r = qm.geodesic_sharpness(new, lf, data, **kw, geometry=qm.Geometry(symmetry=symmetry))
        assert abs(r.value / ref.value - 1) < 1e-6, (a, r.value, ref.value)
        ad = qm.adaptive_sharpness(new, lf, data, **kw)
        assert abs(ad.value / ad_ref.value - 1) > 1e-3


@pytest.mark.slow
def test_invariance_minilm_real_weights():
    model = minilm().double().eval()
    data = minilm_data(n_batches=1, bs=2, seq=6)
    kw = dict(rho=0.05, n_iter=4)
    ref = qm.geodesic_sharpness(model, minilm_loss, data, **kw)
    assert len(ref.blocks) == 12 and ref.fallbacks == []
    for a in (1e-2, 1.0, 1e2):
        new = qm.reparametrize(model, a=a, generator=torch.Generator().manual_seed(0))
        r = qm.geodesic_sharpness(new, minilm_loss, data, **kw)
        assert abs(r.value / ref.value - 1) < 1e-6, (a, r.value, ref.value)


def test_bad_inputs():
    model, data = MHANet(), mha_data(n_batches=1)
    for rho in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(qm.InvalidRadiusError, match="rho"):
            qm.geodesic_sharpness(model, ce_loss, data, rho=rho)
    with pytest.raises(qm.EmptyDataError, match="non-empty"):
        qm.geodesic_sharpness(model, ce_loss, [], rho=0.1)
    with pytest.raises(qm.EmptyDataError):
        qm.adaptive_sharpness(model, ce_loss, iter(()), rho=0.1)

    def nan_on_second(m, b, calls={"n": 0}):  # noqa: B006
        x, y = b
        return ce_loss(m, b) * (float("nan") if x[0, 0, 0] == data2[1][0][0, 0, 0] else 1.0)

    data2 = mha_data(n_batches=2)
    with pytest.raises(qm.NonFiniteError, match="batch 1"):
        qm.geodesic_sharpness(model, nan_on_second, data2, rho=0.1, n_iter=2)
    deficient = MHANet()
    with torch.no_grad():
        deficient.mha.in_proj_weight[8:10].zero_()  # key rows of head 0
    with pytest.raises(qm.RankDeficientError, match=r"eps > 0.*attention\.qk at 'mha' head 0"):
        qm.geodesic_sharpness(deficient, ce_loss, data, rho=0.1)
    with pytest.raises(qm.PrecisionError, match="half='float32'"):
        qm.geodesic_sharpness(MHANet().half(), ce_loss, data, rho=0.1)
    net = nn.Sequential(nn.Flatten(), nn.Linear(20, 3))
    with pytest.warns(qm.NoBlocksWarning):
        r = qm.geodesic_sharpness(net, ce_loss, data, rho=0.1, n_iter=3)
    assert r.fallbacks[-1]["kind"] == "all"


def test_half_precision_with_float32_geometry():
    model = MHANet().to(torch.bfloat16)
    data = [(x.to(torch.bfloat16), y) for x, y in mha_data(n_batches=1)]
    r = qm.geodesic_sharpness(model, ce_loss, data, rho=0.1, n_iter=3,
                              geometry=qm.Geometry(half="float32"))
    assert math.isfinite(r.value)


def test_result_settings_and_variants():
    model, data = MHANet(), mha_data(n_batches=2)
    r = qm.geodesic_sharpness(model, ce_loss, data, rho=0.1, n_iter=6, metric="mix")
    d = r.to_dict()
    assert d["settings"]["metric"] == "mix" and d["settings"]["n_iter"] == 6
    assert len(d["per_batch"]) == 2 and d["value"] == pytest.approx(sum(r.per_batch) / 2)
    assert all(n <= 0.1 * (1 + 1e-9) for n in r.perturbation_norm)
    assert r.perturbation_norm[0] > 0.05  # the maximiser sits near the boundary
    assert [b["kind"] for b in d["blocks"]] == ["attention.qk", "attention.vo"]
    for ret in ("exact", "first_order"):
        assert qm.geodesic_sharpness(model, ce_loss, data, rho=0.1, n_iter=3,
                                     geometry=qm.Geometry(retraction=ret)).value > 0
    avg = qm.geodesic_sharpness(model, ce_loss, data, rho=0.1, n_iter=4,
                                solver=qm.Average(seed=0))
    assert abs(avg.value) < r.value
    # settings are recorded only for the solver that ran
    assert avg.settings["solver"] == "average" and avg.settings["n_samples"] == 4
    assert "momentum" not in avg.settings and "optimizer" not in avg.settings
    assert r.settings["solver"] == "apgd" and "n_samples" not in r.settings
    for fn, kw in ((qm.adaptive_sharpness, dict(norm="linf")),
                   (qm.geodesic_sharpness, dict(geometry=qm.Geometry(metric=None))),
                   (qm.adaptive_sharpness, dict(solver=qm.Average(seed=1)))):
        out = fn(model, ce_loss, data, rho=0.05, n_iter=4, **kw)
        assert math.isfinite(out.value)


def test_geoopt_solver_and_tangent_ball():
    model, data = MHANet(), mha_data(n_batches=1)
    sgd = qm.GeooptSolver(lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.05), n_iter=10)
    r = qm.geodesic_sharpness(model, ce_loss, data, rho=0.1, solver=sgd)
    assert r.value > 0 and r.perturbation_norm[0] <= 0.1 + 1e-9
    assert r.settings["solver"] == "geoopt" and "momentum" not in r.settings
    M = qm.GLQuotient(5, 4, "inv")
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 9, 2, generator=gen)
    ball = qm.TangentBall(M, x0, radius=0.5)
    xi = ball.retr(ball.origin().data, torch.randn(3, 9, 2, generator=gen) * 10)
    assert float(ball.norm_at_base(xi)) == pytest.approx(0.5)
    torch.testing.assert_close(M.proju(x0, xi), xi)
    assert ball.check_point_on_manifold(xi)
    small = ball.retr(xi * 0, 0.01 * xi)
    torch.testing.assert_close(small, 0.01 * xi)  # inside the ball: only Π (idempotent)
    with pytest.raises(qm.InvalidRadiusError):
        qm.TangentBall(M, x0, 0.0)


def test_ellipsoid_projection_is_euclidean_projection():
    gen = torch.Generator().manual_seed(0)
    c = torch.rand(50, generator=gen) + 0.1
    y = torch.randn(50, generator=gen)
    y[:10] = 0.0  # e.g. embedding rows of tokens not in the batch
    p = _ellipsoid_projection(y, c, 0.3)
    assert torch.equal(p[:10], torch.zeros(10))
    assert abs(float((p / c).norm()) - 0.3) < 1e-5
    # KKT: y − p is parallel to the ellipsoid normal p / c²
    n = p / c**2
    cos = float((y - p) @ n / ((y - p).norm() * n.norm()))
    assert cos == pytest.approx(1.0, abs=1e-6)


def test_adaptive_norm_ablation():
    """App. G ablation (a): ball in ‖ξ ⊘ |w|‖ for every entry, ξ still horizontal."""
    model, data = MHANet(), mha_data(n_batches=1)
    kw = dict(rho=0.05, n_iter=6)
    adaptive_ball = qm.Geometry(ball="adaptive")
    with pytest.raises(qm.ZeroWeightError, match="adaptive_eps"):  # untrained zero biases
        qm.geodesic_sharpness(model, ce_loss, data, geometry=adaptive_ball, **kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.1)
    # Without GL blocks the two norms coincide, so the results must be identical.
    a = qm.geodesic_sharpness(model, ce_loss, data, geometry=qm.Geometry(blocks=()), **kw)
    b = qm.geodesic_sharpness(model, ce_loss, data,
                              geometry=qm.Geometry(blocks=(), ball="adaptive"), **kw)
    assert a.per_batch == pytest.approx(b.per_batch, rel=1e-12)
    r = qm.geodesic_sharpness(model, ce_loss, data, geometry=adaptive_ball, **kw)
    m = qm.geodesic_sharpness(model, ce_loss, data, **kw)
    assert r.settings["ball"] == "adaptive" and r.value != m.value
    assert r.norms[0]["total"] <= 0.05 * (1 + 1e-9) and r.norms[0]["blocks"] > 0
    # the ball norm really is the elementwise one: check it on a random horizontal vector
    geo = qm.ModelGeometry(model, adaptive_ball)
    ball = qm.sharpness.make_feasible("adaptive", geo.space, 0.05, w2=geo.w2())
    xi = ball.proju(torch.randn(geo.D, generator=torch.Generator().manual_seed(0)))
    parts = geo.space.split(xi)
    expected = sum(((t / x0) ** 2).sum() for t, x0 in zip(parts[:-1], geo.base_points[:-1]))
    expected = expected + (parts[-1] ** 2 / geo.c2).sum()
    assert float(ball.norm(xi)) == pytest.approx(float(expected.sqrt()), rel=1e-12)
    scaled = ball.project(xi * (1.0 / float(ball.norm(xi))))
    assert float(ball.norm(scaled)) == pytest.approx(0.05, rel=1e-12)
    with pytest.raises(ValueError, match="no horizontal constraint"):
        qm.Geometry(ball="ellipsoid")


def test_average_case_on_float32_model():
    """Gram algebra is float64; the Gaussian samples must still come out in the model's dtype."""
    model = MHANet().float()
    data = [(x.float(), y) for x, y in mha_data(n_batches=1)]
    for metric in ("inv", "mix"):
        r = qm.geodesic_sharpness(model, ce_loss, data, rho=0.05, n_iter=3, metric=metric,
                                  solver=qm.Average(seed=0))
        assert math.isfinite(r.value)
