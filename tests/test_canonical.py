"""Canonical representatives (the fold families) and the full-group reparametrisation.

Every model is built tiny, in float64, with redrawn weights (N(0, 1/fan_in) matrices, gains
1 + N(0, 0.3²), biases N(0, 0.5²)): the 0.02 initialisation of Hugging Face makes attention
uniform and hides errors.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from collections import Counter

import pytest
import torch
from torch import nn

import quotient_manifolds as qm
from quotient_manifolds.models import prober as prober_module
from quotient_manifolds.models.blocks import FactorPart, gather_block
from quotient_manifolds.models.discovery import apply_folds, strip_frozen
from quotient_manifolds.models.discovery import find_folds as _find_folds
from quotient_manifolds.models.families import (
    KeyBiasFold,
    NormGainFold,
    QKNormScaleFold,
    ValueBiasFold,
)
from quotient_manifolds.models.inputs import cast_inputs, example_inputs
from quotient_manifolds.models.precision import float64_internals
from quotient_manifolds.models.records import PROBE_RTOL
from quotient_manifolds.models.reparam import transform_params
from quotient_manifolds.tree import tree_leaves

warnings.filterwarnings("ignore", message=".*eos_token_id.*|.*bos_token_id.*")

# this file checks the group of earlier releases, symmetry="full" (the complete group, the
# default, has its own tests: tests/test_complete_group.py)
find_folds = functools.partial(_find_folds, symmetry="full")
# peft 0.21 calls a transformers property deprecated in transformers 5
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


# -- tiny models ------------------------------------------------------------------------------
def redraw(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    conv1d = {f"{n}.weight" for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p.shape[0] if n in conv1d else p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
            elif n.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model.double().eval()


def _hf(cfg_name, model_name, **kw):
    import transformers

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = getattr(transformers, cfg_name)(**kw)
        return redraw(getattr(transformers, model_name)(cfg))


SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=50)


def gpt2(tied=True):
    return _hf("GPT2Config", "GPT2LMHeadModel", n_embd=16, n_layer=2, n_head=4, vocab_size=50,
               n_positions=16, tie_word_embeddings=tied, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0)


def llama(kv=2, bias=False):
    return _hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=kv, attention_bias=bias,
               tie_word_embeddings=False, **SMALL)


def bert():
    return _hf("BertConfig", "BertForSequenceClassification", hidden_size=16,
               num_hidden_layers=2, num_attention_heads=4, intermediate_size=32, vocab_size=50,
               max_position_embeddings=16, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)


def vit():
    return _hf("ViTConfig", "ViTForImageClassification", hidden_size=16, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=32, image_size=8, patch_size=4,
               num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def qwen3():
    return _hf("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=4,
               tie_word_embeddings=False, **SMALL)


def qwen2():
    return _hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2,
               tie_word_embeddings=False, **SMALL)


def gemma3():
    return _hf("Gemma3TextConfig", "Gemma3ForCausalLM", num_key_value_heads=2, head_dim=4,
               **SMALL)


def olmo2():
    return _hf("Olmo2Config", "Olmo2ForCausalLM", num_key_value_heads=2,
               tie_word_embeddings=False, **SMALL)


def whisper():
    return _hf("WhisperConfig", "WhisperForConditionalGeneration", d_model=16, encoder_layers=1,
               decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=6,
               max_target_positions=16, vocab_size=50, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, decoder_start_token_id=1)


def t5():
    return _hf("T5Config", "T5ForConditionalGeneration", d_model=16, d_kv=4, d_ff=32,
               num_layers=1, num_heads=4, vocab_size=50, dropout_rate=0.0,
               decoder_start_token_id=0)


def timm_vit():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return redraw(VisionTransformer(img_size=8, patch_size=4, in_chans=3, num_classes=3,
                                    embed_dim=16, depth=2, num_heads=4, mlp_ratio=2.0,
                                    qkv_bias=True))


def timm_qk_norm_vit():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return redraw(VisionTransformer(img_size=8, patch_size=4, in_chans=3, num_classes=3,
                                    embed_dim=16, depth=2, num_heads=4, mlp_ratio=2.0,
                                    qkv_bias=True, qk_norm=True))


def timm_beit():
    import timm

    torch.manual_seed(0)
    return redraw(timm.create_model("beit_base_patch16_224", pretrained=False, img_size=16,
                                    patch_size=8, embed_dim=16, depth=2, num_heads=4,
                                    num_classes=3))


def lora(build, targets):
    """A peft LoRA model (r = 2) on a redrawn base, with non-zero random adapters."""
    import peft

    model = peft.get_peft_model(build(), peft.LoraConfig(r=2, target_modules=targets,
                                                         lora_dropout=0.1))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model.double().eval()


class Encoder(nn.Module):
    """`nn.TransformerEncoder` (pre- or post-norm) with a final LayerNorm and a linear head."""

    def __init__(self, norm_first=True):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True,
                                           norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16),
                                         enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.enc(x))


def encoder(norm_first=True):
    torch.manual_seed(0)
    return redraw(Encoder(norm_first))


ENC_INPUT = ((torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(9)),), {})

# name -> (builder, example inputs or None, expected fold kinds, fallback modules)
ZOO = {
    "gpt2_tied": (gpt2, None, {"norm_gain": 4, "key_bias": 2, "value_bias": 2},
                  ["transformer.ln_f"]),
    "gpt2_untied": (lambda: gpt2(False), None, {"norm_gain": 5, "key_bias": 2, "value_bias": 2},
                    []),
    "llama_gqa": (llama, None, {"norm_gain": 5}, []),
    "llama_bias": (lambda: llama(4, True), None, {"norm_gain": 5, "value_bias": 2}, []),
    "bert": (bert, None, {"norm_gain": 1, "key_bias": 2, "value_bias": 2}, []),
    "vit": (vit, None, {"norm_gain": 5, "key_bias": 2, "value_bias": 2}, []),
    "qwen3": (qwen3, None, {"norm_gain": 5, "qk_norm": 2}, []),
    "olmo2": (olmo2, None, {"norm_gain": 1, "qk_norm": 2}, []),
    "gemma3": (gemma3, None, {"norm_gain": 4, "qk_norm": 2}, ["model.norm"]),
    "whisper": (whisper, None, {"norm_gain": 5, "value_bias": 3}, ["model.decoder.layer_norm"]),
    "t5": (t5, None, {"norm_gain": 5}, []),
    "timm_vit": (timm_vit, None, {"norm_gain": 5, "key_bias": 2, "value_bias": 2}, []),
    "encoder_prenorm": (encoder, ENC_INPUT, {"norm_gain": 5, "key_bias": 2, "value_bias": 2},
                        []),
    "timm_qk_norm": (timm_qk_norm_vit, None,
                     {"norm_gain": 5, "key_bias": 2, "value_bias": 2, "qk_norm": 2}, []),
    "timm_beit": (timm_beit, None, {"norm_gain": 5, "value_bias": 2}, []),
    "lora_llama": (lambda: lora(llama, ["q_proj", "v_proj"]), None, {"norm_gain": 5}, []),
    "lora_bert": (lambda: lora(bert, ["query", "value"]), None, {"norm_gain": 1}, []),
    "encoder_postnorm": (lambda: encoder(False), ENC_INPUT,
                         {"norm_gain": 1, "key_bias": 2, "value_bias": 2}, []),
}


def _inputs(model, ex):
    ex = ex if ex is not None else example_inputs(model, torch.Generator().manual_seed(1))
    return cast_inputs(ex, torch.float64)


def _outputs(model, ex):
    with torch.no_grad(), float64_internals():
        out = tree_leaves(model(*ex[0], **ex[1]),
                          skip_key=lambda k: "past" in str(k) or "cache" in str(k))
        return [t for t in out if t.is_floating_point()]


def _rel(a, b):
    return max(float((x - y).abs().max() / x.abs().max()) for x, y in zip(a, b, strict=True))


def _params(model):
    return {n: p.detach() for n, p in model.named_parameters()}


def _load(model, params):
    new = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in new.named_parameters():
            p.copy_(params[n])
    return new


_CACHE: dict = {}
FOLD_FALLBACKS = ("norm", "qk_norm", "folds")


def _symmetries(model, ex=None):
    """(blocks, folds, fold fallbacks) as `discover` finds them (blocks stripped of the frozen
    rows)."""
    sym = qm.models.discover(model, symmetry="full", warn=False, example_inputs=ex)
    return (list(sym.blocks), list(sym.folds),
            [f for f in sym.fallbacks if f.kind in FOLD_FALLBACKS])


def _paper_blocks(model):
    """The GL(h) blocks of the paper's measure, bias rows included."""
    return list(qm.models.discover(model, symmetry="paper", warn=False).blocks)


def _strip(blocks, frozen, params):
    """The blocks without their frozen parts (none may be dropped here)."""
    out, dropped = strip_frozen(blocks, frozen, params)
    assert not dropped, dropped
    return out


def _setup(name):
    """(model, inputs, blocks, folds, fallbacks) of a zoo entry, built once per session."""
    if name not in _CACHE:
        build, ex, _, _ = ZOO[name]
        model = build()
        blocks, folds, fallbacks = _symmetries(model, ex)
        _CACHE[name] = (model, _inputs(model, ex), blocks, folds, fallbacks)
    return _CACHE[name]


# -- discovery of the folds -------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ZOO))
def test_find_folds_finds_exactly_the_expected_folds(name):
    _, _, _, folds, fallbacks = _setup(name)
    expected = ZOO[name][2]
    assert dict(Counter(f.kind for f in folds)) == {k: v for k, v in expected.items() if v}
    assert [fb.module for fb in fallbacks] == ZOO[name][3]
    order = [type(f) for f in folds]
    assert order == sorted(order, key=[NormGainFold, KeyBiasFold, ValueBiasFold,
                                       QKNormScaleFold].index)


def test_post_norm_gets_no_layer_fold_and_tied_head_is_a_fallback():
    _, _, _, folds, _ = _setup("bert")
    # BERT is post-norm: only the last LayerNorm, read by the pooler alone, is a pre-norm
    assert [f.module for f in folds if f.kind == "norm_gain"] == [
        "bert.encoder.layer.1.output.LayerNorm"]
    _, _, _, _, fallbacks = _setup("gpt2_tied")
    assert "tied" in fallbacks[0].reason and fallbacks[0].kind == "norm"


def test_timm_separate_qkv_biases_and_qk_norm():
    _, _, _, folds, _ = _setup("timm_beit")  # F.linear(x, qkv.weight, cat(q_bias, 0, v_bias))
    norm = next(f for f in folds if f.module == "blocks.0.norm1")
    assert norm.shift == "fold"
    assert [(c.start, c.stop, c.bias, c.bias_start) for c in norm.consumers] == [
        (0, 16, "blocks.0.attn.q_bias", 0), (16, 32, None, None),
        (32, 48, "blocks.0.attn.v_bias", 0)]
    _, _, _, folds, _ = _setup("timm_qk_norm")  # LayerNorm q/k norms, no rotary embedding
    assert [f.layout for f in folds if isinstance(f, QKNormScaleFold)] == ["coordinate"] * 2
    assert {f.part.param for f in folds if isinstance(f, KeyBiasFold)} == {
        "blocks.0.attn.k_norm.bias", "blocks.1.attn.k_norm.bias"}


def test_lora_adapters_are_consumers():
    _, _, _, folds, _ = _setup("lora_llama")
    names = [c.weight for c in folds[0].consumers]
    assert any("q_proj.lora_A" in n for n in names) and any("q_proj.base_layer" in n
                                                             for n in names)


def test_shift_modes():
    _, _, _, folds, _ = _setup("gpt2_untied")
    modes = {f.module: f.shift for f in folds if isinstance(f, NormGainFold)}
    assert modes["transformer.h.0.ln_1"] == "fold"  # c_attn has a bias
    assert modes["transformer.ln_f"] == "scale"  # lm_head has none: β ← β/γ
    _, _, _, folds, _ = _setup("whisper")
    # k_proj has no bias, but its shift is dead under the softmax: β still folds
    enc = next(f for f in folds if f.module == "model.encoder.layers.0.self_attn_layer_norm")
    assert enc.shift == "fold"
    assert any(c.bias is None for c in enc.consumers)
    _, _, _, folds, _ = _setup("gemma3")  # Gemma's norms scale by 1 + w
    assert {f.offset for f in folds if isinstance(f, NormGainFold)} == {1.0}
    assert {(f.q_offset, f.k_offset) for f in folds if isinstance(f, QKNormScaleFold)} == {
        (1.0, 1.0)}


# -- the canonical point ----------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ZOO))
def test_canonical_point_preserves_function_and_is_idempotent(name):
    model, ex, _, folds, _ = _setup(name)
    P = {n: t.clone() for n, t in _params(model).items()}
    can, frozen = apply_folds(folds, P)
    assert _rel(_outputs(model, ex), _outputs(_load(model, can), ex)) <= PROBE_RTOL
    can2, frozen2 = apply_folds(folds, can)
    for n in P:
        torch.testing.assert_close(can2[n], can[n], rtol=1e-13, atol=1e-14)
    assert frozen.keys() == frozen2.keys()
    for n, m in frozen.items():
        assert m.shape == P[n].shape and m.dtype == torch.bool and bool(m.any())
    for f in folds:  # frozen entries sit at their canonical value
        if isinstance(f, NormGainFold):
            assert bool((can[f.weight] + f.offset == 1).all())
            if f.shift == "fold":
                assert bool((can[f.bias] == 0).all())
        if isinstance(f, (KeyBiasFold, ValueBiasFold)):
            assert bool((can[f.part.param][frozen[f.part.param]] == 0).all())
    for n, p in model.named_parameters():  # pure: neither the dict nor the model changes
        assert torch.equal(p.detach(), P[n])


@pytest.mark.parametrize("name", list(ZOO))
def test_canonical_point_is_invariant_under_the_fold_groups(name):
    model, ex, _, folds, _ = _setup(name)
    P = _params(model)
    can = apply_folds(folds, P)[0]
    for a, seed in ((1e-2, 1), (1.0, 2), (1e2, 3)):
        moved = transform_params(P, [], folds, a=a, generator=torch.Generator().manual_seed(seed))
        assert _rel(_outputs(model, ex), _outputs(_load(model, moved), ex)) <= PROBE_RTOL
        can_m = apply_folds(folds, moved)[0]
        for n in P:
            scale = float(can[n].abs().max()) or 1.0
            assert float((can_m[n] - can[n]).abs().max()) <= 1e-12 * scale, (n, a)


@pytest.mark.parametrize("name", list(ZOO))
def test_reparametrize_full_group(name):
    """Output unchanged ≤ 1e-10; canonical points equal modulo the blocks' GL action; every
    parameter a fold acts on is changed (the self-test exercises every claimed symmetry)."""
    model, ex, blocks, folds, _ = _setup(name)
    P = _params(model)
    can, frozen = apply_folds(folds, P)
    stripped = _strip(blocks, frozen, can)
    for a, seed in ((1e-2, 4), (1.0, 5), (1e2, 6)):
        moved = qm.reparametrize(model, symmetry="full", a=a,
                                 generator=torch.Generator().manual_seed(seed),
                                 example_inputs=ZOO[name][1])
        assert _rel(_outputs(model, ex), _outputs(moved, ex)) <= PROBE_RTOL
        Pm = _params(moved)
        for f in folds:
            for n in f.params:
                assert not torch.equal(Pm[n], P[n]), (f.kind, n)
        can_m = apply_folds(folds, Pm)[0]
        claimed = set()
        for b in stripped:  # G Hᵀ per head is the GL invariant of a block
            x, y = gather_block(b, can), gather_block(b, can_m)
            gh = x[:, : b.n] @ x[:, b.n :].mT
            gh_m = y[:, : b.n] @ y[:, b.n :].mT
            assert float((gh - gh_m).abs().max()) <= 1e-10 * float(gh.abs().max())
            claimed.update(b.params)
        for n in P:  # entries outside every block are equal at the canonical points
            if n not in claimed:
                scale = float(can[n].abs().max()) or 1.0
                assert float((can_m[n] - can[n]).abs().max()) <= 1e-11 * scale, (n, a)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), P[n])


def test_reparametrize_leaves_model_untouched_and_rejects_bad_symmetry():
    model, ex, _, _, _ = _setup("vit")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    qm.reparametrize(model, symmetry="full", a=3.0)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    with pytest.raises(ValueError, match="symmetry"):
        qm.reparametrize(model, symmetry="everything")


def test_paper_reparametrize_moves_only_the_blocks():
    model = _setup("vit")[0]
    blocks = _paper_blocks(model)
    moved = _params(qm.reparametrize(model, a=2.0, symmetry="paper",
                                     generator=torch.Generator().manual_seed(0)))
    P = _params(model)
    claimed = {n for b in blocks for n in b.params}
    for n in P:
        assert torch.equal(moved[n], P[n]) == (n not in claimed), n


# -- independent constructions of the symmetries -------------------------------------------------
def test_independent_norm_gain_and_bias_symmetries_gpt2():
    """Hand-written group elements (not Fold.act) leave the function and the canonical point."""
    model, ex, blocks, folds, _ = _setup("gpt2_untied")
    P = _params(model)
    g = torch.Generator().manual_seed(0)
    new = dict(P)
    c = torch.rand(16, generator=g, dtype=torch.float64) * 4 - 2  # signs and magnitudes
    t = torch.randn(16, generator=g, dtype=torch.float64)
    pre = "transformer.h.0."
    new[pre + "ln_1.weight"] = c * P[pre + "ln_1.weight"]
    new[pre + "ln_1.bias"] = c * P[pre + "ln_1.bias"] + t
    W = P[pre + "attn.c_attn.weight"] / c[:, None]  # Conv1D: (in, out)
    new[pre + "attn.c_attn.weight"] = W
    new[pre + "attn.c_attn.bias"] = P[pre + "attn.c_attn.bias"] - t @ W
    assert _rel(_outputs(model, ex), _outputs(_load(model, new), ex)) <= 1e-12
    can, can_new = apply_folds(folds, P)[0], apply_folds(folds, new)[0]
    for n in P:
        torch.testing.assert_close(can_new[n], can[n], rtol=1e-12, atol=1e-13)
    bad = dict(P)  # the final norm with an untied head has no shift symmetry (no head bias)
    bad["transformer.ln_f.bias"] = P["transformer.ln_f.bias"] + t
    assert _rel(_outputs(model, ex), _outputs(_load(model, bad), ex)) > 1e-3


def test_independent_bias_translations_bert():
    model, ex, blocks, folds, _ = _setup("bert")
    P = _params(model)
    g = torch.Generator().manual_seed(1)
    pre = "bert.encoder.layer.0.attention."
    t = torch.randn(16, generator=g, dtype=torch.float64)
    new = dict(P)
    new[pre + "self.key.bias"] = P[pre + "self.key.bias"] + t  # dead under the softmax
    new[pre + "self.value.bias"] = P[pre + "self.value.bias"] + t
    new[pre + "output.dense.bias"] = P[pre + "output.dense.bias"] - P[
        pre + "output.dense.weight"] @ t
    assert _rel(_outputs(model, ex), _outputs(_load(model, new), ex)) <= 1e-12
    can, can_new = apply_folds(folds, P)[0], apply_folds(folds, new)[0]
    for n in P:
        torch.testing.assert_close(can_new[n], can[n], rtol=1e-12, atol=1e-13)
    bad = dict(P)  # the query bias is not dead
    bad[pre + "self.query.bias"] = P[pre + "self.query.bias"] + t
    assert _rel(_outputs(model, ex), _outputs(_load(model, bad), ex)) > 1e-3


def test_rope_keeps_the_key_bias_alive():
    """Qwen2 has q/k/v biases and rotary embeddings: a key-bias shift changes the output,
    so no key-bias fold is claimed."""
    model = qwen2()
    _, folds, _ = _symmetries(model)
    assert not any(isinstance(f, KeyBiasFold) for f in folds)
    ex = _inputs(model, None)
    P = _params(model)
    bad = dict(P)
    name = "model.layers.0.self_attn.k_proj.bias"
    bad[name] = P[name] + torch.randn(P[name].shape, generator=torch.Generator().manual_seed(0))
    assert _rel(_outputs(model, ex), _outputs(_load(model, bad), ex)) > 1e-3


def test_qk_norm_group():
    """Qwen3: the q/k-norm gains scale per rotary pair (not per coordinate), and a per-head
    scaling of W_q before the RMS norm is exact only for ε = 0."""
    model, ex, _, folds, _ = _setup("qwen3")
    qk = [f for f in folds if isinstance(f, QKNormScaleFold)]
    assert [f.layout for f in qk] == ["rotate_half(r=4)"] * 2
    P = _params(model)
    attn = "model.layers.0.self_attn."
    g = torch.Generator().manual_seed(0)
    c = torch.exp(torch.randn(4, generator=g, dtype=torch.float64))
    coord = dict(P)  # per-coordinate scaling breaks under RoPE
    coord[attn + "q_norm.weight"] = c * P[attn + "q_norm.weight"]
    coord[attn + "k_norm.weight"] = P[attn + "k_norm.weight"] / c
    assert _rel(_outputs(model, ex), _outputs(_load(model, coord), ex)) > 1e-4
    pair = dict(P)  # rotate-half pairs (j, j + 2) share one factor
    cp = torch.cat([c[:2], c[:2]])
    pair[attn + "q_norm.weight"] = cp * P[attn + "q_norm.weight"]
    pair[attn + "k_norm.weight"] = P[attn + "k_norm.weight"] / cp
    assert _rel(_outputs(model, ex), _outputs(_load(model, pair), ex)) <= 1e-12
    heads = dict(P)  # per-head scaling of W_q rows before the RMS norm
    s = torch.tensor([0.5, 2.0, 3.0, 0.25], dtype=torch.float64).repeat_interleave(4)
    heads[attn + "q_proj.weight"] = s[:, None] * P[attn + "q_proj.weight"]
    # Hugging Face's RMSNorm normalises in float32; use a float64 one to see the ε effect alone
    changes = {}
    for eps in (1e-6, 0.0):
        m64 = copy.deepcopy(model)
        for layer in m64.model.layers:
            for side in ("q_norm", "k_norm"):
                old = getattr(layer.self_attn, side)
                new = nn.RMSNorm(4, eps=eps).double()
                new.weight.data.copy_(old.weight.data)
                setattr(layer.self_attn, side, new)
        changes[eps] = _rel(_outputs(m64, ex), _outputs(_load(m64, heads), ex))
    assert changes[1e-6] > 1e-10  # inexact through ε: not claimed
    assert changes[0.0] <= 1e-12


def test_zero_gains_fold_exactly():
    model = copy.deepcopy(_setup("timm_vit")[0])
    with torch.no_grad():
        model.blocks[0].norm1.weight[:3] = 0.0
    _, folds, _ = _symmetries(model)
    assert any(f.module == "blocks.0.norm1" and f.shift == "fold" for f in folds)
    ex = _inputs(model, None)
    can = apply_folds(folds, _params(model))[0]
    assert _rel(_outputs(model, ex), _outputs(_load(model, can), ex)) <= PROBE_RTOL


def test_no_example_input_is_a_fallback():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin = nn.LayerNorm(4), nn.Linear(4, 4)

        def forward(self, x, y):
            return self.lin(self.norm(x)) + y

    folds, fallbacks = find_folds(TwoInputs(), [])
    assert folds == [] and "example_inputs=" in fallbacks[0].reason


def test_nothing_to_fold_needs_no_example_input():
    """No norm layer and no bias row in a block: no fold can exist, so a model without a known
    input gets no fold fallback (and no warning); with a bias row it does."""

    class NoBias(nn.Module):
        def __init__(self, bias):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, bias=bias, batch_first=True)

        def forward(self, x, y):
            return self.attn(x, y, y)[0]

    for bias in (False, True):
        model = NoBias(bias).double()
        blocks = qm.discover_blocks(model, symmetry="paper", probe=False)
        assert len(blocks) == 2
        folds, fallbacks = find_folds(model, blocks)
        assert folds == [] and len(fallbacks) == int(bias)


def test_no_comparable_output_is_a_fallback():
    """A probe needs finite floating-point outputs: without them nothing is claimed."""

    class Silent(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin = nn.LayerNorm(4), nn.Linear(4, 4)

        def forward(self, x):
            self.lin(self.norm(x))
            return None

    x = torch.randn(2, 4)
    folds, fallbacks = find_folds(Silent(), [], example_inputs=x)  # a bare tensor is an input
    assert folds == [] and "floating-point" in fallbacks[0].reason
    folds, fallbacks = find_folds(Silent(), [], example_inputs=torch.randn(2, 3))
    assert folds == [] and "failed on the example input" in fallbacks[0].reason
    nan = torch.full((1, 2, 16), float("nan"))
    folds, fallbacks = find_folds(encoder(), [], example_inputs=((nan,), {}))
    assert folds == [] and "non-finite" in fallbacks[0].reason


# -- stripping frozen rows from the blocks -------------------------------------------------------
def test_strip_frozen_removes_the_key_and_value_bias_rows():
    model, _, _, folds, _ = _setup("encoder_prenorm")
    blocks = _paper_blocks(model)  # nn.MultiheadAttention: the same blocks, bias rows in
    P = _params(model)
    can, frozen = apply_folds(folds, P)
    stripped = _strip(blocks, frozen, can)
    for b, s in zip(blocks, stripped, strict=True):
        if b.kind == "attention.qk":
            assert (s.n, s.m) == (b.n, b.m - 1)  # the query bias stays, the key bias goes
        else:
            assert (s.n, s.m) == (b.n - 1, b.m)
        assert all(p.param != "enc.layers.0.self_attn.in_proj_bias" or p.offset == 0
                   for p in s.G + s.H if s.kind == "attention.qk")
    half = {"enc.layers.0.self_attn.in_proj_bias": torch.zeros(48, dtype=torch.bool)}
    half["enc.layers.0.self_attn.in_proj_bias"][16:20] = True
    kept, dropped = strip_frozen(blocks, half, P)  # a partly frozen part: its block is dropped
    hit = ("enc.layers.0.self_attn", "attention.qk")
    assert [(f.module, f.kind) for f in dropped] == [hit]
    assert "part is not" in dropped[0].reason
    assert kept == [b for b in blocks if (b.module, b.kind) != hit]


def test_fold_records_are_hashable_and_describe_themselves():
    _, _, _, folds, _ = _setup("vit")
    assert len(set(folds)) == len(folds)
    kinds = {f.describe()["kind"] for f in folds}
    assert kinds == {"norm_gain", "key_bias", "value_bias"}
    kb = KeyBiasFold("m", FactorPart("b", "bias", 4), heads=2, h=2)
    assert kb.describe()["part"] == ("b", "bias", 4)


# -- the measures at the canonical point -----------------------------------------------------------
def _loss_cls(model, batch):
    out = model(batch[0])
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(logits, batch[1])


def _data(name):
    g = torch.Generator().manual_seed(0)
    if name == "bert":
        return [(torch.randint(0, 50, (3, 6), generator=g), torch.randint(0, 2, (3,),
                                                                            generator=g))]
    return [(torch.randn(3, 3, 8, 8, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (3,), generator=g))]


@pytest.mark.parametrize("name", ["bert", "timm_vit", "gpt2_untied", "llama_gqa", "qwen3"])
@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_full_measure_invariant_paper_measure_moves(name, metric):
    """Through the public API: geodesic-…-full is invariant under `reparametrize` (full group);
    the paper's measure moves under norm-gain and bias moves wherever its GL(h) blocks read
    the moved weights (Llama and Qwen3 have none in the paper's measure: their adaptive
    geometry is invariant under the diagonal gain scalings, and they have no biases)."""
    model, ex, blocks, folds, _ = _setup(name)
    if name in ("gpt2_untied", "llama_gqa", "qwen3"):
        data = [torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))]

        def loss(m, b):  # in float64: the models' own `labels=` loss upcasts to float32 only
            logits = m(input_ids=b).logits[:, :-1]
            return nn.functional.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten())
    else:
        data, loss = _data(name), _loss_cls
    kw = dict(rho=0.1, n_iter=5)
    full = qm.Geometry(metric=metric, symmetry="full")
    paper = qm.Geometry(metric=metric, symmetry="paper")
    with warnings.catch_warnings():  # the expected fallbacks (rotary, grouped heads, q/k norm)
        warnings.simplefilter("ignore", qm.SymmetryFallbackWarning)
        warnings.simplefilter("ignore", qm.NoBlocksWarning)
        ref = qm.geodesic_sharpness(model, loss, data, geometry=full, **kw).value
        ref_p = qm.geodesic_sharpness(model, loss, data, geometry=paper, **kw).value
        moves = []
        for a, seed in ((1e-2, 1), (1e2, 2)):
            moved = qm.reparametrize(model, symmetry="full", a=a,
                                     generator=torch.Generator().manual_seed(seed))
            v = qm.geodesic_sharpness(moved, loss, data, geometry=full, **kw).value
            assert abs(v / ref - 1) <= 1e-6, (a, v, ref)
            folded = _load(model, transform_params(_params(model), [], folds, a=a,
                                                   generator=torch.Generator().manual_seed(seed)))
            vp = qm.geodesic_sharpness(folded, loss, data, geometry=paper, **kw).value
            moves.append(abs(vp / ref_p - 1))
    if _paper_blocks(model):
        assert max(moves) > 1e-2
    else:
        assert max(moves) < 1e-10


def test_gqa_value_bias_folds_through_every_output_block():
    """Llama with 4 query heads sharing 2 K/V heads and biases: a V/O block per K/V head whose
    H stacks the output blocks of its 2 query heads (declared here); the value bias folds
    through both, and a GL element shared by the group is a symmetry."""
    model = llama(kv=2, bias=True)
    h, r = 4, 2
    blocks = []
    for layer in range(2):
        pre = f"model.layers.{layer}.self_attn."
        for g in range(2):
            blocks.append(qm.declare_block(
                G=[(pre + "v_proj.weight", "rows", g * h), (pre + "v_proj.bias", "bias", g * h)],
                H=[(pre + "o_proj.weight", "cols", (g * r + j) * h) for j in range(r)],
                heads=1, h=h, kind="attention.vo", module=pre[:-1]))
    params = dict(model.named_parameters())
    blocks = [b.resolved(params) for b in blocks]
    folds, _ = find_folds(model, blocks)
    vb = [f for f in folds if isinstance(f, ValueBiasFold)]
    assert len(vb) == 4 and all(len(f.out) == 2 for f in vb)
    ex = _inputs(model, None)
    P = _params(model)
    can, frozen = apply_folds(folds, P)
    assert _rel(_outputs(model, ex), _outputs(_load(model, can), ex)) <= PROBE_RTOL
    assert bool((can["model.layers.0.self_attn.v_proj.bias"] == 0).all())
    for seed in (0, 1):
        moved = qm.reparametrize(model, symmetry="full", a=3.0,
                                 generator=torch.Generator().manual_seed(seed), blocks=blocks)
        assert _rel(_outputs(model, ex), _outputs(moved, ex)) <= PROBE_RTOL
        can_m = apply_folds(folds, _params(moved))[0]
        for b in _strip(blocks, frozen, can):
            x, y = gather_block(b, can), gather_block(b, can_m)
            torch.testing.assert_close(x[:, : b.n] @ x[:, b.n :].mT,
                                       y[:, : b.n] @ y[:, b.n :].mT, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(can_m["model.layers.1.self_attn.o_proj.bias"],
                                   can["model.layers.1.self_attn.o_proj.bias"],
                                   rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["timm_vit", "whisper"])
def test_transform_with_stripped_blocks_moves_the_value_bias_along(name):
    """Blocks stripped for the canonical point lack the value-bias row; the GL action must still
    move it (else the output shifts by W_O (Aᵀ − I) b_V): `transform_params` puts it back."""
    model, ex, _, folds, _ = _setup(name)
    blocks = _paper_blocks(model)  # no rotary or grouped heads here: the blocks, bias rows in
    P = _params(model)
    can, frozen = apply_folds(folds, P)
    stripped = _strip(blocks, frozen, can)
    assert stripped != blocks
    moved = transform_params(P, stripped, folds, a=2.0, generator=torch.Generator().manual_seed(0))
    assert _rel(_outputs(model, ex), _outputs(_load(model, moved), ex)) <= PROBE_RTOL


def test_folds_are_probed_on_two_rows_of_the_example_input(monkeypatch):
    """The fold probes run the model on the first rows of a batched example input; the folds
    are those found on the whole input."""
    model = encoder()
    big = ((torch.randn(9, 5, 16, generator=torch.Generator().manual_seed(2)),), {})
    blocks = _paper_blocks(model)
    prober = prober_module.Prober(model, big)
    assert prober.args[0].shape == (prober_module.PROBE_ROWS, 5, 16)
    cut = find_folds(model, blocks, example_inputs=big)
    monkeypatch.setattr(prober_module, "PROBE_ROWS", 10**6)
    whole = find_folds(model, blocks, example_inputs=big)
    assert [f.describe() for f in cut[0]] == [f.describe() for f in whole[0]]
    assert dict(Counter(f.kind for f in cut[0])) == ZOO["encoder_prenorm"][2]


def test_fold_probes_use_the_whole_input_if_dim_0_is_not_a_batch():
    """A sequence-first model with a positional table of the sequence length fails on cut
    rows: the probes fall back to the whole input and find the fold."""

    class SeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(1)
            self.pos = nn.Parameter(torch.randn(6, 1, 4, generator=g))
            self.norm, self.lin = nn.LayerNorm(4), nn.Linear(4, 3)
            with torch.no_grad():
                self.norm.weight.copy_(1 + torch.rand(4, generator=g))

        def forward(self, x):  # (L, N, 4)
            return self.lin(self.norm(x + self.pos))

    model = SeqFirst().double()
    ex = ((torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(3)),), {})
    assert prober_module.Prober(model, ex).args[0].shape == (6, 3, 4)
    folds, fallbacks = find_folds(model, [], example_inputs=ex)
    assert [f.kind for f in folds] == ["norm_gain"] and not fallbacks
