r"""Attention: GL(h) per head on Q/K and on V/O, the rotary subgroup, grouped K/V heads.

Scores $q_i^\top k_j = x_i^\top W_Q W_K^\top x_j$ and outputs $\sum_j a_{ij} W_O W_V x_j$ see
the projections only through $W_Q W_K^\top$ and $W_V W_O$ per head, so per head $i$ (paper
App. A, App. C) $G_{QK} = [W_q[r_i,:]^\top; b_q[r_i]]$, $H_{QK} = [W_k[r_i,:]^\top; b_k[r_i]]$,
$G_{VO} = [W_v[r_i,:]^\top; b_v[r_i]]$, $H_{VO} = W_o[:, r_i]$ (a missing bias means no row)
are GL(h) blocks. Cross-attention is the same with keys/values read from the encoder states.

The [`Attention`][quotient_manifolds.models.families.attention.Attention] family asks the
layouts of [`attention_layouts`][quotient_manifolds.models.families.attention_layouts] which
modules are attention and where their projections live, inspects each recognised module, and
claims its blocks. With `symmetry="complete"` (and `"full"`) it also claims

* grouped K/V heads (GQA/MQA): one block per key/value head; its $G_{QK}$ stacks the query
  heads that read it, its $H_{VO}$ stacks their output columns;
* rotary position embeddings: the Q/K block keeps only the rotations' commutant
  ([RotaryCommutant][quotient_manifolds.geometry.subgroup.RotaryCommutant]), with the pairs
  read from the model (rotate-half $(i, i + r/2)$ or interleaved $(2i, 2i+1)$ on the first $r$
  rotary dimensions; the others are free).

`symmetry="paper"` claims GL(h) per recognised head only, with the bias rows appended (the
paper's measure); rotary and grouped heads then fall back.

What does not get a block (a fallback with the reason): q/k normalisation (its Q/K keeps only
gain exchanges and orthogonal maps; the q/k-norm family claims the gain exchange), a norm or
gate between the attention output and the output projection (no V/O block), learned relative
position keys, channel attention (XCiT), projections wrapped by LoRA adapters (the adapters'
own GL(r) blocks are claimed), fused layouts we cannot read, and any other module that looks
like attention.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Mapping
from typing import TypeGuard

import torch
from torch import nn

from ...errors import BlockSpecError
from ...manifolds import RotaryCommutant
from ..blocks import BlockSpec, FactorPart
from ..inputs import signature_names
from ..symmetry import Scene, SymmetryFamily
from . import attention_layouts as layouts
from .attention_layouts import HEADS, AttentionRecord, LayoutScan, int_attr

__all__ = ["Attention", "rope_pairs"]

_QK_NORMS = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"),
             ("query_layernorm", "key_layernorm"), ("q_ln", "k_ln"))
_VO_BREAKS = ("norm", "gate", "sub_norm", "attn_sub_norm", "inner_attn_ln", "o_norm")
_ROTARY_USE = re.compile(r"apply_rotary|rotary_emb|rotate_half|rotate_every_two|\brope\b")
_WRAPPED = ("projections wrapped by LoRA adapters: the head symmetry would move the base "
            "weights together with lora_B (with the base weights frozen it is no symmetry of "
            "the trained parameters); the adapters' own GL(r) blocks are claimed instead")


def _active(m: object) -> TypeGuard[nn.Module]:
    return isinstance(m, nn.Module) and not isinstance(m, (nn.Identity, nn.Dropout))


def _source(obj: object) -> str:
    try:
        return inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


def _describe_norm(m: nn.Module) -> str:
    w = getattr(m, "weight", None)
    size = f" over {w.numel()} features" if isinstance(w, torch.Tensor) else ""
    return f"{type(m).__name__}{size}"


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


class Attention(SymmetryFamily):
    """GL(h) blocks of every recognised attention module (see the module docstring)."""

    name = "attention"
    kind = "blocks"
    symmetries = ("complete", "full", "paper")

    def find(self, scene: Scene) -> None:
        scan = LayoutScan(scene)
        for name, m in scene.modules.items():
            if name in scene.accounted:
                continue
            for layout in layouts.LAYOUTS:
                if layout(scan, name, m):
                    break
        for att in scan.records:
            self._inspect(scene, att, scene.modules[att.module])
            if att.out_reason and not att.vo_reason:
                att.vo_reason = att.out_reason
            if att.wrapped["qk"]:
                att.qk_reason = _WRAPPED
            if att.wrapped["vo"]:
                att.vo_reason = _WRAPPED
        for att in scan.records:
            self._build(scene, att)

    def _inspect(self, scene: Scene, att: AttentionRecord, m: nn.Module) -> None:
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
        pairs = self._rotary(scene, att.module, m, att.h)
        if isinstance(pairs, str):
            att.qk_reason = att.qk_reason or pairs
        else:
            att.pairs = pairs

    def _rotary(self, scene: Scene, name: str, m: nn.Module, h: int):
        """Rotary pairs of `m` (`None`: no rotary embedding), or a reason string."""
        if hasattr(m, "rotate_half") and "rope" in signature_names(type(m).forward):
            # timm (EVA, AttentionRope): rope is passed in by the model when it has one
            if not self._model_has_rope(scene, name):
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
        r = int_attr((m,), ("rotary_ndims", "rotary_dim", "rotary_emb_dim"))
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

    @staticmethod
    def _model_has_rope(scene: Scene, name: str) -> bool:
        """Whether an ancestor of `name` holds a rotary embedding module (timm: `model.rope`)."""
        parts = name.split(".") if name else []
        for i in range(len(parts)):
            anc = scene.modules.get(".".join(parts[:i]))
            if isinstance(getattr(anc, "rope", None), nn.Module):
                return True
        return False

    # -- blocks -----------------------------------------------------------------------------
    @staticmethod
    def _build(scene: Scene, att: AttentionRecord) -> None:
        r = att.heads // att.kv_heads
        grouped = r > 1
        paper = scene.symmetry == "paper"
        name = att.module
        note = att.layout
        not_param = ("a projection weight is not a parameter of the model (a buffer or a tensor "
                     "attribute)")
        if not att.qk_reason and (att.q.weight is None or att.k.weight is None):
            att.qk_reason = not_param
        if not att.vo_reason and (att.v.weight is None or (att.o and att.o.weight is None)):
            att.vo_reason = not_param
        if att.qk_reason:
            scene.fallback(name, "attention.qk", att.qk_reason)
        elif paper and att.pairs:
            scene.fallback(name, "attention.qk", "rotary position embeddings: only the "
                          "rotations' commutant acts on Q/K, and the paper's measure claims "
                          "full GL(h) blocks only (symmetry='full' claims the commutant)")
        elif paper and grouped:
            scene.fallback(name, "attention.qk", f"grouped K/V heads ({att.kv_heads} for "
                          f"{att.heads} query heads; symmetry='full' claims them)")
        else:
            group = RotaryCommutant(att.h, tuple(att.pairs)) if att.pairs else None
            G: tuple[FactorPart | None, ...] = (att.q.part(r), att.q.bias_part(r))
            H = (att.k.part(), att.k.bias_part(),
                 FactorPart(att.k_extra, "bias") if att.k_extra else None)
            scene.claim(BlockSpec(
                "attention.qk", name, att.kv_heads, att.h, tuple(p for p in G if p),
                tuple(p for p in H if p), note=note, group=group), att.input_dim)
        if att.vo_reason:
            scene.fallback(name, "attention.vo", att.vo_reason)
        elif paper and grouped:
            scene.fallback(name, "attention.vo", f"grouped K/V heads ({att.kv_heads} for "
                          f"{att.heads} query heads; symmetry='full' claims them)")
        elif att.o is None:
            scene.fallback(name, "attention.vo", "no output projection found")
        else:
            G = (att.v.part(), att.v.bias_part(),
                 FactorPart(att.v_extra, "bias") if att.v_extra else None)
            scene.claim(BlockSpec(
                "attention.vo", name, att.kv_heads, att.h, tuple(p for p in G if p),
                (att.o.out_part(r),), note=note), att.input_dim)

    def finish(self, scene: Scene) -> None:
        """Record every module that looks like attention but was not recognised."""
        pattern = re.compile(r"attention|attn|xca", re.IGNORECASE)
        candidates = []
        for name, m in scene.modules.items():
            if name in scene.accounted or not any(True for _ in m.parameters()):
                continue
            looks = bool(pattern.search(type(m).__name__)) or (
                int_attr((m,), HEADS) is not None and name != "")
            if looks:
                candidates.append(name)

        def related(a: str, b: str) -> bool:
            return a == b or a == "" or b == "" or b.startswith(a + ".") or a.startswith(b + ".")

        for name in candidates:
            if any(related(name, acc) for acc in scene.accounted):
                continue
            if any(o != name and o.startswith(name + ".") for o in candidates):
                continue  # report the innermost module only
            m = scene.modules[name]
            scene.classes[name] = type(m).__name__
            scene.fallback(name, "attention", f"unrecognised attention layout "
                           f"({type(m).__name__}); declare its blocks with declare_block if "
                           "it has symmetries")
