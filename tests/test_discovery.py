"""Discovery on real architectures: every head found, every claim probed, and the claimed
groups checked against an independent construction written here (per-layout index arithmetic
on the weights, not the library's gather/scatter)."""

from __future__ import annotations

import copy
import functools
import math
import re
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_zoo import ZOO
from torch import nn

import quotient_manifolds as qm
from quotient_manifolds.geometry.subgroup import RotaryCommutant
from quotient_manifolds.models import discovery as disc
from quotient_manifolds.models import example_inputs, rope_pairs
from quotient_manifolds.models.blocks import FactorPart
from quotient_manifolds.models.families import attention_layouts as layouts

torch.set_num_threads(1)


@functools.cache
def _model(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ZOO[name]()


@functools.cache
def _sym(name, symmetry="full"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qm.discover(_model(name), symmetry=symmetry)


def _floats(out):
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _floats(o)]
    return []


def _forward(model, inputs):
    args, kwargs = inputs
    with torch.no_grad():
        return torch.cat([t.reshape(-1) for t in _floats(model(*args, **kwargs))])


# -- the independent construction ----------------------------------------------------------
#
# A projection produces features y = x Wᵀ + b (nn.Linear, features on weight axis 0) or
# y = x W + b (Conv1D, axis 1); head i owns the features idx(i). The map f_i -> f_i M of a
# head's features is W[idx] <- Mᵀ W[idx] (axis 0) or W[:, idx] <- W[:, idx] M (axis 1), and
# b[idx] <- b[idx] M. A consumer of the features (the output projection, input axis 1 for
# nn.Linear, 0 for Conv1D) compensates with M⁻¹.


class Proj:
    def __init__(self, weight, axis, idx, bias=None, bias_idx=None):
        self.weight, self.axis, self.idx = weight, axis, idx
        self.bias, self.bias_idx = bias, bias_idx or idx


def _lin(mod, idx, bias_idx=None):
    """An nn.Linear (features on axis 0) or a Conv1D (axis 1)."""
    axis = 1 if type(mod).__name__ == "Conv1D" else 0
    return Proj(mod.weight, axis, idx, mod.bias, bias_idx)


def _contig(h, off=0):
    return lambda i: torch.arange(off + i * h, off + (i + 1) * h)


def _produce(p: Proj, i, M):
    W, ix = p.weight.data, p.idx(i)
    if p.axis == 0:
        W[ix] = M.T @ W[ix]
    else:
        W[:, ix] = W[:, ix] @ M
    if p.bias is not None:
        bx = p.bias_idx(i)
        p.bias.data[bx] = p.bias.data[bx] @ M


def _consume(p: Proj, i, M):
    """`p` described as a producer (axis of its output features); it consumes on the other."""
    W, ix, Minv = p.weight.data, p.idx(i), torch.linalg.inv(M)
    if p.axis == 0:  # nn.Linear: input features are the columns
        W[:, ix] = W[:, ix] @ Minv.T
    else:  # Conv1D: input features are the rows
        W[ix] = Minv @ W[ix]


class Att:
    """What the test expects of one attention module, and how its weights are laid out."""

    def __init__(self, module, heads, kv, h, q, k, v, o, *, pairs=None, qk=True, vo=True):
        self.module, self.heads, self.kv, self.h = module, heads, kv, h
        self.q, self.k, self.v, self.o = q, k, v, o
        self.pairs, self.qk, self.vo = pairs, qk, vo


def _element(h, pairs, gen, full=False):
    """A random element of GL(h) (full=True or pairs None) or of the rotary commutant,
    built entry by entry."""
    if full or pairs is None:
        return torch.eye(h, dtype=torch.float64) + 0.3 * torch.randn(
            h, h, generator=gen, dtype=torch.float64) / math.sqrt(h)
    M = torch.zeros(h, h, dtype=torch.float64)
    used = set()
    for p, q in pairs:
        a = 1 + 0.3 * torch.randn((), generator=gen, dtype=torch.float64)
        b = 0.5 * torch.randn((), generator=gen, dtype=torch.float64)
        M[p, p] = M[q, q] = a
        M[p, q], M[q, p] = -b, b
        used |= {p, q}
    free = [i for i in range(h) if i not in used]
    if free:
        f = torch.tensor(free)
        M[f[:, None], f[None, :]] = torch.eye(len(free), dtype=torch.float64) + 0.3 * torch.randn(
            len(free), len(free), generator=gen, dtype=torch.float64) / math.sqrt(len(free))
    return M


def _transform(model, atts, loras, gen, *, full_qk=False, one_sided=False):
    """A deep copy with a random element of every expected group applied, by hand
    (`one_sided`: without the compensating factor, a control that must change the output)."""
    new = copy.deepcopy(model)
    mods = dict(new.named_modules())
    with torch.no_grad():
        for a in atts:
            sub = {k: getattr(a, k) for k in ("q", "k", "v", "o")}
            rebound = {k: _rebind(p, a, new, model) for k, p in sub.items()}
            r = a.heads // a.kv
            if a.qk:
                for j in range(a.kv):
                    B = _element(a.h, a.pairs, gen, full=full_qk)
                    for i in range(j * r, (j + 1) * r):
                        _produce(rebound["q"], i, B)
                    if not one_sided:
                        _produce(rebound["k"], j, torch.linalg.inv(B).T)
            if a.vo:
                for j in range(a.kv):
                    C = _element(a.h, None, gen)
                    _produce(rebound["v"], j, C)
                    for i in range(j * r, (j + 1) * r):
                        if not one_sided:
                            _consume(rebound["o"], i, C)
        for path in loras:
            layer = mods[path]
            A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            M = _element(A.shape[0], None, gen)
            B.data.copy_(B.data @ M)
            if not one_sided:
                A.data.copy_(torch.linalg.inv(M) @ A.data)
    return new


def _rebind(p: Proj, a, new, old):
    """The same projection, on the copy's tensors."""
    names = {id(t): n for n, t in old.named_parameters()}
    params = dict(new.named_parameters())
    return Proj(params[names[id(p.weight)]], p.axis, p.idx,
                params[names[id(p.bias)]] if p.bias is not None else None, p.bias_idx)


# -- expectations, per family ------------------------------------------------------------------


def _named(model, cls_names):
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in cls_names]


def _bert_like(model):
    out = []
    for n, m in _named(model, {"BertSelfAttention", "RobertaSelfAttention",
                               "ElectraSelfAttention"}):
        parent = model.get_submodule(n.rsplit(".", 1)[0])
        H, h = m.num_attention_heads, m.attention_head_size
        c = _contig(h)
        out.append(Att(n, H, H, h, _lin(m.query, c), _lin(m.key, c), _lin(m.value, c),
                       _lin(parent.output.dense, c)))
    return out


def _separate(model, cls_names, names=("q_proj", "k_proj", "v_proj", "o_proj"), pairs=None,
              qk=True, vo=True):
    out = []
    for n, m in _named(model, cls_names):
        qn, kn, vn, on = names
        q, k, v, o = (getattr(getattr(m, a), "base_layer", getattr(m, a))
                      for a in (qn, kn, vn, on))
        cfg = getattr(m, "config", None)
        H = (getattr(m, "num_heads", None) or getattr(m, "n_heads", None)
             or getattr(m, "num_attention_heads", None) or cfg.num_attention_heads)
        h = q.out_features // H
        kv = k.out_features // h
        c = _contig(h)
        out.append(Att(n, H, kv, h, _lin(q, c), _lin(k, c), _lin(v, c), _lin(o, c),
                       pairs=pairs(h) if pairs else None, qk=qk, vo=vo))
    return out


def _gpt2(model):
    out = []
    for n, m in _named(model, {"GPT2Attention"}):
        d, H = m.embed_dim, m.num_heads
        h = d // H
        if m.is_cross_attention:
            q, k, v = (_lin(m.q_attn, _contig(h)), _lin(m.c_attn, _contig(h)),
                       _lin(m.c_attn, _contig(h, d)))
        else:
            q, k, v = (_lin(m.c_attn, _contig(h, o)) for o in (0, d, 2 * d))
        out.append(Att(n, H, H, h, q, k, v, _lin(m.c_proj, _contig(h))))
    return out


def _neox(model):
    out = []
    cfg = model.config
    H = cfg.num_attention_heads
    h = cfg.hidden_size // H
    r = int(h * cfg.rope_parameters["partial_rotary_factor"])
    def per_head(o):
        return lambda i: torch.arange(i * 3 * h + o, i * 3 * h + o + h)

    for n, m in _named(model, {"GPTNeoXAttention"}):
        qkv = m.query_key_value
        out.append(Att(n, H, H, h, _lin(qkv, per_head(0)), _lin(qkv, per_head(h)),
                       _lin(qkv, per_head(2 * h)), _lin(m.dense, _contig(h)),
                       pairs=[(i, i + r // 2) for i in range(r // 2)]))
    return out


def _fused_timm(model, cls_names, pairs=None, vo=True):
    out = []
    for n, m in _named(model, cls_names):
        H = m.num_heads
        qkv = m.qkv
        a = qkv.out_features // 3
        h = a // H
        bias = getattr(m, "q_bias", None)
        if qkv.bias is not None:
            q, k, v = (_lin(qkv, _contig(h, o)) for o in (0, a, 2 * a))
        else:  # BEiT / EVA: q and v biases of their own, none for k
            q = Proj(qkv.weight, 0, _contig(h), bias, _contig(h))
            k = Proj(qkv.weight, 0, _contig(h, a))
            v = Proj(qkv.weight, 0, _contig(h, 2 * a), getattr(m, "v_bias", None), _contig(h))
        out.append(Att(n, H, H, h, q, k, v, _lin(m.proj, _contig(h)),
                       pairs=pairs(h) if pairs else None, vo=vo))
    return out


def _mha(model):
    out = []
    for n, m in _named(model, {"MultiheadAttention"}):
        d, H, h = m.embed_dim, m.num_heads, m.head_dim
        q, k, v = (Proj(m.in_proj_weight, 0, _contig(h, o), m.in_proj_bias, _contig(h, o))
                   for o in (0, d, 2 * d))
        out.append(Att(n, H, H, h, q, k, v, _lin(m.out_proj, _contig(h))))
    return out


def _half(h):
    return [(i, i + h // 2) for i in range(h // 2)]


def _interleaved(h):
    return [(2 * i, 2 * i + 1) for i in range(h // 2)]


LLAMA = {"LlamaAttention", "MistralAttention", "Qwen2Attention"}
EXPECT = {
    "bert": _bert_like, "roberta": _bert_like, "electra": _bert_like,
    "distilbert": lambda m: _separate(m, {"DistilBertSelfAttention"},
                                      ("q_lin", "k_lin", "v_lin", "out_lin")),
    "gpt2": _gpt2, "gpt2_cross": _gpt2, "gpt_neox": _neox,
    "llama": lambda m: _separate(m, LLAMA, pairs=_half),
    "llama_gqa": lambda m: _separate(m, LLAMA, pairs=_half),
    "mistral": lambda m: _separate(m, LLAMA, pairs=_half),
    "qwen2": lambda m: _separate(m, LLAMA, pairs=_half),
    "qwen3": lambda m: _separate(m, {"Qwen3Attention"}, pairs=_half, qk=False),
    "t5": lambda m: _separate(m, {"T5Attention"}, ("q", "k", "v", "o")),
    "bart": lambda m: _separate(m, {"BartAttention"}, ("q_proj", "k_proj", "v_proj",
                                                       "out_proj")),
    "whisper": lambda m: _separate(m, {"WhisperAttention"}, ("q_proj", "k_proj", "v_proj",
                                                             "out_proj")),
    "vit": lambda m: _separate(m, {"ViTAttention"}),
    "deit": lambda m: _separate(m, {"DeiTAttention"}),
    "clip": lambda m: _separate(m, {"CLIPAttention"}, ("q_proj", "k_proj", "v_proj",
                                                       "out_proj")),
    "timm_vit": lambda m: _fused_timm(m, {"Attention"}),
    "timm_swin": lambda m: _fused_timm(m, {"WindowAttention"}),
    "timm_beit": lambda m: _fused_timm(m, {"Attention"}),
    "timm_eva02": lambda m: _separate(m, {"EvaAttention"}, ("q_proj", "k_proj", "v_proj",
                                                            "proj"), pairs=_interleaved),
    "timm_eva02_inner_norm": lambda m: _fused_timm(m, {"EvaAttention"}, pairs=_interleaved,
                                                   vo=False),
    "timm_xcit": lambda m: _separate(m, {"ClassAttn"}, ("q", "k", "v", "proj")),
    "torch_encoder": _mha, "torch_transformer": _mha,
    "peft_llama": lambda m: _separate(m, LLAMA, pairs=_half, qk=False),
    "peft_bert": lambda m: [],
}
# expected fallbacks: model -> [(module class, kind, reason pattern)]
FALLBACKS = {
    "qwen3": [("Qwen3Attention", "attention.qk", r"q/k normalisation.*gain exchange")],
    "timm_eva02_inner_norm": [("EvaAttention", "attention.vo",
                               r"normalisation between the attention output and the output "
                               r"projection \(EvaAttention.norm: LayerNorm")],
    "timm_xcit": [("XCA", "attention", r"channel attention")],
    "peft_llama": [("LlamaAttention", "attention.qk", r"wrapped by LoRA")],
    "peft_bert": [("BertSelfAttention", "attention.qk", r"wrapped by LoRA"),
                  ("BertSelfAttention", "attention.vo", r"wrapped by LoRA")],
}
LORA = {"peft_llama": 4, "peft_bert": 4}


def _expected_blocks(name):
    atts = EXPECT[name](_model(name))
    qk = sorted((a.module, a.kv, a.h, tuple(a.pairs) if a.pairs else None)
                for a in atts if a.qk)
    vo = sorted((a.module, a.kv, a.h) for a in atts if a.vo)
    return atts, qk, vo


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_head_found_and_probed(name):
    model, sym = _model(name), _sym(name)
    atts, qk, vo = _expected_blocks(name)
    got_qk = sorted((b.module, b.heads, b.h, b.group.pairs if b.group else None)
                    for b in sym.blocks if b.kind == "attention.qk")
    got_vo = sorted((b.module, b.heads, b.h) for b in sym.blocks if b.kind == "attention.vo")
    assert got_qk == qk
    assert got_vo == vo
    assert len([b for b in sym.blocks if b.kind == "lora"]) == LORA.get(name, 0)
    # the head count: layers x heads per attention module (key/value heads for GQA)
    assert sum(b.heads for b in sym.blocks if b.kind == "attention.qk") == sum(
        a.kv for a in atts if a.qk)
    # every claim was probed and passed
    assert len(sym.probes) == len(sym.blocks)
    assert all(p.passed and p.error <= 1e-10 and p.control >= 1e-3 for p in sym.probes)
    # fallbacks: exactly the expected ones, with the true reason
    classes = {n: type(m).__name__ for n, m in model.named_modules()}
    attention_fb = [f for f in sym.fallbacks if f.kind.startswith("attention")]
    got_fb = sorted((classes[f.module], f.kind) for f in attention_fb)
    want = FALLBACKS.get(name, [])
    n_mods = {c: sum(1 for v in classes.values() if v == c) for c, _, _ in want}
    assert got_fb == sorted((c, k) for c, k, _ in want for _ in range(n_mods[c]))
    for f in attention_fb:
        (pattern,) = [p for c, k, p in want if (c, k) == (classes[f.module], f.kind)]
        assert re.search(pattern, f.reason), f.reason


@pytest.mark.parametrize("name", sorted(ZOO))
def test_independent_construction_preserves_outputs(name):
    model, sym = _model(name), _sym(name)
    atts, _, _ = _expected_blocks(name)
    loras = [b.module for b in sym.blocks if b.kind == "lora"]
    inputs = example_inputs(model)
    gen = torch.Generator().manual_seed(7)
    ref = _forward(model, inputs)
    new = _transform(model, atts, loras, gen)
    moved = max(float((a - b).detach().abs().max()) for (_, a), (_, b) in zip(
        model.named_parameters(), new.named_parameters()))
    assert moved > 1e-2  # the weights really changed
    out = _forward(new, inputs)
    assert float((out - ref).norm() / ref.norm()) <= 1e-10
    # the same construction without the compensating factor changes the output
    broken = _transform(model, atts, loras, torch.Generator().manual_seed(7), one_sided=True)
    assert float((_forward(broken, inputs) - ref).norm() / ref.norm()) > 1e-3


@pytest.mark.parametrize("name", ["llama_gqa", "gpt_neox", "timm_eva02", "qwen2"])
def test_rotary_restriction_is_necessary(name):
    """A full GL(h) element on rotary Q/K (what the paper's blocks would claim) changes the
    output: the commutant is not a formality."""
    model = _model(name)
    atts, _, _ = _expected_blocks(name)
    inputs = example_inputs(model)
    ref = _forward(model, inputs)
    new = _transform(model, atts, [], torch.Generator().manual_seed(3), full_qk=True)
    assert float((_forward(new, inputs) - ref).norm() / ref.norm()) > 1e-3


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama_gqa", "t5", "bart"])
def test_zoo_attention_is_not_uniform(name):
    model = _model(name)
    args, kwargs = example_inputs(model)
    kwargs = dict(kwargs, output_attentions=True)
    with torch.no_grad():
        out = model(*args, **kwargs)
    maps = [a for key in ("attentions", "encoder_attentions", "decoder_attentions",
                          "cross_attentions") for a in (getattr(out, key, None) or ())]
    assert maps
    for P in maps:
        ent = -(P * P.clamp_min(1e-300).log()).sum(-1)
        n_keys = (P > 0).sum(-1).clamp_min(2).to(P.dtype)
        ratio = float((ent / n_keys.log()).mean())
        assert ratio < 0.8, ratio  # uniform attention would give 1


def test_example_input_of_a_model_around_self_attention():
    """A model whose first parameterised module is an `nn.MultiheadAttention` applied to its
    input gets one sequence of the attention's width (so its folds can be probed)."""

    class Classifier(nn.Module):
        def __init__(self, batch_first):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.attn(x, x, x, need_weights=False)[0].mean(0))

    for bf in (True, False):
        model = Classifier(bf).double()
        (x,), kw = example_inputs(model)
        assert kw == {} and x.dtype == torch.float64
        assert x.shape == ((2, 5, 8) if bf else (5, 2, 8))
        sym = qm.models.discover(model, warn=False)
        assert sym.folds and not [f for f in sym.fallbacks if f.kind == "folds"]


def test_timm_attention_is_not_uniform():
    model = _model("timm_vit")
    attn = model.blocks[0].attn
    (x,), _ = example_inputs(model)
    store = {}
    h = attn.register_forward_hook(lambda m, a, o: store.setdefault("x", a[0]))
    with torch.no_grad():
        model(x)
    h.remove()
    with torch.no_grad():
        qkv = attn.qkv(store["x"]).reshape(2, -1, 3, attn.num_heads, attn.head_dim)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    P = torch.softmax(q @ k.transpose(-1, -2) * attn.scale, -1)
    ent = -(P * P.log()).sum(-1)
    assert float(ent.mean() / math.log(P.shape[-1])) < 0.8


def test_paper_mode_claims_gl_only():
    sym = _sym("llama_gqa", "paper")
    assert sym.symmetry == "paper" and sym.folds == ()
    assert sym.blocks == ()
    assert {(f.module, f.kind) for f in sym.fallbacks} >= {
        (f"layers.{i}.self_attn", k) for i in (0, 1) for k in ("attention.qk", "attention.vo")}
    for name in ("bert", "gpt2", "t5", "timm_vit"):
        full, paper = _sym(name), _sym(name, "paper")
        assert full.discovered == paper.blocks == paper.discovered
        assert all(b.group is None and all(p.stack == 1 for p in b.G + b.H)
                   for b in paper.blocks)
    eva = _sym("timm_eva02", "paper")
    assert [b.kind for b in eva.blocks] == ["attention.vo"] * 2
    assert all("rotary" in f.reason for f in eva.fallbacks)


def test_rotary_pairs_read_from_the_model():
    neox = [b for b in _sym("gpt_neox").blocks if b.kind == "attention.qk"]
    assert neox[0].group == RotaryCommutant(8, rope_pairs(8, 4))
    assert neox[0].group.free() == (4, 5, 6, 7)  # partial rotary: the rest is free
    assert neox[0].G[0].stride == 24  # per-head [q; k; v]
    eva = [b for b in _sym("timm_eva02").blocks if b.kind == "attention.qk"]
    assert eva[0].group.pairs == rope_pairs(16, interleaved=True)


# -- probes that cannot be fooled ---------------------------------------------------------------


def test_xcit_channel_attention_rejected_by_the_probe_alone(monkeypatch):
    """Without the structural XCA check, the generic fused-qkv recogniser claims XCA's qkv/proj
    as token attention; the probe must reject both claims."""
    monkeypatch.setattr(layouts, "LAYOUTS", [
        f for f in layouts.LAYOUTS if f is not layouts.channel_attention])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        sym = qm.discover(_model("timm_xcit"))
    msgs = [str(w.message) for w in rec if w.category is qm.SymmetryFallbackWarning]
    assert len(msgs) == 2 and all("probe rejected" in m for m in msgs)
    assert {b.module for b in sym.blocks} == {"cls_attn_blocks.0.attn"}
    rejected = [f for f in sym.fallbacks if f.module.startswith("blocks.")]
    assert sorted((f.module, f.kind) for f in rejected) == [
        (f"blocks.{i}.attn", k) for i in (0, 1) for k in ("attention.qk", "attention.vo")]
    assert all("probe rejected" in f.reason for f in rejected)
    bad = [p for p in sym.probes if not p.passed]
    assert len(bad) == 4 and min(p.error for p in bad) > 1e-3


class _PerHeadQKV(nn.Module):
    """timm-looking attention (qkv, proj, num_heads) whose qkv rows are per head [q; k; v]."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.num_heads, self.head_dim = heads, d // heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, self.num_heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        q, k, v = qkv.unbind(0)
        P = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), -1)
        return self.proj((P @ v).transpose(1, 2).reshape(B, N, C))


def test_wrong_layout_rejected_even_with_tiny_weights():
    """The structural recogniser reads the wrong (contiguous) layout; the probe rejects it,
    even with HF-style N(0, 0.02²) weights that make the attention nearly uniform."""
    torch.manual_seed(0)
    net = _PerHeadQKV().double()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.02)
    with pytest.warns(qm.SymmetryFallbackWarning), pytest.warns(qm.NoBlocksWarning):
        sym = qm.discover(net)
    assert sym.blocks == ()
    assert {f.kind for f in sym.fallbacks if f.module == ""} >= {"attention.qk", "attention.vo"}
    assert all(not p.passed and p.error > 1e-4 for p in sym.probes)


def test_declared_wrong_group_raises():
    """Declaring full GL(h) on rotary Q/K (or the wrong pair layout) is caught by the probe,
    also at HF's 0.02 initialisation."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=40))
    kw = dict(G=FactorPart("layers.0.self_attn.q_proj.weight", "rows", stack=2),
              H=("layers.0.self_attn.k_proj.weight", "rows"), heads=2, h=8, kind="custom")
    with pytest.raises(qm.BlockSpecError, match="not a symmetry"):
        qm.discover(model, declared=[qm.declare_block(**kw)], warn=False)
    wrong = RotaryCommutant(8, rope_pairs(8, interleaved=True))
    with pytest.raises(qm.BlockSpecError, match="not a symmetry"):
        qm.discover(model, declared=[qm.declare_block(**kw, group=wrong)], warn=False)
    right = RotaryCommutant(8, rope_pairs(8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sym = qm.discover(model, symmetry="paper", declared=[qm.declare_block(**kw, group=right)])
    assert [b.group for b in sym.blocks if b.kind == "custom"] == [right]


def test_mixed_model_warns_for_the_unrecognised_module():
    class LinearAttention(nn.Module):  # no softmax, no heads: nothing discovery knows
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x) @ x.transpose(-1, -2) @ x

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
            self.my_attention = LinearAttention()

        def forward(self, x):
            return self.my_attention(self.mha(x, x, x)[0])

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        sym = qm.discover(Mixed().double())
    msgs = [str(w.message) for w in rec if w.category is qm.SymmetryFallbackWarning]
    assert any(m.startswith("my_attention (LinearAttention)") for m in msgs)
    assert [b.module for b in sym.blocks] == ["mha", "mha"]
    assert [(f.module, f.kind) for f in sym.fallbacks if f.kind.startswith("attention")] == [
        ("my_attention", "attention")]


def test_unreachable_module_warns_and_example_inputs_fix_it():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                      vocab_size=10, num_hidden_layers=1)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = LlamaAttention(cfg, 0)
            self.rope = LlamaRotaryEmbedding(cfg)

        def forward(self, x, pos):
            return self.attn(x, self.rope(x, pos), None)[0]

    net = Wrap().double()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        sym = qm.discover(net)
    probe_warnings = [str(w.message) for w in rec if w.category is qm.ProbeWarning]
    assert len(probe_warnings) == 1 and "attn" in probe_warnings[0]
    assert len(sym.blocks) == 2 and sym.probes == ()
    x, pos = torch.randn(2, 5, 16, dtype=torch.float64), torch.arange(5)[None].expand(2, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qm.SymmetryFallbackWarning)
        warnings.simplefilter("error", qm.ProbeWarning)
        sym = qm.discover(net, example_inputs=(x, pos))
    assert len(sym.discovered) == 2
    assert len(sym.probes) == 2 and all(p.passed for p in sym.probes)


def test_discover_leaves_the_model_untouched():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32, vocab_size=40,
                                 max_position_embeddings=16)).float().train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    qm.discover(model)
    assert model.training
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_float64_internals_and_tolerance():
    from quotient_manifolds.models.precision import float64_internals
    from quotient_manifolds.models.prober import tolerance
    from quotient_manifolds.models.records import PROBE_RTOL

    x = torch.randn(3, 4, dtype=torch.float64)
    with float64_internals():
        assert x.float().dtype == torch.float64
        assert x.to(torch.float32).dtype == torch.float64
        assert x.to("cpu", torch.float16).dtype == torch.float64
        assert x.type_as(torch.zeros(1, dtype=torch.float32)).dtype == torch.float64
        assert torch.softmax(x, -1, dtype=torch.float32).dtype == torch.float64
        assert torch.zeros(2, dtype=torch.float32).dtype == torch.float32  # not a downcast
        assert x.to(torch.int64).dtype == torch.int64
        y = torch.randn(2, dtype=torch.float32)
        assert y.to(torch.float16).dtype == torch.float16  # only float64 tensors are kept
    assert x.float().dtype == torch.float32  # restored on exit

    class Casts(nn.Module):
        def __init__(self, escape):
            super().__init__()
            self.lin, self.escape = nn.Linear(4, 4).double(), escape

        def forward(self, x):
            y = self.lin(x).float()  # widened inside the probe
            if self.escape:  # a fresh float32 buffer: cannot be widened
                y = torch.empty(y.shape, dtype=torch.float32).copy_(y)
            return y

    assert tolerance(Casts(False), {}, (x,), {}) == PROBE_RTOL
    assert tolerance(Casts(True), {}, (x,), {}) == pytest.approx(
        100 * torch.finfo(torch.float32).eps)


# -- blocks ---------------------------------------------------------------------------------------


def _naive(part, t, heads, h):
    step = part.stride or (1 if part.layout == "elem" else h)
    w = 1 if part.layout == "elem" else h
    out = []
    for b in range(heads):
        rows = []
        for j in range(part.stack):
            k = b * part.stack + j
            idx = list(range(part.offset + k * step, part.offset + k * step + w))
            if part.layout == "rows":
                rows.append(t[idx, :].T)
            elif part.layout == "cols":
                rows.append(t[:, idx])
            else:
                rows.append(t.reshape(-1)[idx][None, :])
        out.append(torch.cat(rows, 0))
    return torch.stack(out)


@pytest.mark.parametrize("layout", ["rows", "cols", "bias", "elem"])
@pytest.mark.parametrize("stride,stack,offset", [(0, 1, 0), (0, 2, 1), (7, 1, 2), (9, 2, 0)])
def test_factor_part_matches_index_arithmetic(layout, stride, stack, offset):
    h = 1 if layout == "elem" else 3
    heads = 2
    t = {"rows": torch.randn(40, 5), "cols": torch.randn(5, 40)}.get(layout, torch.randn(40))
    t = t.double().requires_grad_(True)
    part = FactorPart("w", layout, offset, stride, stack)
    got = part.read(t, heads, h)
    assert torch.equal(got, _naive(part, t, heads, h))
    assert part.rows(t) == got.shape[1]
    value = torch.randn_like(got)
    new = part.write(t, value)
    assert torch.equal(part.read(new, heads, h), value)
    mask = torch.zeros(t.shape, dtype=torch.bool)
    part.mark(mask, heads, h)
    assert int(mask.sum()) == value.numel()
    assert torch.equal(new[~mask], t[~mask])
    g = torch.autograd.grad((new * new.detach()).sum(), t)[0]  # differentiable, out of place
    assert torch.equal(g[mask], torch.zeros_like(g[mask]))


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(["rows", "cols", "bias", "elem"]), heads=st.integers(1, 3),
       h=st.integers(1, 4), extra=st.integers(0, 3), stack=st.integers(1, 3),
       offset=st.integers(0, 3), other=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_factor_part_roundtrip_property(layout, heads, h, extra, stack, offset, other, seed):
    """read(write(t, v)) = v, untouched entries stay, the mask covers exactly the part; for
    every layout, stride (0 or h + extra) and stack."""
    h = 1 if layout == "elem" else h
    stride = 0 if extra == 0 else h + extra
    part = FactorPart("w", layout, offset, stride, stack)
    size = offset + part.span(heads, h) + 1
    g = torch.Generator().manual_seed(seed)
    shape = {"rows": (size, other), "cols": (other, size)}.get(layout, (size,))
    t = torch.randn(*shape, generator=g, dtype=torch.float64)
    got = part.read(t, heads, h)
    assert torch.equal(got, _naive(part, t, heads, h))
    value = torch.randn(got.shape, generator=g, dtype=torch.float64)
    new = part.write(t, value)
    assert torch.equal(part.read(new, heads, h), value)
    mask = torch.zeros(t.shape, dtype=torch.bool)
    part.mark(mask, heads, h)
    assert int(mask.sum()) == value.numel() and torch.equal(new[~mask], t[~mask])


def test_declare_block_one_liners_match_discovery():
    model = _model("llama_gqa")
    p = "layers.0.self_attn."
    found = {b.kind: b for b in _sym("llama_gqa").blocks if b.module == "layers.0.self_attn"}
    params = dict(model.named_parameters())
    vo = qm.declare_block(G=(p + "v_proj.weight", "rows"),
                          H={"param": p + "o_proj.weight", "layout": "cols", "stack": 2},
                          heads=2, h=8, kind="attention.vo", module="layers.0.self_attn")
    assert vo.resolved(params) == found["attention.vo"]
    qk = qm.declare_block(G=FactorPart(p + "q_proj.weight", "rows", stack=2),
                          H=(p + "k_proj.weight", "rows"), heads=2, h=8, kind="attention.qk",
                          module="layers.0.self_attn", group=RotaryCommutant(8, rope_pairs(8)))
    assert qk.resolved(params) == found["attention.qk"]
    fused = qm.declare_block(G=("blocks.0.attn.qkv.weight", "rows", 0),
                             H=("blocks.0.attn.qkv.weight", "rows", 16), heads=2, h=8)
    assert fused.resolved(dict(_model("timm_vit").named_parameters())).n == 16


@pytest.mark.parametrize("kwargs,match", [
    (dict(G=("a", "bogus"), H="b"), "layout"),
    (dict(G=("a", "rows", 0, 0, 1, 9), H="b"), "bad factor part"),
    (dict(G=("a", "rows", -1), H="b"), "offset"),
    (dict(G=FactorPart("a"), H=object()), "bad factor"),
    (dict(G="a", H="b", heads=0), "heads"),
    (dict(G="a", H="b", kind="attention"), "kind"),
    (dict(G="a", H="b", group="rope"), "Subalgebra"),
])
def test_declare_block_errors(kwargs, match):
    with pytest.raises(qm.BlockSpecError, match=match):
        qm.declare_block(**kwargs)


def test_resolve_errors():
    params = {"w": torch.zeros(12, 4), "b": torch.zeros(12)}
    with pytest.raises(qm.BlockSpecError, match="overlap"):
        qm.declare_block(G=("w", "rows", 0, 2), H="b", heads=2, h=3).resolved(params)
    with pytest.raises(qm.BlockSpecError, match="needs 16 entries"):
        qm.declare_block(G=("w", "rows", 0, 0, 2), H=("b", "bias"), heads=2, h=4).resolved(params)
    with pytest.raises(qm.BlockSpecError, match="pass h="):
        qm.declare_block(G=("w", "rows", 3), H=("b", "bias"), heads=2).resolved(params)
    with pytest.raises(qm.BlockSpecError, match="acts on R"):
        qm.declare_block(G=("w", "rows"), H=("b", "bias"), heads=3, h=4,
                         group=RotaryCommutant(6, ())).resolved(params)
    with pytest.raises(qm.BlockSpecError, match="symmetry must be"):
        qm.discover(nn.Linear(2, 2), symmetry="both")


# -- canonicalisation plumbing ---------------------------------------------------------------


class _ZeroBias:
    """A stand-in fold: sets one bias to zero and freezes it."""

    kind = "test"

    def __init__(self, name):
        self.name = name

    def apply(self, params):
        t = params[self.name]
        return {self.name: torch.zeros_like(t)}, {self.name: torch.ones(t.shape, dtype=bool)}


def test_canonicalize_and_strip_frozen():
    model = _model("bert")
    params = {n: p.detach() for n, p in model.named_parameters()}
    kb = "encoder.layer.0.attention.self.key.bias"
    sym = qm.Symmetries(_sym("bert", "paper").blocks, (), (_ZeroBias(kb),))
    canon, frozen = sym.canonicalize(params)
    assert float(canon[kb].abs().max()) == 0 and bool(frozen[kb].all())
    assert canon["encoder.layer.0.attention.self.query.bias"] is params[
        "encoder.layer.0.attention.self.query.bias"]
    blocks, fbs = disc.strip_frozen(sym.blocks, frozen, params)
    qk0 = [b for b in blocks if b.kind == "attention.qk"][0]
    assert [p.param for p in qk0.H] == ["encoder.layer.0.attention.self.key.weight"]
    assert (qk0.n, qk0.m) == (17, 16) and fbs == []
    half = {kb: torch.arange(16) < 8}
    blocks, fbs = disc.strip_frozen(sym.blocks, half, params)
    assert len(blocks) == 3 and "part of" in fbs[0].reason


MORE = ["gemma", "gemma2", "gemma3_text", "phi", "phi3", "gptj", "bloom", "opt", "olmo2", "mpt",
        "modernbert", "deberta-v2", "stablelm", "starcoder2", "gpt_bigcode", "cohere", "granite",
        "albert", "xlm-roberta", "mbart", "pegasus", "marian", "m2m_100", "mt5", "longt5",
        "umt5", "olmo", "mixtral", "persimmon", "codegen"]
UNCLAIMED = {"persimmon": "head layout is not known", "codegen": "unrecognised attention layout"}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MORE)
def test_more_transformers_architectures(model_type):
    """Beyond the zoo: every claim on these tiny configs is probed and passes, and whatever is
    not claimed is recorded (q/k norm for Gemma 3 and OLMo 2)."""
    from model_zoo import redraw_
    from transformers import AutoConfig, AutoModel

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 vocab_size=64, max_position_embeddings=64, n_embd=32, n_layer=2, n_head=4,
                 d_model=32, num_layers=2, num_heads=4, ffn_dim=64, encoder_layers=2,
                 decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, n_positions=64, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2, num_key_value_heads=2,
                 attn_implementation="eager")
    extra = {"gptj": dict(rotary_dim=4), "gemma": dict(head_dim=8), "gemma2": dict(head_dim=8),
             "gemma3_text": dict(head_dim=8)}.get(model_type, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.for_model(model_type, **{**small, **extra})
        model = redraw_(AutoModel.from_config(cfg).double().eval())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        sym = qm.discover(model)
    if model_type in UNCLAIMED:
        assert sym.blocks == () and sym.fallbacks[-1].kind == "all"
        assert all(UNCLAIMED[model_type] in f.reason for f in sym.fallbacks[:-1])
        n_attn = len(sym.fallbacks) - 1
        assert n_attn == 2 and len([w for w in rec if w.category is qm.SymmetryFallbackWarning
                                    ]) == n_attn
        return
    assert not [w for w in rec if w.category in (qm.ProbeWarning, qm.NoBlocksWarning)]
    assert sym.blocks and len(sym.probes) == len(sym.blocks)
    assert all(p.passed for p in sym.probes)
    for f in sym.fallbacks:
        assert model_type in ("gemma3_text", "olmo2") and "q/k normalisation" in f.reason
