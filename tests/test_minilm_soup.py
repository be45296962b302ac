"""The hyperparameter soup of MiniLM fine-tunes: design, schedule, and the quick run.

Structure and finiteness only: no τ value is asserted (τ is the experiment's output).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from quotient_manifolds.experiments import minilm_soup as ms
from quotient_manifolds.experiments import rho_sweep

torch.set_num_threads(1)


def test_soup_design_is_one_factor_at_a_time():
    pts = ms.design()
    assert len(pts) == ms.N_MEMBERS >= 50
    bases = {p.label: p.hyper for p in pts if p.base == p.label}
    assert sorted(bases) == ["m00", "m01", "m02", "m03"]
    assert list(bases.values()) == ms.sample_population()
    axes = {"lr", "weight_decay", "epochs", "label_smoothing", "augment", "seed"}
    for p in pts:
        if p.base == p.label:
            continue
        diff = {k for k in p.hyper if p.hyper[k] != bases[p.base][k]}
        assert diff == {p.axis} and p.axis in axes  # exactly the one axis changed
        if p.axis == "lr":
            assert any(p.hyper["lr"] == pytest.approx(v) for v in ms.OFAT_LEVELS["lr"])
        elif p.axis != "seed":
            assert p.hyper[p.axis] in ms.GRID[p.axis]
    # per base: 2 alternates per axis, 2 seed alternates
    for b in bases:
        own = [p for p in pts if p.base == b and p.label != b]
        assert sorted(p.axis for p in own) == sorted([a for a in axes for _ in (0, 1)])
    hs = ms.sample_population(20)
    assert all(ms.LR_RANGE[0] <= h["lr"] <= ms.LR_RANGE[1] for h in hs)
    assert set(hs[0]) == axes  # the seed too; label noise is not a factor
    ids = ms.EXPERIMENT.member_ids([p.hyper for p in pts], ms.TRAINING,
                                   [p.label for p in pts])
    assert len(set(ids)) == len(ids)


def test_schedule_warms_up_then_decays_to_zero():
    total = 5 * 64
    f = [ms.lr_factor(s, total, final_lr_frac=0.0) for s in range(total)]
    w = round(0.1 * total)
    assert f[w - 1] == 1.0 and f[0] == pytest.approx(1 / w)
    assert all(a >= b for a, b in zip(f[w - 1:], f[w:]))
    assert f[-1] == pytest.approx(1 / (total - w))  # the last step's rate, 1/(steps - w)


@pytest.mark.slow
def test_minilm_soup_quick(tmp_path):
    res = ms.run(tmp_path, quick=True, progress=False)
    disk = json.loads((tmp_path / "minilm-soup" / "results.json").read_text())
    pts = ms.design(True)
    assert disk["experiment"] == "minilm-soup" and disk["n_members"] == len(pts) == 4
    assert set(disk["measures"]) == set(rho_sweep.PAPER_COMPLETE_SWEEP)
    for key, d in disk["measures"].items():
        fam = rho_sweep.SWEEP_MEASURES[key][1]
        assert d["rho"] == disk["calibration"][fam]["rho"] and len(d["by_rho"]) == 3
    for m in disk["members"]:
        assert all(math.isfinite(v) for d in m["measures"].values() for v in d.values())
        assert all(math.isfinite(m[k]) for k in ("gap", "loss_gap", "shift_gap"))
    # every member is measured (a fixed budget); the at-minimum count is reported
    assert disk["convergence"]["not_converged"] == []
    assert disk["at_minimum"]["of"] == 4 and 0 <= disk["at_minimum"]["n"] <= 4
    assert {"lr", "weight_decay", "label_smoothing", "augment"} <= set(disk["baselines"])
    assert disk["conditional"]["on"] in disk["baselines"]
    assert set(disk["settings"]["design"]["axes"]) == {"augment", "seed"}
    assert set(disk["gap_noise"]) == {"test", "shift"}
    assert res["n_members"] == 4
