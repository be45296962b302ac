"""Grokking population: quick run, results.json, resume, symmetry blocks."""

import functools
import json
import math

import pytest
import torch

import quotient_manifolds as qm
from quotient_manifolds.experiments import grokking, sharpness_suite

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("grok")
    return out, grokking.run(out, quick=True, progress=False)


def test_blocks_one_qk_and_one_vo_per_head():
    model = grokking.GrokTransformer(43)
    x, _, _, _ = grokking.modular_data(43, 0.3, 0)
    blocks = qm.discover_blocks(model, example_inputs=(x[:4],))
    attention = [b for b in blocks if b.kind.startswith("attention")]  # (and MLP neurons)
    assert sorted((b.kind, b.heads, b.h) for b in attention) == [
        ("attention.qk", 4, 16), ("attention.vo", 4, 16)]


def test_blocks_are_exact_symmetries():
    torch.manual_seed(0)
    model = grokking.GrokTransformer(43)
    x, _, _, _ = grokking.modular_data(43, 0.3, 0)
    moved = qm.reparametrize(model, a=3.0, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(moved.attn.q_proj.weight, model.attn.q_proj.weight)
    torch.testing.assert_close(moved(x), model(x), rtol=1e-9, atol=1e-9)


def test_modular_data_split():
    x, y, xt, yt = grokking.modular_data(43, 0.4, 3)
    assert len(x) + len(xt) == 43 * 43 and len(x) == round(0.4 * 43 * 43)
    assert torch.equal(y, (x[:, 0] + x[:, 1]) % 43) and torch.all(x[:, 2] == 43)
    pairs = {tuple(r) for r in torch.cat([x, xt])[:, :2].tolist()}
    assert len(pairs) == 43 * 43


def test_sampler_is_fixed_and_spans_the_grid():
    a, b = grokking.sample_population(), grokking.sample_population()
    assert a == b and len(a) == 16
    assert {h["p"] for h in a} == {43, 59}
    assert len({h["weight_decay"] for h in a}) >= 2 and len({h["train_frac"] for h in a}) >= 2


def test_quick_results_structure(quick):
    out, res = quick
    on_disk = json.loads((out / "grokking" / "results.json").read_text())
    assert on_disk["n_members"] == res["n_members"] == 3
    assert on_disk["experiment"] == "grokking" and on_disk["gap"] == "test error"
    assert set(on_disk["measures"]) == set(sharpness_suite.SUITE)
    for name, d in on_disk["measures"].items():
        assert set(d) >= {"tau", "ci95", "p_value", "rho"}
        assert d["rho"] == sharpness_suite.measure_rho(name, grokking.RHO)
    for m in on_disk["members"]:
        assert 0 <= m["gap"] <= 1 and math.isfinite(m["test_loss"])
        for name in sharpness_suite.SUITE:
            assert all(math.isfinite(v) for v in m["measures"][name].values()), name
    assert set(on_disk["baselines"]) == {"weight_decay", "train_frac", "p", "steps"}
    alt = on_disk["vs_test_loss"]
    assert set(alt["measures"]) == set(sharpness_suite.SUITE) and "baselines" in alt
    for f in on_disk["figures"]:
        assert (out / "grokking" / f).stat().st_size > 0
    assert "curves.png" in on_disk["figures"] and "scatter.png" in on_disk["figures"]
    assert on_disk["at_minimum"]["of"] == 3 and on_disk["at_minimum"]["n"] <= 3


def test_resume_reuses_members_and_measures(quick, monkeypatch):
    out, res = quick
    store = qm.experiments.PopulationStore(out, "grokking")
    ids = [m["id"] for m in res["members"]]
    # interrupt: lose member 1 entirely and one measure of member 2
    (store.members_dir / f"{ids[1]}.json").unlink()
    (store.measures_dir / f"{ids[1]}.json").unlink()
    p = store.measures_dir / f"{ids[2]}.json"
    blob = json.loads(p.read_text())
    del blob["values"]["geodesic_mix"]
    p.write_text(json.dumps(blob))
    trained, measured = [], []
    real_train, real_geo = grokking.train_member, qm.sharpness.engine.geodesic_sharpness

    def train(hyper, **kw):
        trained.append(hyper["seed"])
        return real_train(hyper, **kw)

    @functools.wraps(real_geo)
    def geo(*a, **kw):
        measured.append(kw["geometry"].metric)
        return real_geo(*a, **kw)

    monkeypatch.setattr(grokking, "train_member", train)
    monkeypatch.setattr(qm.sharpness.engine, "geodesic_sharpness", geo)
    res2 = grokking.run(out, quick=True, progress=False)
    assert trained == [1]
    assert len(measured) == len(sharpness_suite.SUITE) + 1  # all of member 1, geodesic_mix of 2
    assert measured.count("mix") == 1 + sum(m.geometry.metric == "mix"
                                            for m in sharpness_suite.SUITE.values())
    assert res2["members"][0]["measures"] == res["members"][0]["measures"]
