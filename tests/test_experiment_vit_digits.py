"""Tiny-ViT digits population: quick run, results.json, resume, blocks."""

import functools
import json
import math

import pytest
import torch

import quotient_manifolds as qm
from quotient_manifolds.experiments import sharpness_suite, vit_digits

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("vit")
    return out, vit_digits.run(out, quick=True, progress=False)


def test_blocks_four_qk_and_four_vo_per_layer():
    model = vit_digits.TinyViT()
    blocks = qm.discover_blocks(model, symmetry="paper")  # the reproduction's measure
    assert sorted((b.module, b.kind, b.heads, b.h) for b in blocks) == [
        (f"blocks.{i}.attn", k, 4, 8) for i in (0, 1) for k in ("attention.qk", "attention.vo")]
    # q/k/v biases are appended rows of the factors (paper App. A): n = d + 1
    assert all(b.n == 33 for b in blocks)


def test_blocks_are_exact_symmetries():
    torch.manual_seed(0)
    model = vit_digits.TinyViT().eval()
    x = torch.rand(5, 8, 8)
    moved = qm.reparametrize(model, a=3.0, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(moved.blocks[1].attn.v_proj.bias, model.blocks[1].attn.v_proj.bias)
    torch.testing.assert_close(moved(x), model(x), rtol=1e-9, atol=1e-9)


def test_split_noise_and_shift():
    xp, yp, xt, yt = vit_digits.digits_split()
    assert xp.shape == (1000, 8, 8) and xt.shape == (797, 8, 8)
    assert 0 <= float(xp.min()) and float(xp.max()) <= 1
    y = vit_digits.noisy_labels(yp[:300], 0.2, seed=4)
    assert int((y != yp[:300]).sum()) == 60  # always a *different* class
    g = torch.Generator().manual_seed(0)
    img = torch.zeros(64, 8, 8)
    img[:, 3, 4] = 1
    moved = vit_digits._shift(img, g)
    assert torch.all(moved.sum((1, 2)) == 1)
    pos = moved.flatten(1).argmax(1)
    dy, dx = pos // 8 - 3, pos % 8 - 4
    assert set(dy.tolist()) == {-1, 0, 1} and set(dx.tolist()) == {-1, 0, 1}


def test_sharpness_batches_are_shared():
    a = vit_digits.sharpness_batches({"train_size": 300, "label_noise": 0.0, "seed": 1})
    b = vit_digits.sharpness_batches({"train_size": 1000, "label_noise": 0.2, "seed": 2})
    assert [len(x) for x, _ in a] == [128, 128]
    assert all(torch.equal(xa, xb) for (xa, _), (xb, _) in zip(a, b))


def test_quick_results_structure(quick):
    out, res = quick
    on_disk = json.loads((out / "vit-digits" / "results.json").read_text())
    assert on_disk["n_members"] == res["n_members"] == 3
    assert on_disk["experiment"] == "vit-digits"
    assert set(on_disk["measures"]) == set(sharpness_suite.SUITE)
    for name, d in on_disk["measures"].items():
        assert set(d) >= {"tau", "ci95", "p_value", "rho"}
        assert d["rho"] == sharpness_suite.measure_rho(name, vit_digits.RHO)
    for m in on_disk["members"]:
        assert -1 <= m["gap"] <= 1 and math.isfinite(m["loss_gap"])
        assert m["gap"] == pytest.approx((1 - m["test_acc"]) - (1 - m["train_acc"]))
        for name in sharpness_suite.SUITE:
            assert all(math.isfinite(v) for v in m["measures"][name].values()), name
    assert set(on_disk["baselines"]) == {"lr", "weight_decay", "epochs", "label_smoothing",
                                         "augment", "label_noise", "train_size"}
    assert set(on_disk["vs_loss_gap"]["measures"]) == set(sharpness_suite.SUITE)
    for f in on_disk["figures"]:
        assert (out / "vit-digits" / f).stat().st_size > 0


def test_resume_reuses_members_and_measures(quick, monkeypatch):
    out, res = quick
    store = qm.experiments.PopulationStore(out, "vit-digits")
    ids = [m["id"] for m in res["members"]]
    (store.members_dir / f"{ids[0]}.safetensors").unlink()
    p = store.measures_dir / f"{ids[2]}.json"
    blob = json.loads(p.read_text())
    del blob["values"]["adaptive"]
    p.write_text(json.dumps(blob))
    trained, measured = [], []
    real_train, real_ad = vit_digits.train_member, qm.sharpness.engine.geodesic_sharpness

    def train(hyper, **kw):
        trained.append(hyper["seed"])
        return real_train(hyper, **kw)

    @functools.wraps(real_ad)
    def ad(*a, **kw):
        if kw["geometry"].metric is None:  # the adaptive measures
            measured.append(kw["solver"].kind)
        return real_ad(*a, **kw)

    monkeypatch.setattr(vit_digits, "train_member", train)
    monkeypatch.setattr(qm.sharpness.engine, "geodesic_sharpness", ad)
    res2 = vit_digits.run(out, quick=True, progress=False)
    assert trained == [0]
    # member 0 was retrained, so all its measures are recomputed; member 2 only lost one
    assert measured == ["worst", "average", "worst"]
    assert res2["members"][1]["measures"] == res["members"][1]["measures"]
