"""Fine-tuned populations: convergence rule, ρ calibration and sweep, statistics, quick runs.

No τ value is asserted: τ is the experiments' output, not a property of the code.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import kendalltau

from quotient_manifolds.experiments import sharpness_suite as suite
from quotient_manifolds.experiments.finetune import PlateauRule, lr_factor, train_to_convergence
from quotient_manifolds.experiments.stats import (
    conditional_tau,
    discretize,
    granulated,
    granulated_tau,
)

torch.set_num_threads(1)


# -- convergence rule ----------------------------------------------------------------------
def test_plateau_rule():
    rule = PlateauRule(min_acc=0.99, k=2, abs_tol=0.002, rel_tol=0.1)

    def hist(losses, accs=None, first=1):
        accs = accs or [1.0] * len(losses)
        return [{"epoch": first + i, "loss": v, "acc": a} for i, (v, a) in
                enumerate(zip(losses, accs))]

    assert rule.met(hist([0.0038, 0.0027, 0.0022], first=10), epochs=3)  # 0.0016 <= 0.00238
    assert not rule.met(hist([0.0061, 0.0038, 0.0027], first=9), epochs=3)  # 0.0034 > 0.0026
    assert not rule.met(hist([0.01, 0.01, 0.01], first=1), epochs=5)  # before epoch E
    assert not rule.met(hist([0.01, 0.01, 0.01], [1, 1, 0.98], first=5), epochs=3)  # accuracy
    assert rule.met(hist([0.03, 0.035, 0.038], first=5), epochs=3)  # a rising loss: plateau
    assert not rule.met(hist([0.01], first=5), epochs=3)  # no epoch e - k evaluated


def test_lr_schedule():
    f = [lr_factor(s, 100, warmup=0.1, final_lr_frac=1.0) for s in range(150)]
    assert f[0] == pytest.approx(0.1) and f[9] == 1.0 and all(v == 1.0 for v in f[9:])
    g = [lr_factor(s, 100, warmup=0.1, final_lr_frac=0.1) for s in range(150)]
    assert g[10] == 1.0 and g[99] == pytest.approx(0.11) and g[100] == g[149] == 0.1
    assert all(a >= b for a, b in zip(g[9:], g[10:]))


def test_train_to_convergence_stops_at_the_rule_and_reports_the_cap():
    """A least-squares fit: converges and stops; an impossible rule runs to the cap."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=gen)
    y = x @ torch.tensor([1.0, -2.0, 0.5])
    w = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    steps = []

    def step(idx, factor, epoch):
        for grp in opt.param_groups:
            grp["lr"] = 0.1 * factor
        loss = ((x[idx] @ w - y[idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps.append(epoch)

    def evaluate():
        with torch.no_grad():
            return float(((x @ w - y) ** 2).mean()), 1.0

    rule = PlateauRule(min_acc=0.99, k=2, abs_tol=1e-3, rel_tol=0.0, max_epochs=200)
    fit = train_to_convergence(n=40, batch=8, epochs=3, rule=rule, step=step,
                               evaluate=evaluate, generator=torch.Generator().manual_seed(1))
    assert fit["converged"] and fit["converged_epoch"] == fit["epochs_run"] < 200
    assert fit["steps"] == 5 * fit["epochs_run"] == len(steps) and max(steps) == fit["epochs_run"]
    h = fit["history"]
    assert [e["epoch"] for e in h] == list(range(1, fit["epochs_run"] + 1))
    assert rule.met(h, 3) and not rule.met(h[:-1], 3)  # stopped at the first epoch that met it
    never = PlateauRule(min_acc=2.0, max_epochs=6)
    fit = train_to_convergence(n=40, batch=8, epochs=3, rule=never, step=step,
                               evaluate=evaluate, generator=torch.Generator().manual_seed(1))
    assert not fit["converged"] and fit["epochs_run"] == 6 and fit["converged_epoch"] is None
    with pytest.raises(ValueError, match="plateau window"):
        train_to_convergence(n=40, batch=8, epochs=2, rule=rule, step=step, evaluate=evaluate,
                             generator=torch.Generator())


# -- statistics ------------------------------------------------------------------------------
def test_conditional_tau_is_pooled_kendall():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=30), rng.normal(size=30)
    one = conditional_tau(x, y, [0] * 30)
    assert one["tau"] == pytest.approx(kendalltau(x, y).statistic)
    assert one["n_pairs"] == 435 and one["n_strata"] == 1
    # a stratifier that explains everything: across-strata agreement is removed
    s = np.repeat([0, 1, 2], 10)
    xs, ys = x + 10 * s, y + 10 * s
    assert kendalltau(xs, ys).statistic > 0.5
    within = conditional_tau(xs, ys, s)
    manual = [kendalltau(x[s == k], y[s == k]).statistic for k in range(3)]
    assert within["n_strata"] == 3 and within["n_pairs"] == 135
    assert abs(within["tau"]) < 0.5 and within["tau"] == pytest.approx(np.mean(manual), abs=0.05)


def test_discretize_and_granulated_on_a_grid():
    assert discretize([0.1, 0.2, 0.1]) == [0.1, 0.2, 0.1]
    lv = discretize(list(np.geomspace(1e-5, 1e-3, 9)))
    assert lv == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # a full 3 x 3 grid of (a, b), 2 seeds: each axis' groups hold 3 values of it
    hypers = [{"a": a, "b": b} for a in (1, 2, 3) for b in (10, 20, 30) for _ in range(2)]
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=18), rng.normal(size=18)
    g = granulated(x, y, hypers, min_group=3)
    for axis, other in (("a", "b"), ("b", "a")):
        ref = granulated_tau(x, y, [[h[other]] for h in hypers])
        assert g["axes"][axis]["tau"] == pytest.approx(ref)
        assert g["axes"][axis]["n_groups"] == 3 and g["axes"][axis]["n_members"] == 18
    assert g["psi"] == pytest.approx((g["axes"]["a"]["tau"] + g["axes"]["b"]["tau"]) / 2)
    # random sampling: no group shares every other level -> reported as NaN with 0 groups
    lone = granulated(x[:3], y[:3], [{"a": 1, "b": 1}, {"a": 2, "b": 2}, {"a": 3, "b": 3}])
    assert math.isnan(lone["psi"]) and lone["axes"]["a"]["n_groups"] == 0


# -- calibration and sweep on a fake measure table --------------------------------------------
class _FakeMeasure:
    def __init__(self, scale, kind="worst"):
        self.scale, self.kind, self.calls = scale, kind, []

    def run(self, model, loss_fn, data, *, rho, n_iter=None, seed=None, params=None):
        self.calls.append(rho)
        norms = [{"blocks": 0.6 * rho, "adaptive": 0.8 * rho, "total": rho}]
        return SimpleNamespace(value=self.scale * rho**2, norms=norms)


@pytest.fixture
def fake_table(monkeypatch):
    table = {"adaptive": _FakeMeasure(0.1), "geodesic-inv": _FakeMeasure(10.0),
             "geodesic-mix": _FakeMeasure(1000.0), "adaptive-metric": _FakeMeasure(0.1),
             "geodesic-inv-average": _FakeMeasure(10.0, "average")}
    monkeypatch.setattr(suite, "_measure_table", lambda: table)
    return table


def test_calibration_rule_on_the_grid(fake_table):
    model = torch.nn.Linear(4, 1)
    cal = suite.calibrate_rho(model, None, [None], n_iter=1)
    # increase = c ρ²: target 0.1 at ρ = 1 (c = 0.1), 0.1 (c = 10), 0.01 (c = 1000)
    assert cal["adaptive"]["rho"] == pytest.approx(1.0)
    assert cal["inv"]["rho"] == pytest.approx(0.1)
    assert cal["mix"]["rho"] == pytest.approx(0.01)
    for c in cal.values():
        vals = dict(c["trace"])
        below = [r for r, v in vals.items() if v < 0.1]
        above = [r for r, v in vals.items() if v >= 0.1]
        assert below and above  # the target was bracketed
    radii = suite.sweep_radii(cal)
    assert radii["inv"] == pytest.approx([0.1 / 3, 0.1, 0.3])


def test_measure_sweep_caches_resumes_and_scales_the_average_radius(fake_table):
    model = torch.nn.Linear(4, 2)  # D = 10 weights
    radii = {"adaptive": [0.5, 1.0], "inv": [0.1], "mix": [0.01]}
    saved = []
    v = suite.measure_sweep(model, None, [None], radii=radii, n_iter=1, seed=0, cached={},
                            save=lambda d: saved.append(json.loads(json.dumps(d))))
    assert v["adaptive"] == {"0.5": pytest.approx(0.025), "1.0": pytest.approx(0.1)}
    assert fake_table["geodesic-inv-average"].calls == [pytest.approx(0.1 / math.sqrt(10))]
    assert v["_norms"]["geodesic_inv"]["0.1"][0]["blocks"] == pytest.approx(0.06)
    assert suite.block_fraction(v["_norms"]["geodesic_inv"]["0.1"]) == pytest.approx(0.36)
    assert "geodesic-inv-full" in v["_unavailable"] and "geodesic_inv_full" not in v
    n_calls = sum(len(m.calls) for m in fake_table.values())
    again = suite.measure_sweep(model, None, [None], radii=radii, n_iter=1, seed=0,
                                cached=saved[-1], save=lambda d: None)
    assert sum(len(m.calls) for m in fake_table.values()) == n_calls  # all cached
    assert again["adaptive"] == v["adaptive"]


# -- the quick populations ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def vit_quick(tmp_path_factory):
    from quotient_manifolds.experiments import vit_finetune

    out = tmp_path_factory.mktemp("vitft")
    return out, vit_finetune.run(out, quick=True, progress=False)


def _check_sweep_results(res, out, name):
    on_disk = json.loads((out / name / "results.json").read_text())
    assert on_disk["experiment"] == name and on_disk["n_members"] == 3
    for key in ("adaptive", "adaptive_metric", "geodesic_inv", "geodesic_mix"):
        m = on_disk["measures"][key]
        assert len(m["by_rho"]) >= 3 and math.isfinite(m["tau"])
        fam = suite.SWEEP_MEASURES[key][1]
        assert m["rho"] == on_disk["calibration"][fam]["rho"]
        assert sorted(float(r) for r in m["by_rho"]) == pytest.approx(on_disk["radii"][fam])
    assert set(on_disk["granulated"]) == set(on_disk["measures"])
    assert on_disk["conditional"]["on"] in on_disk["baselines"]
    for g in ("geodesic_inv", "geodesic_mix"):
        split = on_disk["budget_split"][g]
        assert all(0 <= f <= 1 for f in split["block_fraction"].values())
    assert on_disk["convergence"]["n_converged"] == 3
    for mem in on_disk["members"]:
        assert mem["converged"] and mem["history"]
    for f in on_disk["figures"]:
        assert (out / name / f).stat().st_size > 1000
    assert "vs_loss_gap" in on_disk
    return on_disk


def test_vit_finetune_quick(vit_quick):
    out, res = vit_quick
    on_disk = _check_sweep_results(res, out, "vit-finetune")
    assert on_disk["pretraining"]["acc_a"] > 0


def test_vit_finetune_resume_trains_and_measures_nothing(vit_quick, monkeypatch):
    from quotient_manifolds.experiments import vit_finetune

    out, res = vit_quick
    calls = []
    monkeypatch.setattr(vit_finetune, "train_member", lambda *a, **k: calls.append("train"))
    monkeypatch.setattr(suite, "_run_measure", lambda *a, **k: calls.append("measure"))
    again = vit_finetune.run(out, quick=True, progress=False)
    assert calls == []
    assert [m["measures"] for m in again["members"]] == [m["measures"] for m in res["members"]]


def test_vit_data_split_subsets_and_shift():
    from quotient_manifolds.experiments import vit_finetune as vf

    d = vf.mnist_splits((50, 40, 30))
    assert d["xa"].shape == (50, 1, 28, 28) and d["xc"].shape == (30, 1, 28, 28)
    flat = torch.cat([d["xa"], d["xb"], d["xc"]]).flatten(1)
    assert len({tuple(r.tolist()) for r in flat}) == 120  # disjoint parts (distinct images)
    idx = vf.member_subset({"seed": 3, "train_size": 30}, 40, 16)
    assert idx[:16].tolist() == list(range(16)) and len(set(idx.tolist())) == 30
    img = torch.zeros(5, 1, 28, 28)
    img[:, :, 14, 14] = 1.0
    moved = vf.random_shift(img, 2, torch.Generator().manual_seed(0))
    assert moved.shape == img.shape and torch.all(moved.sum((-1, -2)) == 1)
    pos = moved[:, 0].flatten(1).argmax(1)
    assert all(abs(int(p) // 28 - 14) <= 2 and abs(int(p) % 28 - 14) <= 2 for p in pos)


def test_minilm_perturbed_selection_and_subsets():
    from quotient_manifolds.experiments import minilm_finetune as mf

    assert not mf.perturbed("bert.embeddings.word_embeddings.weight", None)
    assert not mf.perturbed("bert.embeddings.position_embeddings.weight", None)
    assert mf.perturbed("bert.embeddings.LayerNorm.weight", None)
    assert mf.perturbed("bert.encoder.layer.0.attention.self.query.weight", None)
    assert mf.perturbed("head.weight", None)
    idx = mf.member_subset({"seed": 5, "train_size": 256}, 1024, 128)
    assert idx[:128].tolist() == list(range(128)) and len(set(idx.tolist())) == 256
    y = torch.arange(300) % 3
    noisy = mf.noisy_labels(y, 0.2, seed=1)
    assert int((noisy != y).sum()) == 60  # always a different class
    hs = mf.sample_population()
    assert hs == mf.sample_population() and len(hs) == mf.N_MEMBERS
    assert all(mf.LR_RANGE[0] <= h["lr"] <= mf.LR_RANGE[1] for h in hs)


@pytest.mark.slow
def test_minilm_finetune_quick(tmp_path):
    from quotient_manifolds.experiments import minilm_finetune

    res = minilm_finetune.run(tmp_path, quick=True, progress=False)
    _check_sweep_results(res, tmp_path, "minilm-finetune")


def test_average_case_retries_on_a_float64_copy(fake_table):
    """An average-case call that fails on a float32 model is repeated once in float64."""
    class Picky(_FakeMeasure):
        def run(self, model, loss_fn, data, **kw):
            if next(model.parameters()).dtype != torch.float64:
                raise RuntimeError("expected scalar type Double but found Float")
            return super().run(model, loss_fn, data, **kw)

    fake_table["geodesic-inv-average"] = Picky(10.0, "average")
    model = torch.nn.Linear(4, 2).float()
    v = suite.measure_sweep(model, None, [torch.ones(1, 4)], radii={"adaptive": [1.0],
                            "inv": [0.1], "mix": [0.01]}, n_iter=1, seed=0, cached={},
                            save=lambda d: None)
    assert v["geodesic_inv_average"]["0.1"] == pytest.approx(10.0 * (0.1 / math.sqrt(10)) ** 2)
    assert "Double" in v["_float64_retry"]["geodesic_inv_average"]
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is untouched


def test_at_minimum_count():
    from quotient_manifolds.experiments.template import at_minimum

    recs = [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    got = at_minimum(recs, {"a": 1.0, "b": 0.985, "c": 0.99})
    assert got["ids"] == ["a", "c"] and got["n"] == 2 and got["of"] == 3
    assert "0.99" in got["rule"]
