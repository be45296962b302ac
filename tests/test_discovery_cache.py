"""Discovery once: repeated sharpness calls on one model discover once (the discovery cache),
and every change that could change discovery's result misses."""

from __future__ import annotations

import gc
import logging
import warnings
import weakref

import pytest
import torch
from model_zoo import bert_data, hf_loss, redraw_, small_bert

import quotient_manifolds as qm
from quotient_manifolds.models.cache import DiscoveryCache, weights_fingerprint
from quotient_manifolds.state import fingerprint

LOGGER = "quotient_manifolds.discovery"


@pytest.fixture(autouse=True)
def _fresh_cache():
    qm.discovery_cache.clear()
    yield
    qm.discovery_cache.clear()


def _bert(seed=0):
    return redraw_(small_bert(seed=seed).double().eval(), seed=seed)


def _counts(caplog) -> tuple[int, int]:
    msgs = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    return (sum(m.startswith("discovered") for m in msgs),
            sum(m.startswith("cache hit") for m in msgs))


def test_a_rho_sweep_discovers_once(caplog):
    model, data = _bert(), bert_data(n_batches=1)
    caplog.set_level(logging.INFO, logger=LOGGER)
    values = [qm.geodesic_sharpness(model, hf_loss, data, rho=rho, n_iter=2).value
              for rho in (0.01, 0.03, 0.1)]
    assert _counts(caplog) == (1, 2)
    assert qm.discovery_cache.hits == 2 and qm.discovery_cache.misses == 1
    assert len(set(values)) == 3
    # and the cached calls measure what uncached calls measure, bit for bit
    with qm.discovery_cache.disabled():
        fresh = qm.geodesic_sharpness(model, hf_loss, data, rho=0.1, n_iter=2).value
    assert fresh == values[2]
    assert _counts(caplog) == (2, 2)


def test_the_cached_result_equals_a_fresh_discovery():
    model, data = _bert(), bert_data()
    for symmetry in ("complete", "full", "paper"):
        g = qm.Geometry(symmetry=symmetry)
        first = qm.symmetries_of(model, hf_loss, data, geometry=g)
        hit = qm.symmetries_of(model, hf_loss, data, geometry=g)
        assert hit is first
        with qm.discovery_cache.disabled():
            fresh = qm.symmetries_of(model, hf_loss, data, geometry=g)
        assert fresh is not first
        assert fresh.to_dict() == first.to_dict() and fresh.folds == first.folds
        assert fresh.blocks and (symmetry == "paper") == (not fresh.folds)
    assert qm.discovery_cache.hits == 3 and qm.discovery_cache.misses == 6  # 3 uncached


def _swap_rows(p: torch.Tensor) -> None:
    with torch.no_grad():
        p.data[[0, 1]] = p.data[[1, 0]].clone()  # through .data: no version bump


@pytest.mark.parametrize("change", [
    "optimizer step", "write through .data", "swap two rows", "layer norm eps",
    "replaced activation", "other symmetry", "other batch", "new family registered",
])
def test_a_change_misses(change, monkeypatch):
    model, data = _bert(), bert_data()
    g = qm.Geometry()
    cache = qm.discovery_cache
    first = qm.symmetries_of(model, hf_loss, data, geometry=g)
    qm.symmetries_of(model, hf_loss, data, geometry=g)
    assert (cache.hits, cache.misses) == (1, 1)
    w = model.bert.encoder.layer[0].attention.self.query.weight
    if change == "optimizer step":
        with torch.no_grad():
            w.add_(1e-12 * torch.ones_like(w))
    elif change == "write through .data":
        v = w._version
        w.data[0, 0] += 1e-3
        assert w._version == v  # the version counter does not see it: the fingerprint does
    elif change == "swap two rows":
        before = fingerprint(w)
        _swap_rows(w)
        assert fingerprint(w) == before  # the sums of w and w² do not see it
    elif change == "layer norm eps":
        model.bert.encoder.layer[1].output.LayerNorm.eps = 1e-5
    elif change == "replaced activation":
        model.bert.encoder.layer[1].intermediate.intermediate_act_fn = torch.nn.Tanh()
    elif change == "other symmetry":
        g = qm.Geometry(symmetry="paper")
    elif change == "other batch":
        data = bert_data(seed=1)
    elif change == "new family registered":
        fams = list(qm.models.discovery.FAMILIES)  # a copy, what discover reads until undone
        monkeypatch.setattr(qm.models.discovery, "FAMILIES", fams)
        fams.append(type(fams[0])())
    again = qm.symmetries_of(model, hf_loss, data, geometry=g)
    assert (cache.hits, cache.misses) == (1, 2)
    assert again is not first


def test_the_loss_is_part_of_the_key_for_the_complete_group_only():
    model, data = _bert(), bert_data()

    def other_loss(m, b):  # the same inputs, another loss: MSE on the logits, no softmax shift
        return (m(**b).logits ** 2).mean()

    def make():  # a new function object each time, with the same code and closure
        return lambda m, b: m(**b).loss

    cache, complete = qm.discovery_cache, qm.Geometry(symmetry="complete")
    ce = qm.symmetries_of(model, hf_loss, data, geometry=complete)
    mse = qm.symmetries_of(model, other_loss, data, geometry=complete)
    assert mse is not ce
    # the two losses give different results, so a shared entry would be stale
    assert "softmax_shift" in {f.kind for f in ce.folds} - {f.kind for f in mse.folds}
    first = qm.symmetries_of(model, make(), data, geometry=complete)
    assert first is not ce  # another function: its code is not hf_loss's
    assert qm.symmetries_of(model, make(), data, geometry=complete) is first
    assert (cache.hits, cache.misses) == (1, 3)
    full = qm.Geometry(symmetry="full")
    sym_full = qm.symmetries_of(model, hf_loss, data, geometry=full)
    assert qm.symmetries_of(model, other_loss, data, geometry=full) is sym_full  # no loss read
    assert (cache.hits, cache.misses) == (2, 4)


def test_the_cache_keeps_no_model_alive_and_is_bounded():
    cache = DiscoveryCache(maxsize=2)
    models = [_bert(seed=s) for s in range(3)]
    x = {k: v for k, v in bert_data()[0].items() if k != "labels"}
    syms = [cache.discover(m, example_inputs=x, warn=False) for m in models]
    assert len(cache) == 2 and cache.misses == 3
    assert cache.discover(models[2], example_inputs=x) is syms[2]
    ref = weakref.ref(models[2])
    del models[2], syms
    gc.collect()
    assert ref() is None and len(cache) == 1
    cache.clear()
    assert len(cache) == 0 and cache.hits == cache.misses == 0


def test_a_hit_warns_as_a_fresh_discovery_does():
    from timm.layers import Attention

    attn = Attention(16, num_heads=2, qkv_bias=True, qk_norm=True, norm_layer=torch.nn.LayerNorm)
    cache = DiscoveryCache()
    with pytest.warns(qm.SymmetryFallbackWarning, match="q/k normalisation") as first:
        sym = cache.discover(attn, symmetry="paper")
    with pytest.warns(qm.SymmetryFallbackWarning, match="q/k normalisation") as again:
        assert cache.discover(attn, symmetry="paper") is sym
    assert cache.hits == 1
    assert [str(w.message) for w in again] == [str(w.message) for w in first]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.discover(attn, symmetry="paper", warn=False) is sym  # silent


def test_the_weights_fingerprint(monkeypatch):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3, 5, generator=g, dtype=torch.float32)
    s, q, w = weights_fingerprint(t)
    d = t.double().reshape(-1)
    c = torch.frac(torch.arange(1, 16, dtype=torch.float64) * (5 ** 0.5 - 1) / 2)
    assert (s, q) == pytest.approx((float(d.sum()), float((d * d).sum())), rel=1e-14)
    assert w == pytest.approx(float((d * c).sum()), rel=1e-14)
    p = t.clone()
    p[[0, 1]] = p[[1, 0]]
    assert weights_fingerprint(p)[:2] == pytest.approx((s, q), rel=1e-14)
    assert abs(weights_fingerprint(p)[2] - w) > 1e-6
    # across chunks: c_{kC + j} = k + {(j + 1) phi}
    monkeypatch.setattr(qm.models.cache, "_CHUNK", 4)
    monkeypatch.setattr(qm.models.cache, "_WEYL", {})
    k = torch.arange(15, dtype=torch.float64) // 4
    cc = k + torch.frac((torch.arange(15, dtype=torch.float64) % 4 + 1) * (5 ** 0.5 - 1) / 2)
    assert weights_fingerprint(t)[2] == pytest.approx(float((d * cc).sum()), rel=1e-14)
    z = torch.zeros(2, dtype=torch.complex128)
    assert weights_fingerprint(z) == (0.0, 0.0, 0.0)
    assert weights_fingerprint(torch.zeros(0)) == (0.0, 0.0, 0.0)
