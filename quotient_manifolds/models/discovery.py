r"""Symmetry discovery: find the GL(h) blocks of a PyTorch model (spec §3.4, §4).

Supported module families (each is recognised by its structure, not its name):

* ``torch.nn.MultiheadAttention`` — fused ``in_proj_weight`` or separate
  ``q/k/v_proj_weight`` (``kdim``/``vdim`` ≠ ``embed_dim``), ``in_proj_bias``,
  ``bias_k``/``bias_v`` and ``out_proj``; ``batch_first`` does not matter.
* Hugging Face BERT-family self-attention: ``query``/``key``/``value`` in the
  attention module and ``output.dense`` in its parent (spec §4.1).
* Hugging Face ``q_proj``/``k_proj``/``v_proj`` + ``o_proj``/``out_proj``
  attention (ViT in transformers ≥ 5, CLIP, BART, LLaMA, …).
* timm ``Attention``: fused ``qkv`` with rows ``[q; k; v]`` and ``proj``.
* peft LoRA layers: ``G = lora_B.weight`` (``d_out × r``), ``H = lora_A.weightᵀ``
  (``d_in × r``); the scaling ``α/r`` does not affect the symmetry (spec §4.3).

Per head ``i`` (rows ``r_i`` of the projection):
``G_QK = [W_q[r_i,:]ᵀ; b_q[r_i]ᵀ]``, ``H_QK = [W_k[r_i,:]ᵀ; b_k[r_i]ᵀ]``,
``G_VO = [W_v[r_i,:]ᵀ; b_v[r_i]ᵀ]``, ``H_VO = W_o[:, r_i]``; a missing bias
means no appended row.

Where the full GL symmetry does not hold, the weights fall back to the adaptive
geometry and a :class:`~quotient_manifolds.errors.SymmetryFallbackWarning` is
emitted once per discovery:

* rotary position embeddings (only rotations commuting with RoPE survive on Q/K);
* grouped / multi-query K/V heads (K and V are shared across query heads);
* per-head normalisation of q/k (``q_norm``/``k_norm``) or of the attention
  output before the output projection, gated attention outputs;
* relative position embeddings of BERT (``position_embedding_type != "absolute"``);
* attention projections wrapped by another module (e.g. a LoRA wrapper: the
  symmetry then acts on ``W + s·BA`` jointly, not on the base weights).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from torch import nn

from ..errors import NoBlocksWarning, SymmetryFallbackWarning
from .blocks import BlockSpec, FactorPart

__all__ = ["Fallback", "discover_blocks", "discover"]


@dataclass(frozen=True)
class Fallback:
    """Weights that lack the full GL symmetry and use the adaptive geometry instead."""

    module: str
    kind: str
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def _is_linear(m) -> bool:
    return isinstance(m, nn.Linear)


def _not_identity(m) -> bool:
    return m is not None and not isinstance(m, nn.Identity)


def _has_rotary(mod: nn.Module) -> bool:
    name = type(mod).__name__.lower()
    if "rope" in name or "rotary" in name:
        return True
    for attr in ("rotary_emb", "rotary", "rope", "rotary_fn"):
        if getattr(mod, attr, None) is not None:
            return True
    cfg = getattr(mod, "config", None)
    if cfg is not None:
        if getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_theta", None):
            return True
        if getattr(cfg, "position_embedding_type", None) == "rotary":
            return True
        if getattr(cfg, "rotary_dim", None) or getattr(cfg, "rotary_pct", None):
            return True
    return False


class _Finder:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.modules = dict(model.named_modules())
        self.blocks: list[BlockSpec] = []
        self.fallbacks: list[Fallback] = []

    def pname(self, t) -> str | None:
        return None if t is None else self.names.get(id(t))

    @staticmethod
    def path(prefix: str, name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    def add(self, kind, module, heads, h, G, H, note=""):
        G = tuple(p for p in G if p is not None)
        H = tuple(p for p in H if p is not None)
        self.blocks.append(BlockSpec(kind, module, heads, h, G, H, note=note))

    def fallback(self, module, kind, reason):
        self.fallbacks.append(Fallback(module, kind, reason))

    def part(self, t, layout, offset=0):
        name = self.pname(t)
        return None if name is None else FactorPart(name, layout, offset)

    # -- families ---------------------------------------------------------
    def mha(self, name: str, m: nn.MultiheadAttention) -> None:
        d, heads, dh = m.embed_dim, m.num_heads, m.head_dim
        if m._qkv_same_embed_dim:
            W = m.in_proj_weight
            q, k, v = (self.part(W, "rows", o) for o in (0, d, 2 * d))
        else:
            q = self.part(m.q_proj_weight, "rows")
            k = self.part(m.k_proj_weight, "rows")
            v = self.part(m.v_proj_weight, "rows")
        b = m.in_proj_bias
        bq, bk, bv = (self.part(b, "bias", o) for o in (0, d, 2 * d)) if b is not None else (
            None, None, None)
        ek = self.part(m.bias_k, "bias") if m.bias_k is not None else None
        ev = self.part(m.bias_v, "bias") if m.bias_v is not None else None
        o = self.part(m.out_proj.weight, "cols")
        self.add("attention.qk", name, heads, dh, (q, bq), (k, bk, ek))
        self.add("attention.vo", name, heads, dh, (v, bv, ev), (o,))

    def bert(self, name: str, m: nn.Module) -> bool:
        if not all(hasattr(m, a) for a in ("query", "key", "value")):
            return False
        heads = getattr(m, "num_attention_heads", None)
        dh = getattr(m, "attention_head_size", None)
        if heads is None or dh is None:
            return False
        if not all(_is_linear(getattr(m, a)) for a in ("query", "key", "value")):
            self.fallback(name, "attention", "attention projections are wrapped (e.g. by "
                          "LoRA); the GL symmetry acts on the wrapped weights jointly")
            return True
        pos = getattr(m, "position_embedding_type", "absolute")
        qk_ok = pos in (None, "absolute")
        if not qk_ok:
            self.fallback(name, "attention.qk", f"position_embedding_type={pos!r} "
                          "breaks the GL(d_k) symmetry of Q/K")
        elif _has_rotary(m):
            qk_ok = False
            self.fallback(name, "attention.qk", "rotary position embeddings")
        if qk_ok:
            self.add("attention.qk", name, heads, dh,
                     (self.part(m.query.weight, "rows"), self.part(m.query.bias, "bias")),
                     (self.part(m.key.weight, "rows"), self.part(m.key.bias, "bias")))
        parent = self.modules.get(name.rsplit(".", 1)[0] if "." in name else "")
        dense = getattr(getattr(parent, "output", None), "dense", None)
        if parent is not None and _is_linear(dense) and dense.in_features == heads * dh:
            self.add("attention.vo", name, heads, dh,
                     (self.part(m.value.weight, "rows"), self.part(m.value.bias, "bias")),
                     (self.part(dense.weight, "cols"),),
                     note=f"output projection {self.pname(dense.weight)}")
        else:
            self.fallback(name, "attention.vo", "no sibling output.dense projection found")
        return True

    def hf_proj(self, name: str, m: nn.Module) -> bool:
        if not all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj")):
            return False
        o = getattr(m, "o_proj", None) or getattr(m, "out_proj", None)
        projs = (m.q_proj, m.k_proj, m.v_proj, o)
        if not all(_is_linear(p) for p in projs):
            self.fallback(name, "attention", "attention projections are not plain nn.Linear "
                          "(wrapped, e.g. by LoRA, or missing)")
            return True
        cfg = getattr(m, "config", None)
        heads = (getattr(m, "num_heads", None) or getattr(m, "num_attention_heads", None)
                 or getattr(cfg, "num_attention_heads", None))
        if not heads:
            return False
        dh = getattr(m, "head_dim", None) or m.q_proj.out_features // heads
        kv_heads = m.k_proj.out_features // dh
        if kv_heads != heads or m.v_proj.out_features != heads * dh:
            self.fallback(name, "attention.qk+vo", f"grouped K/V heads ({kv_heads} K/V heads "
                          f"for {heads} query heads)")
            return True
        if _has_rotary(m):
            self.fallback(name, "attention.qk", "rotary position embeddings")
        elif _not_identity(getattr(m, "q_norm", None)) or _not_identity(getattr(m, "k_norm", None)):
            self.fallback(name, "attention.qk", "q/k normalisation")
        else:
            self.add("attention.qk", name, heads, dh,
                     (self.part(m.q_proj.weight, "rows"), self.part(m.q_proj.bias, "bias")),
                     (self.part(m.k_proj.weight, "rows"), self.part(m.k_proj.bias, "bias")))
        self.add("attention.vo", name, heads, dh,
                 (self.part(m.v_proj.weight, "rows"), self.part(m.v_proj.bias, "bias")),
                 (self.part(o.weight, "cols"),))
        return True

    def timm(self, name: str, m: nn.Module) -> bool:
        if not (_is_linear(getattr(m, "qkv", None)) and _is_linear(getattr(m, "proj", None))):
            return False
        heads = getattr(m, "num_heads", None)
        if not heads:
            return False
        dh = getattr(m, "head_dim", None) or m.qkv.out_features // (3 * heads)
        a = heads * dh
        if m.qkv.out_features != 3 * a or m.proj.in_features != a:
            self.fallback(name, "attention", "qkv/proj shapes do not match num_heads·head_dim")
            return True
        W, b = m.qkv.weight, m.qkv.bias
        if b is not None:
            bq, bk, bv = (self.part(b, "bias", o) for o in (0, a, 2 * a))
        else:  # BEiT-style separate q/v biases (k has none)
            bq = self.part(getattr(m, "q_bias", None), "bias")
            bv = self.part(getattr(m, "v_bias", None), "bias")
            bk = None
        if _has_rotary(m):
            self.fallback(name, "attention.qk", "rotary position embeddings")
        elif _not_identity(getattr(m, "q_norm", None)) or _not_identity(getattr(m, "k_norm", None)):
            self.fallback(name, "attention.qk", "q/k normalisation (qk_norm)")
        else:
            self.add("attention.qk", name, heads, dh,
                     (self.part(W, "rows", 0), bq), (self.part(W, "rows", a), bk))
        if _not_identity(getattr(m, "norm", None)) or getattr(m, "gate", None) is not None:
            self.fallback(name, "attention.vo", "normalisation or gating between attention "
                          "output and proj")
        else:
            self.add("attention.vo", name, heads, dh,
                     (self.part(W, "rows", 2 * a), bv), (self.part(m.proj.weight, "cols"),))
        return True

    def lora(self, name: str, m: nn.Module) -> bool:
        A, B = getattr(m, "lora_A", None), getattr(m, "lora_B", None)
        if not (isinstance(A, nn.ModuleDict) and isinstance(B, nn.ModuleDict)):
            return False
        for key in A.keys():
            if key not in B or not (_is_linear(A[key]) and _is_linear(B[key])):
                continue
            r = A[key].out_features
            self.add("lora", name, 1, r, (self.part(B[key].weight, "cols"),),
                     (self.part(A[key].weight, "rows"),), note=f"adapter {key!r}")
        return True

    def run(self) -> None:
        for name, m in self.model.named_modules():
            if isinstance(m, nn.MultiheadAttention):
                self.mha(name, m)
                continue
            if self.lora(name, m) or self.bert(name, m) or self.hf_proj(name, m):
                continue
            self.timm(name, m)


def discover(
    model: nn.Module, *, symmetry: str = "full", declared: Iterable[BlockSpec] = (),
    warn: bool = True
) -> tuple[list[BlockSpec], list[Fallback]]:
    """Blocks and fallbacks of ``model``; declared blocks are appended and validated.

    ``symmetry`` is ``"full"`` (every symmetry the library recognises) or ``"paper"`` (GL(h)
    per recognised head, the paper's measure); today both find the same blocks.
    Emits one :class:`SymmetryFallbackWarning` if any weights fall back, and a
    :class:`NoBlocksWarning` if no block is found at all (when ``warn``).
    """
    if symmetry not in ("full", "paper"):
        raise ValueError(f"symmetry must be 'full' or 'paper', got {symmetry!r}")
    f = _Finder(model)
    f.run()
    params = dict(model.named_parameters())
    blocks = [b.resolved(params) for b in f.blocks] + [b.resolved(params) for b in declared]
    fallbacks = list(f.fallbacks)
    if warn and fallbacks:
        summary = "; ".join(f"{fb.module or '<root>'} [{fb.kind}]: {fb.reason}"
                            for fb in fallbacks[:3])
        more = f" (and {len(fallbacks) - 3} more)" if len(fallbacks) > 3 else ""
        warnings.warn(
            f"{len(fallbacks)} module(s) lack the full GL symmetry and use the adaptive "
            f"geometry instead: {summary}{more}. The fallbacks are recorded in the result.",
            SymmetryFallbackWarning,
            stacklevel=3,
        )
    if not blocks:
        fallbacks.append(Fallback("", "all", "no GL block detected"))
        if warn:
            warnings.warn(
                f"no GL block found in {type(model).__name__}; every weight uses the adaptive "
                "geometry (geodesic sharpness then equals first-order adaptive sharpness with "
                "the metric projection). Declare blocks with qm.declare_block(...) if the "
                "model has symmetries discovery does not know.",
                NoBlocksWarning,
                stacklevel=3,
            )
    return blocks, fallbacks


def discover_blocks(
    model: nn.Module, *, declared: Iterable[BlockSpec] = (), warn: bool = True
) -> list[BlockSpec]:
    """The GL(h) blocks of ``model`` (see the module docstring for the families).

    Parameters
    ----------
    model : nn.Module
        Any model; it is only read.
    declared : iterable of BlockSpec
        User blocks from :func:`~quotient_manifolds.models.blocks.declare_block`.
    warn : bool
        Emit the fallback / no-block warnings.

    Returns
    -------
    list of BlockSpec
        One spec per module and kind, covering all heads; ``n`` and ``m`` resolved.
    """
    return discover(model, declared=declared, warn=warn)[0]


