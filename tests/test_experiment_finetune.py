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

from quotient_manifolds.experiments import rho_sweep as suite
from quotient_manifolds.experiments.finetune import (
    PlateauRule,
    lr_factor,
    ofat_alternates,
    ofat_design,
    train_to_convergence,
)
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


# -- the one-factor-at-a-time design and its granulated τ ------------------------------------
def test_ofat_alternates():
    assert ofat_alternates(0.01, [0.0, 0.01, 0.1]) == [0.0, 0.1]
    assert ofat_alternates(0, [0, 1]) == [1]
    lv = [3e-5, math.sqrt(3e-5 * 1e-4), 1e-4]
    assert ofat_alternates(6.7e-5, lv, log=True) == [3e-5, 1e-4]  # nearest: the middle
    assert ofat_alternates(7.9e-5, lv, log=True) == [3e-5, lv[1]]  # nearest: 1e-4
    assert ofat_alternates(3e-5, lv, log=True) == lv[1:]


def test_ofat_design_changes_one_axis_per_alternate():
    bases = [("m00", {"a": 1.0, "b": 10, "seed": 0}), ("m01", {"a": 2.0, "b": 30, "seed": 1})]
    pts = ofat_design(bases, {"a": [1.0, 2.0, 3.0], "b": [10, 20, 30]}, log_axes=(),
                      extras=[("m02", {"a": 5.0, "b": 20, "seed": 2})])
    assert [p.label for p in pts] == [
        "m00", "m00_a1", "m00_a2", "m00_b1", "m00_b2", "m00_seed1", "m00_seed2",
        "m01", "m01_a1", "m01_a2", "m01_b1", "m01_b2", "m01_seed1", "m01_seed2", "m02"]
    assert pts == ofat_design(bases, {"a": [1.0, 2.0, 3.0], "b": [10, 20, 30]}, log_axes=(),
                              extras=[("m02", {"a": 5.0, "b": 20, "seed": 2})])
    base = {p.label: p.hyper for p in pts if p.base == p.label}
    for p in pts:
        if p.axis is None:
            assert p.base in (p.label, None)
            continue
        diff = {k for k in p.hyper if p.hyper[k] != base[p.base][k]}
        assert diff == {p.axis}
        assert type(p.hyper[p.axis]) is type(base[p.base][p.axis])
    assert [p.hyper["seed"] for p in pts if p.axis == "seed"] == [1000, 2000, 1001, 2001]
    assert pts[-1].base is None and pts[-1].axis is None
    with pytest.raises(KeyError, match="axis 'c'"):
        ofat_design(bases, {"c": [1, 2]})


def _synthetic_ofat():
    """3 bases x (axis a: 2 alternates, axis b: 1 alternate) + 1 extra, with x and gap chosen
    per group so that the within-group τ is known by hand."""
    bases = [(f"m{i:02d}", {"a": 2, "b": 0, "seed": i}) for i in range(3)]
    pts = ofat_design(bases, {"a": [1, 2, 3], "b": [0, 1]}, n_seeds=0,
                      extras=[("m03", {"a": 1, "b": 1, "seed": 3})])
    # within-group orders of (x, gap), listed in the design order (base, alternates):
    # axis a, base 0: x 1 2 3 / gap 1 2 3 -> 3 concordant pairs: τ = +1
    # axis a, base 1: x 1 2 3 / gap 3 2 1 -> τ = -1
    # axis a, base 2: x 1 2 3 / gap 1 3 2 -> C = 2, D = 1: τ = 1/3
    # axis b, base 0: x 1 4 / gap 1 5 -> +1; base 1: x 1 4 / gap 3 0 -> -1;
    #         base 2: x 1 4 / gap 1 1.5 -> +1
    vals = {"m00": (1, 1), "m00_a1": (2, 2), "m00_a2": (3, 3), "m00_b1": (4, 5),
            "m01": (1, 3), "m01_a1": (2, 2), "m01_a2": (3, 1), "m01_b1": (4, 0),
            "m02": (1, 1), "m02_a1": (2, 3), "m02_a2": (3, 2), "m02_b1": (4, 1.5),
            "m03": (100, -100)}
    x = [vals[p.label][0] for p in pts]
    y = [vals[p.label][1] for p in pts]
    return pts, x, y


def test_granulated_tau_on_a_synthetic_ofat_design():
    pts, x, y = _synthetic_ofat()
    g = granulated(x, y, [p.hyper for p in pts], axes=["a", "b"],
                   ids=[p.label for p in pts])
    a, b = g["axes"]["a"], g["axes"]["b"]
    assert a["tau"] == pytest.approx((1 - 1 + 1 / 3) / 3)
    assert b["tau"] == pytest.approx((1 - 1 + 1) / 3)
    assert g["psi"] == pytest.approx((1 / 9 + 1 / 3) / 2) and g["n_axes"] == 2
    assert (a["n_groups"], a["n_members"], b["n_groups"], b["n_members"]) == (3, 9, 3, 6)
    assert [grp["members"] for grp in a["groups"]] == [
        ["m00", "m00_a1", "m00_a2"], ["m01", "m01_a1", "m01_a2"], ["m02", "m02_a1", "m02_a2"]]
    assert [grp["tau"] for grp in a["groups"]] == pytest.approx([1, -1, 1 / 3])
    assert a["groups"][0]["values"] == [2, 1, 3]
    assert all("m03" not in grp["members"] for d in (a, b) for grp in d["groups"])
    # a constant gap inside one group: that group has no τ and is not averaged
    y2 = list(y)
    for i, p in enumerate(pts):
        if p.label in ("m01", "m01_a1", "m01_a2"):
            y2[i] = 0.5
    g2 = granulated(x, y2, [p.hyper for p in pts], axes=["a"])
    assert g2["axes"]["a"]["n_groups"] == 2 and len(g2["axes"]["a"]["groups"]) == 3
    assert g2["axes"]["a"]["tau"] == pytest.approx((1 + 1 / 3) / 2)
    # a non-finite measure drops the member: base 0's group of axis b has one member left
    x3 = [math.nan if p.label == "m00_b1" else v for p, v in zip(pts, x)]
    g3 = granulated(x3, y, [p.hyper for p in pts], axes=["b"])
    assert g3["axes"]["b"]["n_groups"] == 2 and g3["axes"]["b"]["tau"] == pytest.approx(0.0)


@pytest.mark.parametrize("module", ["minilm_finetune", "vit_finetune"])
def test_population_designs_make_exactly_the_declared_groups(module):
    """On the real designs, grouping by the exact values of the other hyperparameters
    recovers the OFAT groups: each base with its alternates along the axis; extras in none."""
    import importlib

    mod = importlib.import_module(f"quotient_manifolds.experiments.{module}")
    for quick in (False, True):
        pts = mod.design(quick)
        axes = sorted({p.axis for p in pts if p.axis})
        rng = np.random.default_rng(0)
        g = granulated(rng.normal(size=len(pts)), rng.normal(size=len(pts)),
                       [p.hyper for p in pts], axes=axes, ids=[p.label for p in pts])
        bases = [p.label for p in pts if p.base == p.label]
        for axis in axes:
            want = sorted(sorted([b] + [p.label for p in pts if p.base == b and p.axis == axis])
                          for b in bases)
            got = sorted(sorted(grp["members"]) for grp in g["axes"][axis]["groups"])
            assert got == want
            assert g["axes"][axis]["n_groups"] == len(bases)
        ids = mod.EXPERIMENT.member_ids(mod.EXPERIMENT.hypers(quick),
                                        mod.EXPERIMENT.training(quick),
                                        mod.EXPERIMENT.labels(quick))
        assert len(set(ids)) == len(ids) == len(pts)
    assert len(mod.design()) == mod.N_MEMBERS >= (35 if module == "minilm_finetune" else 40)


def test_minilm_design_keeps_the_members_trained_before_it():
    """The eight members trained under the sampler before the design was fixed keep their
    ids (so they are not retrained): bases m00-m02, extras m03-m07."""
    from quotient_manifolds.experiments import minilm_finetune as mf

    e = mf.EXPERIMENT
    ids = e.member_ids(e.hypers(False), e.training(False), e.labels(False))
    trained = ["m00-4a358b21", "m01-5d0dca85", "m02-5c59bf04", "m03-bcc6a0b4", "m04-e5dc527c",
               "m05-9662057f", "m06-9d075384", "m07-69678993"]
    assert set(trained) <= set(ids)
    pts = {p.label: p for p in mf.design()}
    assert [pts[t[:3]].base for t in trained] == ["m00", "m01", "m02"] + [None] * 5
    assert "epochs" not in {p.axis for p in pts.values()}


def test_member_ids_refuse_a_hyperparameter_hidden_by_the_protocol():
    from quotient_manifolds.experiments.template import PopulationExperiment

    e = PopulationExperiment()
    with pytest.raises(ValueError, match="augment"):
        e.member_ids([{"augment": 1}], {"augment": "shifts"})
    with pytest.raises(ValueError, match="same label"):
        e.member_ids([{"a": 1}, {"a": 1}], {}, ["m00", "m00"])
    assert e.member_ids([{"a": 1}, {"a": 2}], {})[1].startswith("m01-")


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
             "adaptive-average": _FakeMeasure(0.001, "average"),
             "geodesic-inv-average": _FakeMeasure(2.5, "average"),
             "geodesic-mix-average": _FakeMeasure(1000.0, "average")}
    monkeypatch.setattr(suite, "_measure_table", lambda: table)
    return table


def test_calibration_rule_on_the_grid(fake_table):
    model = torch.nn.Linear(4, 1)
    cal = suite.calibrate_rho(model, None, [None], n_iter=1)
    # increase = c ρ²: target 0.1 at ρ = 1 (c = 0.1), 0.1 (c = 10), 0.01 (c = 1000)
    assert cal["adaptive"]["rho"] == pytest.approx(1.0)
    assert cal["inv"]["rho"] == pytest.approx(0.1)
    assert cal["mix"]["rho"] == pytest.approx(0.01)
    # the average case is calibrated on its own, by the same rule (0.1 = c ρ² at ρ = 10, 0.2)
    assert cal["adaptive_average"]["rho"] == pytest.approx(10.0)
    assert cal["inv_average"]["rho"] == pytest.approx(0.2)
    assert cal["mix_average"]["rho"] == pytest.approx(0.01)
    for c in cal.values():
        vals = dict(c["trace"])
        below = [r for r, v in vals.items() if v < 0.1]
        above = [r for r, v in vals.items() if v >= 0.1]
        assert below and above  # the target was bracketed
    radii = suite.sweep_radii(cal)
    assert radii["inv"] == pytest.approx([0.1 / 3, 0.1, 0.3])


def test_measure_sweep_caches_resumes_and_uses_each_family_radius(fake_table):
    model = torch.nn.Linear(4, 2)
    radii = {"adaptive": [0.5, 1.0], "inv": [0.1], "mix": [0.01], "adaptive_average": [3.0],
             "inv_average": [0.2, 0.4], "mix_average": [0.003]}
    saved = []
    v = suite.measure_sweep(model, None, [None],
                            settings=suite.SweepSettings(radii=radii, n_iter=1, seed=0),
                            cached={}, save=lambda d: saved.append(json.loads(json.dumps(d))))
    assert v["adaptive"] == {"0.5": pytest.approx(0.025), "1.0": pytest.approx(0.1)}
    # the average case at its own radii, called with them (the standard deviation per direction)
    assert fake_table["geodesic-inv-average"].calls == [0.2, 0.4]
    assert v["geodesic_inv_average"] == {"0.2": pytest.approx(0.1), "0.4": pytest.approx(0.4)}
    assert v["_norms"]["geodesic_inv"]["0.1"][0]["blocks"] == pytest.approx(0.06)
    assert suite.block_fraction(v["_norms"]["geodesic_inv"]["0.1"]) == pytest.approx(0.36)
    assert "geodesic-inv-full" in v["_unavailable"] and "geodesic_inv_full" not in v
    n_calls = sum(len(m.calls) for m in fake_table.values())
    again = suite.measure_sweep(model, None, [None],
                                settings=suite.SweepSettings(radii=radii, n_iter=1, seed=0),
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
    import importlib

    mod = importlib.import_module(f"quotient_manifolds.experiments.{name.replace('-', '_')}")
    on_disk = json.loads((out / name / "results.json").read_text())
    pts = mod.design(True)
    assert on_disk["experiment"] == name and on_disk["n_members"] == len(pts) == 4
    for key in ("adaptive", "adaptive_metric", "geodesic_inv", "geodesic_mix"):
        m = on_disk["measures"][key]
        assert len(m["by_rho"]) >= 3 and math.isfinite(m["tau"])
        fam = suite.SWEEP_MEASURES[key][1]
        assert m["rho"] == on_disk["calibration"][fam]["rho"]
        assert sorted(float(r) for r in m["by_rho"]) == pytest.approx(on_disk["radii"][fam])
    assert set(on_disk["granulated"]) == set(on_disk["measures"])
    # the OFAT groups of the quick design: the base with its one alternate per axis
    design = on_disk["settings"]["design"]
    axes = design["axes"]
    assert len(axes) == 2 and "seed" in axes and design["extras"] == ["m01"]
    by_label = {m["design"]["label"]: m["id"] for m in on_disk["members"]}
    assert set(by_label) == {p.label for p in pts}
    for g in on_disk["granulated"].values():
        assert set(g["axes"]) == set(axes)
        for a in axes:
            groups = g["axes"][a]["groups"]
            assert [sorted(grp["members"]) for grp in groups] == [
                sorted([by_label["m00"], by_label[f"m00_{a}1"]])]
            assert g["axes"][a]["n_groups"] == sum(math.isfinite(grp["tau"]) for grp in groups)
    assert set(on_disk["granulated_baselines"]) == set(on_disk["baselines"])
    # the cross-entropy gap has no ties: every group has a τ, the base's partner decides it
    for meas, g in on_disk["vs_loss_gap"]["granulated"].items():
        gaps = {m["id"]: m["loss_gap"] for m in on_disk["members"]}
        d = on_disk["measures"][meas]
        key = next(r for r in d["by_rho"] if float(r) == d["rho"])
        vals = {m["id"]: m["measures"][meas][key] for m in on_disk["members"]}
        for a in axes:
            b, alt = by_label["m00"], by_label[f"m00_{a}1"]
            want = np.sign(vals[alt] - vals[b]) * np.sign(gaps[alt] - gaps[b])
            assert g["axes"][a]["tau"] == want and g["axes"][a]["n_groups"] == 1
        assert g["psi"] == pytest.approx(np.mean([g["axes"][a]["tau"] for a in axes]))
    assert on_disk["conditional"]["on"] in on_disk["baselines"]
    for g in ("geodesic_inv", "geodesic_mix"):
        split = on_disk["budget_split"][g]
        assert all(0 <= f <= 1 for f in split["block_fraction"].values())
    assert on_disk["convergence"]["n_converged"] == len(pts)
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
    monkeypatch.setattr(suite, "run_measure", lambda *a, **k: calls.append("measure"))
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
    noisy = mf.noisy_labels(y, 0.2, seed=1, n_classes=mf.N_CLASSES)
    assert int((noisy != y).sum()) == 60  # always a different class
    hs = mf.sample_population(36)
    assert hs == mf.sample_population(36) and hs[:8] == mf.sample_population()
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
    radii = {"adaptive": [1.0], "inv": [0.1], "mix": [0.01], "adaptive_average": [1.0],
             "inv_average": [0.1], "mix_average": [0.01]}
    v = suite.measure_sweep(model, None, [torch.ones(1, 4)],
                            settings=suite.SweepSettings(radii=radii, n_iter=1, seed=0),
                            cached={}, save=lambda d: None)
    assert v["geodesic_inv_average"]["0.1"] == pytest.approx(10.0 * 0.1**2)
    assert "Double" in v["_float64_retry"]["geodesic_inv_average"]
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is untouched


def test_at_minimum_count():
    from quotient_manifolds.experiments.template import at_minimum

    recs = [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    got = at_minimum(recs, {"a": 1.0, "b": 0.985, "c": 0.99})
    assert got["ids"] == ["a", "c"] and got["n"] == 2 and got["of"] == 3
    assert "0.99" in got["rule"]
