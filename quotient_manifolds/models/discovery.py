r"""Symmetry discovery: find the blocks of a PyTorch model, and check every claim.

Attention modules are recognised by their structure, not their class name:

* fused `in_proj_weight`, rows `[q; k; v]`, `bias_k`/`bias_v` appended:
  `nn.MultiheadAttention` (also inside `nn.Transformer`);
* fused `qkv` + `proj`, rows `[q; k; v]`: timm ViT, DeiT, Swin, BEiT (`q_bias`/`v_bias`),
  EVA (fused);
* transposed `Conv1D`, columns `[q, k, v]`: GPT-2 `c_attn`/`c_proj` (`q_attn` for
  cross-attention);
* interleaved per head, rows `[q_0; k_0; v_0; q_1; …]` (stride $3h$): GPT-NeoX and BLOOM
  `query_key_value` + `dense`;
* fused and grouped, rows `[q (H h); k (K h); v (K h)]`: `qkv_proj`, `Wqkv`;
* separate projections: `q_proj`/`k_proj`/`v_proj` + `o_proj`/`out_proj`/`proj`/`dense`
  (Llama, Mistral, Qwen, BART, Whisper, CLIP, ViT, EVA); `query`/`key`/`value` + the sibling
  `output.dense` (BERT, RoBERTa, ELECTRA); `q_lin`/…/`out_lin` (DistilBERT); `q`/`k`/`v` +
  `o`/`proj` (T5, class attention).

Per head $i$: $G_{QK} = [W_q[r_i,:]^\top; b_q[r_i]]$, $H_{QK} = [W_k[r_i,:]^\top; b_k[r_i]]$,
$G_{VO} = [W_v[r_i,:]^\top; b_v[r_i]]$, $H_{VO} = W_o[:, r_i]$ (a missing bias means no row).
Cross-attention is the same with keys/values read from the encoder states.

With `symmetry="full"` (the default) discovery also claims

* grouped K/V heads (GQA/MQA): one block per key/value head; its $G_{QK}$ stacks the query
  heads that read it, its $H_{VO}$ stacks their output columns;
* rotary position embeddings: the Q/K block keeps only the rotations' commutant
  ([RotaryCommutant][quotient_manifolds.geometry.subgroup.RotaryCommutant]), with the pairs
  read from the model (rotate-half $(i, i + r/2)$ or interleaved $(2i, 2i+1)$ on the first $r$
  rotary dimensions; the others are free);
* the canonicalisation folds of `find_folds` (`models/canonical.py`).

`symmetry="paper"` claims GL(h) per recognised head only, with the bias rows appended (the
paper's measure); rotary and grouped heads then fall back.

What does not get a block (recorded as a [Fallback][quotient_manifolds.models.records.Fallback]
with the reason, and warned about once per module): q/k normalisation (its Q/K keeps only
gain exchanges and orthogonal maps), a norm or gate between the attention output and the output
projection (no V/O block), channel attention (XCiT), projections wrapped by LoRA adapters (the
adapters' own GL(r) blocks are claimed), fused layouts we cannot read, and any other module that
looks like attention.

Every claimed block is checked by the function-preservation probe of
[probe][quotient_manifolds.models.probe] on a float64 copy; a claim the probe rejects is
dropped and recorded with the measured error.
"""

from __future__ import annotations

import inspect
import re
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeGuard

import torch
from torch import nn

from ..errors import BlockSpecError, NoBlocksWarning, ProbeWarning, SymmetryFallbackWarning
from ..manifolds import RotaryCommutant
from .blocks import BlockSpec, FactorPart
from .canonical import find_folds
from .probe import normalize_inputs, probe_blocks
from .records import SYMMETRIES, Fallback, ProbeRecord, Symmetries

__all__ = [
    "SYMMETRIES",
    "Fallback",
    "Symmetries",
    "discover",
    "discover_blocks",
    "rope_pairs",
    "strip_frozen",
]

def rope_pairs(h: int, rotary_dim: int | None = None, *, interleaved: bool = False
               ) -> tuple[tuple[int, int], ...]:
    r"""The coordinate pairs that a rotary embedding rotates together.

    Parameters
    ----------
    h : int
        Head dimension.
    rotary_dim : int, optional
        Number of rotated dimensions $r$ (the first $r$; default all $h$). Partial rotary
        (GPT-NeoX `rotary_pct`, Phi `partial_rotary_factor`) leaves the rest free.
    interleaved : bool
        `False`: the rotate-half layout $(i, i + r/2)$, $i < r/2$ (HF Llama, GPT-NeoX);
        `True`: $(2i, 2i + 1)$ (GPT-J, timm EVA).

    Returns
    -------
    tuple of (int, int)
    """
    r = h if rotary_dim is None else int(rotary_dim)
    if r < 0 or r > h or r % 2:
        raise BlockSpecError(f"rotary_dim must be even and in [0, {h}], got {rotary_dim}")
    if interleaved:
        return tuple((2 * i, 2 * i + 1) for i in range(r // 2))
    return tuple((i, i + r // 2) for i in range(r // 2))


# -- module inspection ------------------------------------------------------------------------


def _linear(m) -> tuple[torch.Tensor, torch.Tensor | None, bool, int, int] | None:
    """`(weight, bias, transposed, in, out)` of an `nn.Linear` or a transposed `Conv1D`."""
    if isinstance(m, nn.Linear):
        return m.weight, m.bias, False, m.in_features, m.out_features
    if (type(m).__name__ == "Conv1D" and isinstance(getattr(m, "weight", None), nn.Parameter)
            and m.weight.dim() == 2 and hasattr(m, "nf")):
        return m.weight, getattr(m, "bias", None), True, m.weight.shape[0], m.weight.shape[1]
    return None


def _wrapped(m) -> bool:
    return isinstance(m, nn.Module) and hasattr(m, "base_layer") and hasattr(m, "lora_A")


def _base(m):
    """The layer a LoRA wrapper adapts (the module itself otherwise)."""
    return m.base_layer if _wrapped(m) else m


_WRAPPED = ("projections wrapped by LoRA adapters: the head symmetry would move the base "
            "weights together with lora_B (with the base weights frozen it is no symmetry of "
            "the trained parameters); the adapters' own GL(r) blocks are claimed instead")


def _active(m: object) -> TypeGuard[nn.Module]:
    return isinstance(m, nn.Module) and not isinstance(m, (nn.Identity, nn.Dropout))


def _int_attr(objs, names) -> int | None:
    for o in objs:
        if o is None:
            continue
        for a in names:
            v = getattr(o, a, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


_HEADS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "n_heads_q")
_HEAD_DIM = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim", "d_kv")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "num_kv_head")
_QK_NORMS = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"),
             ("query_layernorm", "key_layernorm"), ("q_ln", "k_ln"))
_VO_BREAKS = ("norm", "gate", "sub_norm", "attn_sub_norm", "inner_attn_ln", "o_norm")
_ROTARY_USE = re.compile(r"apply_rotary|rotary_emb|rotate_half|rotate_every_two|\brope\b")


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _param_name(name: str | None) -> str:
    """`name`; `None` (a tensor that is not a parameter of the model) raises the error that
    [`FactorPart`][quotient_manifolds.models.blocks.FactorPart] raises for it."""
    if name is None:
        raise BlockSpecError(f"param must be a parameter name, got {name!r}")
    return name


def _describe_norm(m: nn.Module) -> str:
    w = getattr(m, "weight", None)
    size = f" over {w.numel()} features" if isinstance(w, torch.Tensor) else ""
    return f"{type(m).__name__}{size}"


@dataclass
class _Proj:
    """Where one projection's per-head features live (`weight` is `None` when it is not a
    parameter of the model: `build` then falls back)."""

    weight: str | None
    transposed: bool = False  # Conv1D: (in, out) storage
    offset: int = 0
    stride: int = 0
    bias: str | None = None
    bias_offset: int | None = None

    def part(self, stack: int = 1) -> FactorPart:
        """The rows of a projection that *produces* head features."""
        return FactorPart(_param_name(self.weight), "cols" if self.transposed else "rows",
                          self.offset, self.stride, stack)

    def bias_part(self, stack: int = 1) -> FactorPart | None:
        if self.bias is None:
            return None
        off = self.offset if self.bias_offset is None else self.bias_offset
        return FactorPart(self.bias, "bias", off, self.stride, stack)

    def out_part(self, stack: int = 1) -> FactorPart:
        """The rows of a projection that *consumes* head features (the output projection)."""
        return FactorPart(_param_name(self.weight), "rows" if self.transposed else "cols",
                          self.offset, self.stride, stack)


@dataclass
class _Attention:
    module: str
    cls: str
    heads: int
    kv_heads: int
    h: int
    q: _Proj
    k: _Proj
    v: _Proj
    o: _Proj | None
    k_extra: str | None = None
    v_extra: str | None = None
    pairs: tuple | None = None
    qk_reason: str | None = None
    vo_reason: str | None = None
    layout: str = ""


@dataclass
class _Finder:
    model: nn.Module
    symmetry: str
    names: dict = field(init=False)
    modules: dict = field(init=False)
    attentions: list = field(default_factory=list)
    blocks: list = field(default_factory=list)
    fallbacks: list = field(default_factory=list)
    accounted: set = field(default_factory=set)
    input_dims: dict = field(default_factory=dict)
    classes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        self.modules = dict(self.model.named_modules())

    # -- helpers --------------------------------------------------------------------------
    def pname(self, t) -> str | None:
        return None if t is None else self.names.get(id(t))

    def fallback(self, module: str, kind: str, reason: str) -> None:
        self.fallbacks.append(Fallback(module, kind, reason))

    def account(self, name: str, m: nn.Module) -> None:
        self.accounted.add(name)
        self.classes[name] = type(m).__name__

    def proj(self, lin, offset=0, stride=0, bias_offset=None) -> _Proj:
        w, b, tr, _, _ = lin
        return _Proj(self.pname(w), tr, offset, stride, self.pname(b), bias_offset)

    def sizes(self, m: nn.Module, q_out: int, k_out: int) -> tuple[int, int, int] | str:
        """`(heads, kv_heads, h)`: heads from the module (or its config), the head size from
        the module or the query width, the key/value heads from the key width."""
        cfg = getattr(m, "config", None)
        heads = _int_attr((m,), _HEADS) or _int_attr((cfg,), _HEADS)
        if heads is None:
            return "cannot read the number of heads"
        h = _int_attr((m,), _HEAD_DIM)
        if h is None:
            ch = _int_attr((cfg,), ("head_dim",))
            h = ch if ch and ch * heads == q_out else (
                q_out // heads if q_out % heads == 0 else None)
        if h is None:
            return f"query width {q_out} is not a multiple of {heads} heads"
        kv = k_out // h if k_out % h == 0 else 0
        if kv < 1 or heads % kv:
            return f"key width {k_out} is not a divisor of {heads} heads x {h}"
        return heads, kv, h

    # -- families -------------------------------------------------------------------------
    def mha(self, name: str, m: nn.MultiheadAttention) -> None:
        self.account(name, m)
        d, heads, dh = m.embed_dim, m.num_heads, m.head_dim
        b = self.pname(m.in_proj_bias)
        if m._qkv_same_embed_dim:
            W = self.pname(m.in_proj_weight)
            q, k, v = (_Proj(W, False, o, 0, b, o) for o in (0, d, 2 * d))
        else:
            q, k, v = (_Proj(self.pname(w), False, 0, 0, b, o) for w, o in (
                (m.q_proj_weight, 0), (m.k_proj_weight, d), (m.v_proj_weight, 2 * d)))
        o = _Proj(self.pname(m.out_proj.weight))
        self.input_dims[name] = d
        self.attentions.append(_Attention(
            name, type(m).__name__, heads, heads, dh, q, k, v, o,
            k_extra=self.pname(m.bias_k), v_extra=self.pname(m.bias_v),
            layout="fused in_proj" if m._qkv_same_embed_dim else "separate q/k/v_proj_weight"))

    def lora(self, name: str, m: nn.Module) -> bool:
        A, B = getattr(m, "lora_A", None), getattr(m, "lora_B", None)
        if not (isinstance(A, nn.ModuleDict) and isinstance(B, nn.ModuleDict)):
            return False
        self.account(name, m)
        for key in A.keys():
            if key not in B:
                continue
            a, b = A[key], B[key]
            if not (isinstance(a, nn.Linear) and isinstance(b, nn.Linear)):
                continue
            r = a.out_features
            self.blocks.append(BlockSpec(
                "lora", name, 1, r, (FactorPart(_param_name(self.pname(b.weight)), "cols"),),
                (FactorPart(_param_name(self.pname(a.weight)), "rows"),),
                note=f"adapter {key!r}"))
        base = getattr(m, "base_layer", None)
        if isinstance(base, nn.Linear):
            self.input_dims[name] = base.in_features
        return True

    def channel_attention(self, name: str, m: nn.Module) -> bool:
        if not (isinstance(getattr(m, "temperature", None), nn.Parameter)
                and _linear(getattr(m, "qkv", None)) is not None):
            return False
        self.account(name, m)
        self.fallback(name, "attention", "channel attention (cross-covariance attention, "
                      "XCiT): each head attends over its channels, with q and k L2-normalised "
                      "along the tokens; neither Q/K nor V/O has a GL(h) symmetry")
        return True

    @staticmethod
    def _mark_wrapped(att: _Attention, qk: list, vo: list) -> None:
        """Projections wrapped by LoRA adapters take their side of the attention out."""
        if any(_wrapped(x) for x in qk):
            att.qk_reason = _WRAPPED
        if any(_wrapped(x) for x in vo):
            att.vo_reason = _WRAPPED

    def separate(self, name: str, m: nn.Module) -> bool:
        sets = (("q_proj", "k_proj", "v_proj", ("o_proj", "out_proj", "proj", "dense")),
                ("query", "key", "value", ("dense", "out_proj", "o_proj")),
                ("query_proj", "key_proj", "value_proj", ("dense", "out_proj")),
                ("q_lin", "k_lin", "v_lin", ("out_lin",)),
                ("q", "k", "v", ("o", "proj", "out")))
        for qn, kn, vn, outs in sets:
            mods = [getattr(m, a, None) for a in (qn, kn, vn)]
            if not all(isinstance(x, nn.Module) for x in mods):
                continue
            out = next((getattr(m, a) for a in outs if isinstance(getattr(m, a, None),
                                                                  nn.Module)), None)
            out_where = next((a for a in outs if getattr(m, a, None) is out), "")
            if out is None and qn in ("query", "query_proj"):  # BERT: a sibling output
                parent = self.modules.get(name.rsplit(".", 1)[0] if "." in name else "")
                out = getattr(getattr(parent, "output", None), "dense", None)
                out_where = "sibling output.dense"
            lins = [_linear(_base(x)) for x in mods]
            if any(x is None for x in lins):
                continue
            att = self._build_separate(name, m, lins, _linear(_base(out)), out_where,
                                       f"separate {qn}/{kn}/{vn}")
            if att is not None:
                self._mark_wrapped(att, mods[:2], [mods[2], out])
            return True
        return False

    def _build_separate(self, name, m, lins, out, out_where, layout) -> _Attention | None:
        lq, lk, lv = lins
        sizes = self.sizes(m, lq[4], lk[4])
        self.account(name, m)
        if isinstance(sizes, str):
            self.fallback(name, "attention", sizes)
            return None
        heads, kv, h = sizes
        if lq[4] != heads * h:
            what = "gated queries (the query projection also produces a gate)" if (
                lq[4] == 2 * heads * h) else f"query width {lq[4]} != {heads} heads x {h}"
            self.fallback(name, "attention", what)
            return None
        if lk[4] != kv * h or lv[4] != kv * h:
            self.fallback(name, "attention", f"key/value widths {lk[4]}/{lv[4]} do not match "
                          f"{kv} key/value heads x {h}")
            return None
        o = None
        vo_reason = None
        if out is None:
            vo_reason = "no output projection found"
        elif out[3] != heads * h:
            vo_reason = f"the output projection reads {out[3]} features, not {heads} x {h}"
        else:
            o = self.proj(out)
        self.input_dims[name] = lq[3]
        att = _Attention(name, type(m).__name__, heads, kv, h, self.proj(lq), self.proj(lk),
                         self.proj(lv), o, layout=layout + f" + {out_where}")
        self._inspect(att, m)
        if vo_reason and not att.vo_reason:
            att.vo_reason = vo_reason
        self.attentions.append(att)
        return att

    def gpt2(self, name: str, m: nn.Module) -> bool:
        mods = [getattr(m, "c_attn", None), getattr(m, "c_proj", None)]
        if not all(isinstance(x, nn.Module) for x in mods):
            return False
        c_attn, c_proj = _linear(_base(mods[0])), _linear(_base(mods[1]))
        if c_attn is None or c_proj is None or not c_attn[2]:
            return False
        q_attn = _linear(_base(getattr(m, "q_attn", None)))
        cross = bool(getattr(m, "is_cross_attention", False)) and q_attn is not None
        d = c_attn[4] // (2 if cross else 3)
        sizes = self.sizes(m, d, d)
        self.account(name, m)
        if isinstance(sizes, str):
            self.fallback(name, "attention", sizes)
            return True
        heads, kv, h = sizes
        if heads * h != d or kv != heads or c_proj[3] != d:
            self.fallback(name, "attention", "c_attn/c_proj widths do not match heads x head_dim")
            return True
        if cross:
            q, k, v = self.proj(q_attn), self.proj(c_attn, 0), self.proj(c_attn, d)
        else:
            q, k, v = (self.proj(c_attn, o) for o in (0, d, 2 * d))
        self.input_dims[name] = c_attn[3]
        att = _Attention(name, type(m).__name__, heads, heads, h, q, k, v, self.proj(c_proj),
                         layout="transposed Conv1D c_attn/c_proj" + (" (cross)" if cross else ""))
        self._inspect(att, m)
        self._mark_wrapped(att, [mods[0], getattr(m, "q_attn", None)], mods)
        self.attentions.append(att)
        return True

    def interleaved(self, name: str, m: nn.Module) -> bool:
        mods = [getattr(m, "query_key_value", None), getattr(m, "dense", None)]
        if not all(isinstance(x, nn.Module) for x in mods):
            return False
        qkv, dense = _linear(_base(mods[0])), _linear(_base(mods[1]))
        if qkv is None or dense is None:
            return False
        self.account(name, m)
        mod = type(m).__module__
        if not any(k in mod for k in (".gpt_neox.", ".bloom.")):
            self.fallback(name, "attention", f"fused query_key_value of {type(m).__name__}: "
                          "its head layout is not known to discovery")
            return True
        sizes = self.sizes(m, qkv[4] // 3, qkv[4] // 3)
        if isinstance(sizes, str):
            self.fallback(name, "attention", sizes)
            return True
        heads, kv, h = sizes
        if kv != heads or qkv[4] != 3 * heads * h or dense[3] != heads * h:
            self.fallback(name, "attention", "query_key_value/dense widths do not match "
                          "3 x heads x head_dim")
            return True
        q, k, v = (self.proj(qkv, o, 3 * h) for o in (0, h, 2 * h))
        self.input_dims[name] = qkv[3]
        att = _Attention(name, type(m).__name__, heads, heads, h, q, k, v, self.proj(dense),
                         layout="interleaved per-head query_key_value + dense")
        self._inspect(att, m)
        self._mark_wrapped(att, mods[:1], mods)
        self.attentions.append(att)
        return True

    def fused(self, name: str, m: nn.Module) -> bool:
        for qn, outs in (("qkv", ("proj", "out_proj", "o_proj")), ("qkv_proj", ("o_proj",)),
                         ("Wqkv", ("Wo", "out_proj")), ("c_attn", ("c_proj",))):
            qm = getattr(m, qn, None)
            outm = next((getattr(m, a) for a in outs if isinstance(getattr(m, a, None),
                                                                   nn.Module)), None)
            if not isinstance(qm, nn.Module) or outm is None:
                continue
            lin, out = _linear(_base(qm)), _linear(_base(outm))
            if lin is None or out is None:
                continue
            cfg = getattr(m, "config", None)
            heads = _int_attr((m,), _HEADS) or _int_attr((cfg,), _HEADS)
            if heads is None:
                continue
            self.account(name, m)
            h = _int_attr((m,), _HEAD_DIM) or (out[3] // heads if out[3] % heads == 0 else 0)
            rest = lin[4] // h - heads if h and lin[4] % h == 0 else -1
            kv = rest // 2 if rest > 0 and rest % 2 == 0 else 0
            if (kv < 1 or heads % kv or lin[4] != (heads + 2 * kv) * h
                    or out[3] != heads * h):
                self.fallback(name, "attention", f"{qn}/{outs[0]} widths "
                              f"({lin[4]}, {out[3]}) do not match {heads} query heads and "
                              "equal key/value head counts")
                return True
            a, c = heads * h, kv * h
            q, k, v = (self.proj(lin, o) for o in (0, a, a + c))
            qb = self.pname(getattr(m, "q_bias", None))
            if lin[1] is None and qb is not None:  # BEiT/EVA: separate q/v biases, no k bias
                q.bias, q.bias_offset = qb, 0
                kb = getattr(m, "k_bias", None)
                k.bias, k.bias_offset = self.pname(kb) if isinstance(kb, nn.Parameter) else None, 0
                v.bias, v.bias_offset = self.pname(getattr(m, "v_bias", None)), 0
            self.input_dims[name] = lin[3]
            oname = next(x for x in outs if getattr(m, x, None) is outm)
            att = _Attention(name, type(m).__name__, heads, kv, h, q, k, v, self.proj(out),
                             layout=f"fused {qn} + {oname}")
            self._inspect(att, m)
            self._mark_wrapped(att, [qm], [qm, outm])
            self.attentions.append(att)
            return True
        return False

    # -- what a recognised layout does to the heads ---------------------------------------
    def _inspect(self, att: _Attention, m: nn.Module) -> None:
        for qa, ka in _QK_NORMS:
            qn, kn = getattr(m, qa, None), getattr(m, ka, None)
            if _active(qn) or _active(kn):
                norm = qn if _active(qn) else kn
                assert isinstance(norm, nn.Module)  # one of the two is active
                att.qk_reason = (
                    f"q/k normalisation ({type(m).__name__}.{qa if _active(qn) else ka}: "
                    f"{_describe_norm(norm)}) is not GL(h)-equivariant: the exact Q/K "
                    f"symmetries left are the gain exchange {qa}.weight*c, {ka}.weight/c (c "
                    "equal on each rotary pair) and orthogonal maps commuting with the gains; "
                    "no GL(h) block")
                break
        pos = getattr(m, "position_embedding_type", None)
        if isinstance(pos, str) and pos.startswith("relative"):
            att.qk_reason = (f"position_embedding_type={pos!r}: the query also meets learned "
                             "relative position keys, which break GL(h) on Q/K")
        for a in _VO_BREAKS:
            x = getattr(m, a, None)
            if _active(x):
                what = "gate" if "gate" in a else "normalisation"
                desc = type(x).__name__ if what == "gate" else _describe_norm(x)
                att.vo_reason = (
                    f"{what} between the attention output and the output projection "
                    f"({type(m).__name__}.{a}: {desc}) acts per channel across heads, so V/O "
                    "has no GL(h) block")
                break
        pairs = self._rotary(att.module, m, att.h)
        if isinstance(pairs, str):
            att.qk_reason = att.qk_reason or pairs
        else:
            att.pairs = pairs

    def _rotary(self, name: str, m: nn.Module, h: int):
        """Rotary pairs of `m` (`None`: no rotary embedding), or a reason string."""
        if hasattr(m, "rotate_half") and "rope" in _signature(type(m).forward):
            # timm (EVA, AttentionRope): rope is passed in by the model when it has one
            if not self._model_has_rope(name):
                return None
            return rope_pairs(h, interleaved=not bool(m.rotate_half))
        src = _source(type(m).forward)
        if not _ROTARY_USE.search(src):
            return None
        mod = sys.modules.get(type(m).__module__)
        fsrc = src + "".join(_source(getattr(mod, f)) for f in (
            "apply_rotary_pos_emb", "rotate_half", "rotate_every_two") if hasattr(mod, f))
        if "rotate_every_two" in fsrc or re.search(r"\[\s*\.\.\.\s*,\s*::\s*2\s*\]", fsrc):
            interleaved = True
        elif "rotate_half" in fsrc:
            interleaved = False
        else:
            return (f"rotary embedding of {type(m).__name__} in a layout discovery does not "
                    "know (neither rotate-half nor interleaved pairs)")
        r = _int_attr((m,), ("rotary_ndims", "rotary_dim", "rotary_emb_dim"))
        if r is None:
            cfg = getattr(m, "config", None)
            rp = getattr(cfg, "rope_parameters", None) or {}
            factor = (rp.get("partial_rotary_factor") if isinstance(rp, Mapping) else None)
            factor = factor or getattr(cfg, "partial_rotary_factor", None) or getattr(
                cfg, "rotary_pct", None)
            rd = getattr(cfg, "rotary_dim", None)
            r = int(rd) if rd else int(h * float(factor)) if factor else h
        r = min(r, h)  # the rotated slice [..., :r] of a head is at most the head
        if r % 2:
            return f"rotary dimension {r} of {type(m).__name__} is odd"
        return rope_pairs(h, r, interleaved=interleaved)

    def _model_has_rope(self, name: str) -> bool:
        """Whether an ancestor of `name` holds a rotary embedding module (timm: `model.rope`)."""
        parts = name.split(".") if name else []
        for i in range(len(parts)):
            anc = self.modules.get(".".join(parts[:i]))
            if isinstance(getattr(anc, "rope", None), nn.Module):
                return True
        return False

    # -- blocks -----------------------------------------------------------------------------
    def build(self, att: _Attention) -> None:
        r = att.heads // att.kv_heads
        grouped = r > 1
        paper = self.symmetry == "paper"
        name = att.module
        note = att.layout
        not_param = ("a projection weight is not a parameter of the model (a buffer or a tensor "
                     "attribute)")
        if not att.qk_reason and (att.q.weight is None or att.k.weight is None):
            att.qk_reason = not_param
        if not att.vo_reason and (att.v.weight is None or (att.o and att.o.weight is None)):
            att.vo_reason = not_param
        if att.qk_reason:
            self.fallback(name, "attention.qk", att.qk_reason)
        elif paper and att.pairs:
            self.fallback(name, "attention.qk", "rotary position embeddings: only the "
                          "rotations' commutant acts on Q/K, and the paper's measure claims "
                          "full GL(h) blocks only (symmetry='full' claims the commutant)")
        elif paper and grouped:
            self.fallback(name, "attention.qk", f"grouped K/V heads ({att.kv_heads} for "
                          f"{att.heads} query heads; symmetry='full' claims them)")
        else:
            group = RotaryCommutant(att.h, tuple(att.pairs)) if att.pairs else None
            G: tuple[FactorPart | None, ...] = (att.q.part(r), att.q.bias_part(r))
            H = (att.k.part(), att.k.bias_part(),
                 FactorPart(att.k_extra, "bias") if att.k_extra else None)
            self.blocks.append(BlockSpec(
                "attention.qk", name, att.kv_heads, att.h, tuple(p for p in G if p),
                tuple(p for p in H if p), note=note, group=group))
        if att.vo_reason:
            self.fallback(name, "attention.vo", att.vo_reason)
        elif paper and grouped:
            self.fallback(name, "attention.vo", f"grouped K/V heads ({att.kv_heads} for "
                          f"{att.heads} query heads; symmetry='full' claims them)")
        elif att.o is None:
            self.fallback(name, "attention.vo", "no output projection found")
        else:
            G = (att.v.part(), att.v.bias_part(),
                 FactorPart(att.v_extra, "bias") if att.v_extra else None)
            self.blocks.append(BlockSpec(
                "attention.vo", name, att.kv_heads, att.h, tuple(p for p in G if p),
                (att.o.out_part(r),), note=note))

    def sweep(self) -> None:
        """Record every module that looks like attention but was not recognised."""
        pattern = re.compile(r"attention|attn|xca", re.IGNORECASE)
        candidates = []
        for name, m in self.modules.items():
            if name in self.accounted or not any(True for _ in m.parameters()):
                continue
            looks = bool(pattern.search(type(m).__name__)) or (
                _int_attr((m,), _HEADS) is not None and name != "")
            if looks:
                candidates.append(name)

        def related(a: str, b: str) -> bool:
            return a == b or a == "" or b == "" or b.startswith(a + ".") or a.startswith(b + ".")

        for name in candidates:
            if any(related(name, acc) for acc in self.accounted):
                continue
            if any(o != name and o.startswith(name + ".") for o in candidates):
                continue  # report the innermost module only
            m = self.modules[name]
            self.classes[name] = type(m).__name__
            self.fallback(name, "attention", f"unrecognised attention layout "
                          f"({type(m).__name__}); declare its blocks with declare_block if it "
                          "has symmetries")

    def run(self) -> None:
        for name, m in self.modules.items():
            if isinstance(m, nn.MultiheadAttention):
                self.mha(name, m)
            elif self.lora(name, m) or self.channel_attention(name, m):
                continue
            elif self.separate(name, m) or self.gpt2(name, m) or self.interleaved(name, m):
                continue
            else:
                self.fused(name, m)
        for att in self.attentions:
            self.build(att)
        self.sweep()


def _signature(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


# -- frozen parts -------------------------------------------------------------------------------


def strip_frozen(
    blocks: Iterable[BlockSpec],
    frozen: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
) -> tuple[list[BlockSpec], list[Fallback]]:
    """Remove from each block the factor parts whose entries are all frozen.

    A part that is only partly frozen cannot be removed; its block is dropped and recorded
    as a fallback. A block left without a `G` or `H` part is dropped as well.
    """
    out: list[BlockSpec] = []
    fbs: list[Fallback] = []
    for b in blocks:
        keep: dict[str, list[FactorPart]] = {"G": [], "H": []}
        bad = None
        for side in ("G", "H"):
            for part in getattr(b, side):
                fz = frozen.get(part.param)
                if fz is None:
                    keep[side].append(part)
                    continue
                mask = torch.zeros(fz.shape, dtype=torch.bool, device=fz.device)
                part.mark(mask, b.heads, b.h)
                covered = fz[mask]
                if bool(covered.all()):
                    continue
                if bool(covered.any()):
                    bad = part.param
                keep[side].append(part)
        if bad is not None:
            fbs.append(Fallback(b.module, b.kind, f"part of {bad!r} is frozen by a "
                                "canonicalisation fold and part is not"))
            continue
        if not keep["G"] or not keep["H"]:
            fbs.append(Fallback(b.module, b.kind, "every part of a factor is frozen by a "
                                "canonicalisation fold"))
            continue
        if len(keep["G"]) == len(b.G) and len(keep["H"]) == len(b.H):
            out.append(b)
        else:
            out.append(replace(b, G=tuple(keep["G"]), H=tuple(keep["H"])).resolved(params))
    return out, fbs


# -- discover -------------------------------------------------------------------------------------


def _warn_fallbacks(fallbacks: list[Fallback], classes: Mapping[str, str]) -> None:
    by_module: dict[str, list[Fallback]] = {}
    for fb in fallbacks:
        by_module.setdefault(fb.module, []).append(fb)
    for module, fbs in by_module.items():
        cls = classes.get(module)
        where = f"{module or '<root>'}" + (f" ({cls})" if cls else "")
        what = "; ".join(f"[{fb.kind}] {fb.reason}" for fb in fbs)
        warnings.warn(
            f"{where}: these weights use the adaptive geometry instead of a symmetry block: "
            f"{what}. The fallbacks are recorded in the result.",
            SymmetryFallbackWarning,
            stacklevel=3,
        )


def discover(
    model: nn.Module,
    *,
    symmetry: str = "full",
    declared: Iterable[BlockSpec] = (),
    warn: bool = True,
    probe: bool = True,
    example_inputs: Any = None,
) -> Symmetries:
    """The symmetries of `model`: verified blocks, fallbacks and canonicalisation folds.

    Parameters
    ----------
    model : nn.Module
        Any model; it is only read (probes run on a float64 deep copy).
    symmetry : {"full", "paper"}
        `"full"`: every symmetry the library claims (rotary commutant, grouped heads,
        folds). `"paper"`: GL(h) per recognised head only, bias rows appended, no folds.
    declared : iterable of BlockSpec
        User blocks from [declare_block][quotient_manifolds.models.blocks.declare_block];
        validated, and probed when an example input is available.
    warn : bool
        Emit a `SymmetryFallbackWarning` per module that falls back, a `ProbeWarning` for
        claims the probe could not reach, and a `NoBlocksWarning` when nothing is found.
    probe : bool
        Check every claim with the function-preservation probe (default). `False` trusts
        the structural recognition (cheaper: no float64 copy, no forward).
    example_inputs : optional
        Input of the model for the probe: `(args, kwargs)`, a dict of keyword arguments, a
        tuple of positional arguments or a tensor. Default: built from the model
        ([example_inputs][quotient_manifolds.models.probe.example_inputs]).

    Returns
    -------
    Symmetries

    Raises
    ------
    BlockSpecError
        For an unknown `symmetry`, a malformed declared block, or a declared block the probe
        shows not to be a symmetry.
    """
    if symmetry not in SYMMETRIES:
        raise BlockSpecError(f"symmetry must be one of {SYMMETRIES}, got {symmetry!r}")
    f = _Finder(model, symmetry)
    f.run()
    params = {n: p.detach() for n, p in model.named_parameters()}
    found = [b.resolved(params) for b in f.blocks]
    decl = [b.resolved(params) for b in declared]
    records: list[ProbeRecord] = []
    blocks = list(found)
    if probe and (found or decl):
        res = probe_blocks(model, found + decl, example_inputs, input_dims=f.input_dims)
        blocks, unprobed = [], []
        for b, rec in zip(found, res[: len(found)]):
            if rec is None:
                unprobed.append(b)
                blocks.append(replace(b, note=(b.note + "; not probed").lstrip("; ")))
                continue
            records.append(rec)
            if rec.passed:
                blocks.append(b)
            else:
                group = "GL(h)" if b.group is None else type(b.group).__name__
                f.fallback(b.module, b.kind, f"the function-preservation probe rejected the "
                           f"claimed {group} block: {rec.reason}")
        for b, rec in zip(decl, res[len(found):]):
            if rec is None:
                continue
            records.append(rec)
            if not rec.passed:
                raise BlockSpecError(
                    f"the declared block {b.kind!r} ({', '.join(b.params)}) is not a symmetry "
                    f"of the model: {rec.reason}. Check the parts, offsets, heads= and h=."
                )
        if unprobed and warn:
            names = ", ".join(dict.fromkeys(b.module or "<root>" for b in unprobed))
            warnings.warn(
                f"{len(unprobed)} discovered block(s) could not be checked by the "
                f"function-preservation probe (no example input reached {names}); pass "
                "example_inputs= to discover() to verify them.",
                ProbeWarning,
                stacklevel=2,
            )
    blocks += decl
    discovered = tuple(blocks)
    fallbacks = list(f.fallbacks)
    folds: list = []
    if symmetry == "full":
        inputs = None if example_inputs is None else normalize_inputs(example_inputs)
        try:
            folds, fold_fallbacks = find_folds(model, blocks, example_inputs=inputs)
        except Exception as e:  # noqa: BLE001 — recorded and warned, never silent
            folds, fold_fallbacks = [], [Fallback("", "folds", (
                f"the search for canonicalisation folds failed ({type(e).__name__}: {e}); "
                "norm gains and bias translations are not removed; pass example_inputs="))]
        folds = list(folds)
        fallbacks += list(fold_fallbacks)
        if folds:
            sym = Symmetries(tuple(blocks), (), tuple(folds))
            _, frozen = sym.canonicalize(params)
            blocks, stripped = strip_frozen(blocks, frozen, params)
            fallbacks += stripped
    if warn and fallbacks:
        _warn_fallbacks(fallbacks, f.classes)
    if not blocks:
        fallbacks.append(Fallback("", "all", "no symmetry block detected"))
        if warn:
            warnings.warn(
                f"no symmetry block found in {type(model).__name__}; every weight uses the "
                "adaptive geometry (geodesic sharpness then equals first-order adaptive "
                "sharpness with the metric projection). Declare blocks with "
                "qm.declare_block(...) if the model has symmetries discovery does not know.",
                NoBlocksWarning,
                stacklevel=2,
            )
    return Symmetries(tuple(blocks), tuple(fallbacks), tuple(folds), tuple(records), symmetry,
                      discovered)


def discover_blocks(
    model: nn.Module,
    *,
    declared: Iterable[BlockSpec] = (),
    warn: bool = True,
    symmetry: str = "full",
    probe: bool = True,
    example_inputs: Any = None,
) -> list[BlockSpec]:
    """The verified blocks of `model` as discovered, bias rows included.

    `discover(model, ...).discovered` as a list: with `symmetry="full"` the rotary and grouped
    blocks too, with `"paper"` GL(h) per recognised head only. Unlike `discover(...).blocks`,
    the parts that canonicalisation folds freeze (key and value bias rows) are kept, as in the
    paper's factors (App. A, App. C). The parameters are those of
    [discover][quotient_manifolds.models.discovery.discover].

    Returns
    -------
    list of BlockSpec
        One spec per module and kind, covering all heads; `n` and `m` resolved.
    """
    return list(discover(model, symmetry=symmetry, declared=declared, warn=warn, probe=probe,
                         example_inputs=example_inputs).discovered)
