"""LoRA-MiniLM population: data, model, geometry, quick run and resume."""

import json
import math

import pytest
import torch

import quotient_manifolds as qm
from quotient_manifolds.experiments import lora_minilm as L
from quotient_manifolds.experiments import sharpness_suite

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def minilm():
    return L.load_minilm()


@pytest.fixture(scope="module")
def tweets():
    return L.load_tweets(64)


def _inputs(minilm, tweets, n=8):
    bert, tok = minilm
    texts, labels = tweets
    hidden, mask = L.encode_layer4_inputs(bert, tok, texts[:n])
    return hidden, mask, torch.tensor(labels[:n])


def test_tweets_deduplicated_shuffled_deterministic(tweets):
    texts, labels = L.load_tweets(2000)
    assert len(texts) == len(set(texts)) == 2000
    assert set(labels) == {0, 1, 2}
    assert texts[:64] == tweets[0] and labels[:64] == tweets[1]
    other, _ = L.load_tweets(64, seed=1)
    assert other != tweets[0]


def test_cached_layer4_inputs_are_exact(minilm, tweets):
    bert, tok = minilm
    hidden, mask, _ = _inputs(minilm, tweets)
    assert hidden.shape == (8, L.MAX_LEN, 384) and hidden.dtype == torch.float32
    enc = tok(tweets[0][:8], padding="max_length", truncation=True, max_length=L.MAX_LEN,
              return_tensors="pt")
    with torch.no_grad():
        full = bert(**enc).last_hidden_state
        model = L.build_member(bert, 4, seed=0)  # B = 0: the LoRA layers are the base layers
        ext = (1.0 - mask.float())[:, None, None, :] * torch.finfo(torch.float32).min
        x = hidden
        for layer in model.layers:
            x = layer(x, attention_mask=ext)
    torch.testing.assert_close(x, full, rtol=0, atol=1e-5)


def test_only_lora_and_head_are_trainable(minilm):
    bert, _ = minilm
    model = L.build_member(bert, 4, seed=0)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(names) == 2 * 4 * 2 + 2
    assert all("lora_A" in n or "lora_B" in n or n.startswith("head.") for n in names)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == 2 * 4 * 2 * 384 * 4 + 384 * 3 + 3
    frozen = dict(model.named_parameters())["layers.0.attention.self.query.base_layer.weight"]
    assert not frozen.requires_grad  # a frozen parameter, not a buffer: no workaround needed
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if "lora_B" in n:
            assert torch.count_nonzero(p) == 0
        if "lora_A" in n:  # A ~ N(0, 1/d_in)
            assert abs(float(p.detach().std()) * math.sqrt(384) - 1) < 0.1
    again = L.build_member(bert, 4, seed=0)
    for (_, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q)


def test_discovered_geometry_lora_and_merged(minilm, tweets):
    bert, _ = minilm
    hidden, mask, y = _inputs(minilm, tweets)
    model = L.build_member(bert, 4, seed=1)
    with torch.no_grad():  # move off B = 0 so that the GL(r) blocks are full rank
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    sym = qm.models.discover(model, warn=False)
    blocks, fallbacks = sym.blocks, sym.fallbacks
    assert sorted((b.kind, b.heads, b.h) for b in blocks) == [("lora", 1, 4)] * 8
    attention = [f for f in fallbacks if f.kind.startswith("attention")]
    assert sorted({f.module for f in attention}) == [f"layers.{i}.attention.self" for i in (0, 1)]
    assert all("wrapped by LoRA" in f.reason for f in attention)
    merged = L.merge_lora(model)
    with torch.no_grad():
        torch.testing.assert_close(merged(hidden, mask), model(hidden, mask), rtol=1e-5,
                                   atol=1e-5)
    mblocks = qm.discover_blocks(merged, warn=False)
    assert sorted((b.kind, b.heads, b.h) for b in mblocks) == (
        [("attention.qk", 12, 32)] * 2 + [("attention.vo", 12, 32)] * 2)
    names = {n for n, p in merged.named_parameters() if p.requires_grad}
    assert "layers.0.attention.self.query.bias" in names
    assert "layers.0.attention.output.dense.bias" not in names
    # the GL(r) blocks are exact symmetries of the LoRA model
    moved = qm.reparametrize(model, a=3.0, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moved(hidden, mask), model(hidden, mask), rtol=1e-4,
                                   atol=1e-4)


def test_frozen_weights_are_not_perturbed(minilm):
    """The engine perturbs the parameters with requires_grad: the LoRA factors and the head."""
    bert, _ = minilm
    model = L.build_member(bert, 4, seed=2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    geo = qm.models.ModelGeometry(model, warn=False)
    in_blocks = sum(g.x0.numel() for g in geo.groups)
    assert in_blocks == 8 * (384 + 384) * 4  # G = B (384 × r), H = Aᵀ (384 × r)
    assert geo.w0.numel() == 384 * 3 + 3  # the head, adaptive geometry
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert in_blocks + geo.w0.numel() == trainable
    assert trainable < sum(p.numel() for p in model.parameters())  # frozen: no buffers trick
    merged = qm.models.ModelGeometry(L.merge_lora(model), warn=False)
    assert sum(g.x0.numel() for g in merged.groups) == 2 * 12 * (385 * 2 + 385 + 384) * 32
    assert merged.w0.numel() == 384 * 3 + 3


def test_population_sampler_fixed_and_noise_other_class():
    a, b = L.sample_population(), L.sample_population()
    assert a == b and len(a) == L.N_MEMBERS
    assert all(h["train_size"] >= L.N_SHARP for h in a)
    assert len({(h["train_size"], h["lr"], h["rank"], h["label_noise"]) for h in a}) > 4
    y = torch.arange(300) % 3
    noisy = L._noisy_labels(y, 0.3, seed=4)
    changed = noisy != y
    assert int(changed.sum()) == 90


def _check_results(res, out):
    d = out / "lora-minilm"
    on_disk = json.loads((d / "results.json").read_text())
    assert on_disk["n_members"] == res["n_members"] == L.QUICK["n_members"]
    for name in (*sharpness_suite.SUITE, *(f"{m}_merged" for m in L.MERGED_MEASURES)):
        m = on_disk["measures"][name]
        assert {"tau", "ci95", "p_value", "rho"} <= set(m)
        assert m["rho"] > 0
    for name in ("train_size", "lr", "rank", "label_noise"):
        assert name in on_disk["baselines"]
    for mem in on_disk["members"]:
        assert math.isfinite(mem["gap"]) and -1 <= mem["gap"] <= 1
        assert mem["gap"] == pytest.approx(mem["test_error"] - mem["train_error"])
        for name, vals in mem["measures"].items():
            assert all(math.isfinite(v) for v in vals.values()), name
    assert "vs_loss_gap" in on_disk
    assert (d / "scatter.png").stat().st_size > 0
    geo = on_disk["settings"]["geometry"]
    assert len(geo["lora"]["blocks"]) == 8 and len(geo["merged"]["blocks"]) == 4


@pytest.mark.slow
def test_quick_run_structure_and_resume(tmp_path, monkeypatch):
    res = L.run(tmp_path, quick=True, progress=False)
    _check_results(res, tmp_path)
    d = tmp_path / "lora-minilm"
    first = json.loads((d / "results.json").read_text())

    # interrupted run: one member's measures and another member's weights are missing
    ids = [m["id"] for m in first["members"]]
    (d / "measures" / f"{ids[0]}.json").unlink()
    (d / "members" / f"{ids[1]}.safetensors").unlink()
    trained, measured = [], []
    train, measure = L.train_member, sharpness_suite.measure_member

    def count_train(bert, hyper, data, **kw):
        trained.append(hyper["seed"])
        return train(bert, hyper, data, **kw)

    def count_measure(model, loss_fn, batches, **kw):
        before = {k for k, v in kw["cached"].items() if not k.startswith("_")}
        out = measure(model, loss_fn, batches, **kw)
        measured.append(len({k for k in out if not k.startswith("_")} - before))
        return out

    monkeypatch.setattr(L, "train_member", count_train)
    monkeypatch.setattr(L, "measure_member", count_measure)
    again = L.run(tmp_path, quick=True, progress=False)
    _check_results(again, tmp_path)
    assert trained == [1]
    # passes run member by member; member 0 re-measures everything; member 1 is retrained, and
    # saving a member drops its measures (they belong to the old weights), so it re-measures
    # everything too; member 2 nothing
    assert measured == [n for _, names, _ in L.PASSES for n in (len(names), len(names), 0)]
    for m0, m1 in zip(first["members"], again["members"]):
        assert m0["gap"] == m1["gap"]
