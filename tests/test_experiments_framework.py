"""The experiment registry, the ``reproduce`` command, and resuming a cached population."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quotient_manifolds.experiments import registry

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


# -- registry ------------------------------------------------------------------------------
def test_registry_names():
    assert list(registry.EXPERIMENTS) == ["diagonal", "toy", "invariance", "grokking",
                                          "vit-digits", "lora-minilm", "smollm2",
                                          "minilm-finetune", "vit-finetune", "seed-finetune",
                                          "minilm-soup"]
    assert callable(registry.load("toy"))
    with pytest.raises(ValueError, match="unknown experiment"):
        registry.load("imagenet")


def test_missing_module_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(registry.EXPERIMENTS, "ghost", "no_such_experiment_module")
    with pytest.raises(registry.ExperimentUnavailableError, match="not available"):
        registry.load("ghost")
    # nothing runs when one of the requested experiments is unavailable
    calls = []
    monkeypatch.setitem(registry.EXPERIMENTS, "toy", "toy")
    monkeypatch.setattr(registry, "load", _fake_loader(calls, missing={"ghost"}))
    with pytest.raises(registry.ExperimentUnavailableError):
        registry.run_experiments(["toy", "ghost"], "unused")
    assert calls == []


def _fake_loader(calls, missing=()):
    def load(name):
        if name in missing:
            raise registry.ExperimentUnavailableError(name)

        def run(out, *, quick=False, progress=True):
            calls.append((name, str(out), quick, progress))
            return {"experiment": name, "n_members": 0, "gap": "-", "measures": {},
                    "baselines": {}}
        return run
    return load


def test_all_runs_every_experiment_in_order(monkeypatch):
    calls = []
    monkeypatch.setattr(registry, "load", _fake_loader(calls))
    res = registry.run_experiments(["toy", "all"], "OUT", quick=True, progress=False)
    assert [c[0] for c in calls] == ["toy", "diagonal", "invariance", "grokking", "vit-digits",
                                     "lora-minilm", "smollm2", "minilm-finetune",
                                     "vit-finetune", "seed-finetune", "minilm-soup"]
    assert all(c[1:] == ("OUT", True, False) for c in calls)
    assert all(r["wall_s"] >= 0 for r in res.values())
    table = registry.combined_table(res)
    assert all(f"{n}: 0 members" in table for n in registry.EXPERIMENTS)


# -- command line ------------------------------------------------------------------------------
def _cli(*args, cwd=ROOT):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "quotient_manifolds", *args], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("name", ["diagonal", "toy"])
def test_cli_reproduce_quick(tmp_path, name):
    p = _cli("reproduce", name, "--out", str(tmp_path), "--quick")
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"{name}:" in p.stdout and "tau" in p.stdout  # the printed table
    res = json.loads((tmp_path / name / "results.json").read_text())
    assert res["experiment"] == name
    for key in ("n_members", "measures", "baselines", "settings", "gap"):
        assert key in res
    assert list((tmp_path / name).glob("*.png"))
    if name == "toy":
        toy = res["toy"]
        assert toy["riemannian_max_rel_variation"] < 1e-12  # constant on the orbit
        assert toy["euclidean_max_over_min"] > 2  # the Euclidean norm is not
        assert toy["geodesic_vs_closed_form_max_rel_err"] < 1e-6
        assert all(math.isfinite(x) for x in toy["euclidean_grad_norm"])


def test_cli_reproduce_unknown_name(tmp_path):
    p = _cli("reproduce", "nope", "--out", str(tmp_path))
    assert p.returncode == 2 and "invalid choice" in p.stderr


# -- resume ------------------------------------------------------------------------------------
def _mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.iterdir())}


def test_resume_does_not_retrain_and_fills_gaps(tmp_path, monkeypatch):
    from quotient_manifolds.experiments import diagonal

    trained = []
    real = diagonal.train_population

    def counting(configs, *a, **k):
        trained.extend(c["id"] for c in configs)
        return real(configs, *a, **k)

    monkeypatch.setattr(diagonal, "train_population", counting)
    first = diagonal.run(tmp_path, quick=True, progress=False)
    assert len(trained) == 8
    members = tmp_path / "diagonal" / "members"
    measures = tmp_path / "diagonal" / "measures"
    m_before, s_before = _mtimes(members), _mtimes(measures)

    trained.clear()
    second = diagonal.run(tmp_path, quick=True, progress=False)
    assert trained == []  # nothing retrained
    assert _mtimes(members) == m_before and _mtimes(measures) == s_before
    assert [m["measures"] for m in second["members"]] == [m["measures"] for m in first["members"]]

    # an interrupted run: one member never saved, one member's measures missing
    lost = first["members"][0]["id"]
    (members / f"{lost}.json").unlink()  # weights without metadata = unfinished member
    gap = first["members"][1]["id"]
    (measures / f"{gap}.json").unlink()
    third = diagonal.run(tmp_path, quick=True, progress=False)
    assert trained == [lost]
    after = _mtimes(members)
    assert all(after[k] == v for k, v in m_before.items() if not k.startswith(lost))
    assert after[f"{lost}.json"] != m_before[f"{lost}.json"]
    # the retrained member and the re-measured one reproduce their earlier values
    by_id = {m["id"]: m for m in third["members"]}
    for mid in (lost, gap):
        old = next(m for m in first["members"] if m["id"] == mid)
        assert by_id[mid]["gap"] == pytest.approx(old["gap"], rel=1e-9)
        for name, vals in old["measures"].items():
            for r, x in vals.items():
                assert by_id[mid]["measures"][name][r] == pytest.approx(x, rel=1e-6, abs=1e-12)


@pytest.mark.slow
def test_invariance_quick(tmp_path):
    """MiniLM, float64: the geodesic ratios stay at 1 after reparametrisation (~1-4 min)."""
    from quotient_manifolds.experiments import invariance

    res = invariance.run(tmp_path, quick=True, progress=False)
    on_disk = json.loads((tmp_path / "invariance" / "results.json").read_text())
    assert on_disk["experiment"] == "invariance" == res["experiment"]
    inv = on_disk["invariance"]
    for name in ("geodesic_inv", "geodesic_mix", "adaptive"):
        assert len(inv["ratio"][name]) == len(inv["scales"])
        assert all(math.isfinite(r) and r > 0 for r in inv["ratio"][name])
    for name in ("geodesic_inv", "geodesic_mix"):  # exact invariance, float64
        assert all(abs(r - 1) < 1e-6 for r in inv["ratio"][name])
    assert (tmp_path / "invariance" / "ratio.png").stat().st_size > 1000


def test_store_trains_only_missing_members_and_drops_stale_measures(tmp_path):
    import torch

    from quotient_manifolds.experiments import PopulationStore

    store = PopulationStore(tmp_path, "pop")
    calls = []

    def train(h):
        calls.append(h["x"])
        return {"w": torch.full((2,), float(h["x"]))}, {"x": h["x"]}

    store.train_missing(["a", "b"], [{"x": 1}, {"x": 2}], train, desc="t", progress=False)
    store.save_measures("a", "p", {"m": {"0.1": 1.0}})
    store.train_missing(["a", "b", "c"], [{"x": 1}, {"x": 2}, {"x": 3}], train, desc="t",
                        progress=False)
    assert calls == [1, 2, 3]
    assert store.load_measures("a", "p") == {"m": {"0.1": 1.0}}
    store.save_member("a", *train({"x": 4}))  # new weights under the same id
    assert store.load_measures("a", "p") == {}
    state, meta = store.load_member("a")
    assert meta == {"x": 4} and state["w"].tolist() == [4.0, 4.0]
