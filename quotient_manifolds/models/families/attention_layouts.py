r"""The attention layouts: one small recogniser per way of storing the Q/K/V/O projections.

A layout is a function `layout(scan, name, module) -> bool`: it returns `False` for a module
that is not its own; otherwise it records what it found (an
[`AttentionRecord`][quotient_manifolds.models.families.attention_layouts.AttentionRecord] with
`scan.add`, or a fallback with the reason) and returns `True`. The attention family
([`Attention`][quotient_manifolds.models.families.attention.Attention]) asks the layouts of
[`LAYOUTS`][quotient_manifolds.models.families.attention_layouts.LAYOUTS] in order for every
module, and turns the records into blocks. Built in:

* fused `in_proj_weight`, rows `[q; k; v]`, `bias_k`/`bias_v` appended:
  `nn.MultiheadAttention` (also inside `nn.Transformer`);
* channel attention (XCiT): recognised, and recorded as having no GL(h) block;
* separate projections: `q_proj`/`k_proj`/`v_proj` + `o_proj`/`out_proj`/`proj`/`dense`
  (Llama, Mistral, Qwen, BART, Whisper, CLIP, ViT, EVA); `query`/`key`/`value` + the sibling
  `output.dense` (BERT, RoBERTa, ELECTRA); `q_lin`/…/`out_lin` (DistilBERT); `q`/`k`/`v` +
  `o`/`proj` (T5, class attention);
* transposed `Conv1D`, columns `[q, k, v]`: GPT-2 `c_attn`/`c_proj` (`q_attn` for
  cross-attention);
* interleaved per head, rows `[q_0; k_0; v_0; q_1; …]` (stride $3h$): GPT-NeoX and BLOOM
  `query_key_value` + `dense`;
* fused, rows `[q (H h); k (K h); v (K h)]`: timm ViT, DeiT, Swin, BEiT (`q_bias`/`v_bias`),
  EVA (`qkv` + `proj`), `qkv_proj`, `Wqkv`.

A new layout is one function here and one line in `LAYOUTS` (or
[`register_layout`][quotient_manifolds.models.families.attention_layouts.register_layout]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

from ...errors import BlockSpecError
from ..blocks import FactorPart
from ..linear import LinearLayer, linear_layer
from ..symmetry import Scene

__all__ = [
    "LAYOUTS",
    "AttentionRecord",
    "Layout",
    "LayoutScan",
    "Projection",
    "base_layer",
    "fused",
    "gpt2",
    "interleaved",
    "multihead_attention",
    "channel_attention",
    "register_layout",
    "separate",
]

HEADS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "n_heads_q")
HEAD_DIM = ("head_dim", "attention_head_size", "head_size", "key_value_proj_dim", "d_kv")


def int_attr(objs: Sequence[object], names: Sequence[str]) -> int | None:
    """The first positive integer attribute of `objs` among `names` (`None` if none)."""
    for o in objs:
        if o is None:
            continue
        for a in names:
            v = getattr(o, a, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def is_wrapped(m: object) -> bool:
    """Whether `m` is a LoRA wrapper (a peft `LoraLayer` around a base layer)."""
    return isinstance(m, nn.Module) and hasattr(m, "base_layer") and hasattr(m, "lora_A")


def base_layer(m: object) -> object:
    """The layer a LoRA wrapper adapts (the module itself otherwise)."""
    return m.base_layer if isinstance(m, nn.Module) and is_wrapped(m) else m


@dataclass
class Projection:
    """Where one projection's per-head features live (`weight` is `None` when it is not a
    parameter of the model: the family then falls back)."""

    weight: str | None
    transposed: bool = False  # Conv1D: (in, out) storage
    offset: int = 0
    stride: int = 0
    bias: str | None = None
    bias_offset: int | None = None

    def _name(self) -> str:
        if self.weight is None:
            raise BlockSpecError(f"param must be a parameter name, got {self.weight!r}")
        return self.weight

    def part(self, stack: int = 1) -> FactorPart:
        """The rows of a projection that *produces* head features."""
        return FactorPart(self._name(), "cols" if self.transposed else "rows", self.offset,
                          self.stride, stack)

    def bias_part(self, stack: int = 1) -> FactorPart | None:
        """The bias entries of the head features (`None` without a bias)."""
        if self.bias is None:
            return None
        off = self.offset if self.bias_offset is None else self.bias_offset
        return FactorPart(self.bias, "bias", off, self.stride, stack)

    def out_part(self, stack: int = 1) -> FactorPart:
        """The rows of a projection that *consumes* head features (the output projection)."""
        return FactorPart(self._name(), "rows" if self.transposed else "cols", self.offset,
                          self.stride, stack)


@dataclass
class AttentionRecord:
    """One recognised attention module: its heads and where its projections live."""

    module: str
    cls: str
    heads: int
    kv_heads: int
    h: int
    q: Projection
    k: Projection
    v: Projection
    o: Projection | None
    layout: str = ""
    input_dim: int | None = None
    k_extra: str | None = None  # bias_k of nn.MultiheadAttention (one more key row)
    v_extra: str | None = None
    out_reason: str | None = None  # the output projection does not fit (V/O falls back)
    wrapped: dict[str, bool] = field(default_factory=lambda: {"qk": False, "vo": False})
    # set by the family's inspection
    pairs: tuple | None = None
    qk_reason: str | None = None
    vo_reason: str | None = None

    def mark_wrapped(self, qk: Sequence[object], vo: Sequence[object]) -> None:
        """Projections wrapped by LoRA adapters take their side of the attention out."""
        self.wrapped = {"qk": any(is_wrapped(x) for x in qk),
                        "vo": any(is_wrapped(x) for x in vo)}


class LayoutScan:
    """What a layout works with: the scene, the records found so far and two helpers."""

    def __init__(self, scene: Scene) -> None:
        self.scene = scene
        self.records: list[AttentionRecord] = []

    def add(self, record: AttentionRecord) -> AttentionRecord:
        """Record a recognised attention module."""
        self.records.append(record)
        return record

    def proj(self, lin: LinearLayer, offset: int = 0, stride: int = 0,
             bias_offset: int | None = None) -> Projection:
        """The projection of a linear layer's features from `offset` on."""
        return Projection(self.scene.pname(lin.weight), lin.transposed, offset, stride,
                          self.scene.pname(lin.bias), bias_offset)

    def sizes(self, m: nn.Module, q_out: int, k_out: int) -> tuple[int, int, int] | str:
        """`(heads, kv_heads, h)`: heads from the module (or its config), the head size from
        the module or the query width, the key/value heads from the key width; a reason string
        if they do not fit."""
        cfg = getattr(m, "config", None)
        heads = int_attr((m,), HEADS) or int_attr((cfg,), HEADS)
        if heads is None:
            return "cannot read the number of heads"
        h = int_attr((m,), HEAD_DIM)
        if h is None:
            ch = int_attr((cfg,), ("head_dim",))
            h = ch if ch and ch * heads == q_out else (
                q_out // heads if q_out % heads == 0 else None)
        if h is None:
            return f"query width {q_out} is not a multiple of {heads} heads"
        kv = k_out // h if k_out % h == 0 else 0
        if kv < 1 or heads % kv:
            return f"key width {k_out} is not a divisor of {heads} heads x {h}"
        return heads, kv, h


Layout = Callable[[LayoutScan, str, nn.Module], bool]
"""`layout(scan, name, module) -> bool`: whether the module is this layout's (see above)."""


def multihead_attention(scan: LayoutScan, name: str, m: nn.Module) -> bool:
    """`nn.MultiheadAttention`: fused or separate input projections, `bias_k`/`bias_v`."""
    if not isinstance(m, nn.MultiheadAttention):
        return False
    sc = scan.scene
    sc.account(name, m)
    d, heads, dh = m.embed_dim, m.num_heads, m.head_dim
    b = sc.pname(m.in_proj_bias)
    if m._qkv_same_embed_dim:
        W = sc.pname(m.in_proj_weight)
        q, k, v = (Projection(W, False, o, 0, b, o) for o in (0, d, 2 * d))
    else:
        q, k, v = (Projection(sc.pname(w), False, 0, 0, b, o) for w, o in (
            (m.q_proj_weight, 0), (m.k_proj_weight, d), (m.v_proj_weight, 2 * d)))
    scan.add(AttentionRecord(
        name, type(m).__name__, heads, heads, dh, q, k, v,
        Projection(sc.pname(m.out_proj.weight)),
        layout="fused in_proj" if m._qkv_same_embed_dim else "separate q/k/v_proj_weight",
        input_dim=d, k_extra=sc.pname(m.bias_k), v_extra=sc.pname(m.bias_v)))
    return True


def channel_attention(scan: LayoutScan, name: str, m: nn.Module) -> bool:
    """Cross-covariance attention (XCiT): recognised, with no GL(h) block."""
    if not (isinstance(getattr(m, "temperature", None), nn.Parameter)
            and linear_layer(getattr(m, "qkv", None)) is not None):
        return False
    scan.scene.account(name, m)
    scan.scene.fallback(name, "attention", "channel attention (cross-covariance attention, "
                        "XCiT): each head attends over its channels, with q and k L2-normalised "
                        "along the tokens; neither Q/K nor V/O has a GL(h) symmetry")
    return True


_SEPARATE = (("q_proj", "k_proj", "v_proj", ("o_proj", "out_proj", "proj", "dense")),
             ("query", "key", "value", ("dense", "out_proj", "o_proj")),
             ("query_proj", "key_proj", "value_proj", ("dense", "out_proj")),
             ("q_lin", "k_lin", "v_lin", ("out_lin",)),
             ("q", "k", "v", ("o", "proj", "out")))


def separate(scan: LayoutScan, name: str, m: nn.Module) -> bool:
    """Separate query, key, value and output projections (`nn.Linear`, possibly wrapped)."""
    for qn, kn, vn, outs in _SEPARATE:
        mods = [getattr(m, a, None) for a in (qn, kn, vn)]
        if not all(isinstance(x, nn.Module) for x in mods):
            continue
        out = next((getattr(m, a) for a in outs if isinstance(getattr(m, a, None), nn.Module)),
                   None)
        out_where = next((a for a in outs if getattr(m, a, None) is out), "")
        if out is None and qn in ("query", "query_proj"):  # BERT: a sibling output
            parent = scan.scene.modules.get(name.rsplit(".", 1)[0] if "." in name else "")
            out = getattr(getattr(parent, "output", None), "dense", None)
            out_where = "sibling output.dense"
        lins = [linear_layer(base_layer(x)) for x in mods]
        if any(x is None for x in lins):
            continue
        lq, lk, lv = (x for x in lins if x is not None)
        att = _separate_record(scan, name, m, (lq, lk, lv), linear_layer(base_layer(out)),
                               f"separate {qn}/{kn}/{vn} + {out_where}")
        if att is not None:
            att.mark_wrapped(mods[:2], [mods[2], out])
        return True
    return False


def _separate_record(scan: LayoutScan, name: str, m: nn.Module,
                     lins: tuple[LinearLayer, LinearLayer, LinearLayer],
                     out: LinearLayer | None, layout: str) -> AttentionRecord | None:
    lq, lk, lv = lins
    sizes = scan.sizes(m, lq.out_features, lk.out_features)
    sc = scan.scene
    sc.account(name, m)
    if isinstance(sizes, str):
        sc.fallback(name, "attention", sizes)
        return None
    heads, kv, h = sizes
    if lq.out_features != heads * h:
        what = "gated queries (the query projection also produces a gate)" if (
            lq.out_features == 2 * heads * h) else (
            f"query width {lq.out_features} != {heads} heads x {h}")
        sc.fallback(name, "attention", what)
        return None
    if lk.out_features != kv * h or lv.out_features != kv * h:
        sc.fallback(name, "attention", f"key/value widths {lk.out_features}/{lv.out_features} "
                    f"do not match {kv} key/value heads x {h}")
        return None
    o, reason = None, None
    if out is None:
        reason = "no output projection found"
    elif out.in_features != heads * h:
        reason = f"the output projection reads {out.in_features} features, not {heads} x {h}"
    else:
        o = scan.proj(out)
    return scan.add(AttentionRecord(name, type(m).__name__, heads, kv, h, scan.proj(lq),
                                    scan.proj(lk), scan.proj(lv), o, layout=layout,
                                    input_dim=lq.in_features, out_reason=reason))


def gpt2(scan: LayoutScan, name: str, m: nn.Module) -> bool:
    """GPT-2: a transposed `Conv1D` `c_attn` with columns `[q, k, v]` (`q_attn` + `c_attn`
    `[k, v]` for cross-attention) and `c_proj`."""
    mods = [getattr(m, "c_attn", None), getattr(m, "c_proj", None)]
    if not all(isinstance(x, nn.Module) for x in mods):
        return False
    c_attn, c_proj = linear_layer(base_layer(mods[0])), linear_layer(base_layer(mods[1]))
    if c_attn is None or c_proj is None or not c_attn.transposed:
        return False
    q_attn = linear_layer(base_layer(getattr(m, "q_attn", None)))
    cross = bool(getattr(m, "is_cross_attention", False)) and q_attn is not None
    d = c_attn.out_features // (2 if cross else 3)
    sizes = scan.sizes(m, d, d)
    sc = scan.scene
    sc.account(name, m)
    if isinstance(sizes, str):
        sc.fallback(name, "attention", sizes)
        return True
    heads, kv, h = sizes
    if heads * h != d or kv != heads or c_proj.in_features != d:
        sc.fallback(name, "attention", "c_attn/c_proj widths do not match heads x head_dim")
        return True
    if cross:
        assert q_attn is not None
        q, k, v = scan.proj(q_attn), scan.proj(c_attn, 0), scan.proj(c_attn, d)
    else:
        q, k, v = (scan.proj(c_attn, o) for o in (0, d, 2 * d))
    att = scan.add(AttentionRecord(
        name, type(m).__name__, heads, heads, h, q, k, v, scan.proj(c_proj),
        layout="transposed Conv1D c_attn/c_proj" + (" (cross)" if cross else ""),
        input_dim=c_attn.in_features))
    att.mark_wrapped([mods[0], getattr(m, "q_attn", None)], mods)
    return True


def interleaved(scan: LayoutScan, name: str, m: nn.Module) -> bool:
    """GPT-NeoX and BLOOM: `query_key_value` with rows `[q_0; k_0; v_0; q_1; …]` (stride
    $3h$) and `dense`."""
    mods = [getattr(m, "query_key_value", None), getattr(m, "dense", None)]
    if not all(isinstance(x, nn.Module) for x in mods):
        return False
    qkv, dense = linear_layer(base_layer(mods[0])), linear_layer(base_layer(mods[1]))
    if qkv is None or dense is None:
        return False
    sc = scan.scene
    sc.account(name, m)
    if not any(k in type(m).__module__ for k in (".gpt_neox.", ".bloom.")):
        sc.fallback(name, "attention", f"fused query_key_value of {type(m).__name__}: its "
                    "head layout is not known to discovery")
        return True
    sizes = scan.sizes(m, qkv.out_features // 3, qkv.out_features // 3)
    if isinstance(sizes, str):
        sc.fallback(name, "attention", sizes)
        return True
    heads, kv, h = sizes
    if kv != heads or qkv.out_features != 3 * heads * h or dense.in_features != heads * h:
        sc.fallback(name, "attention", "query_key_value/dense widths do not match "
                    "3 x heads x head_dim")
        return True
    q, k, v = (scan.proj(qkv, o, 3 * h) for o in (0, h, 2 * h))
    att = scan.add(AttentionRecord(name, type(m).__name__, heads, heads, h, q, k, v,
                                   scan.proj(dense),
                                   layout="interleaved per-head query_key_value + dense",
                                   input_dim=qkv.in_features))
    att.mark_wrapped(mods[:1], mods)
    return True


_FUSED = (("qkv", ("proj", "out_proj", "o_proj")), ("qkv_proj", ("o_proj",)),
          ("Wqkv", ("Wo", "out_proj")), ("c_attn", ("c_proj",)))


def fused(scan: LayoutScan, name: str, m: nn.Module) -> bool:
    """One fused projection with rows `[q (H h); k (K h); v (K h)]` and an output projection
    (timm's separate `q_bias`/`v_bias` of BEiT and EVA included)."""
    sc = scan.scene
    for qn, outs in _FUSED:
        qm = getattr(m, qn, None)
        outm = next((getattr(m, a) for a in outs if isinstance(getattr(m, a, None), nn.Module)),
                    None)
        if not isinstance(qm, nn.Module) or outm is None:
            continue
        lin, out = linear_layer(base_layer(qm)), linear_layer(base_layer(outm))
        if lin is None or out is None:
            continue
        cfg = getattr(m, "config", None)
        heads = int_attr((m,), HEADS) or int_attr((cfg,), HEADS)
        if heads is None:
            continue
        sc.account(name, m)
        h = int_attr((m,), HEAD_DIM) or (out.in_features // heads
                                         if out.in_features % heads == 0 else 0)
        rest = lin.out_features // h - heads if h and lin.out_features % h == 0 else -1
        kv = rest // 2 if rest > 0 and rest % 2 == 0 else 0
        if (kv < 1 or heads % kv or lin.out_features != (heads + 2 * kv) * h
                or out.in_features != heads * h):
            sc.fallback(name, "attention", f"{qn}/{outs[0]} widths ({lin.out_features}, "
                        f"{out.in_features}) do not match {heads} query heads and equal "
                        "key/value head counts")
            return True
        a, c = heads * h, kv * h
        q, k, v = (scan.proj(lin, o) for o in (0, a, a + c))
        qb = sc.pname(getattr(m, "q_bias", None))
        if lin.bias is None and qb is not None:  # BEiT/EVA: separate q/v biases, no k bias
            q.bias, q.bias_offset = qb, 0
            kb = getattr(m, "k_bias", None)
            k.bias, k.bias_offset = sc.pname(kb) if isinstance(kb, nn.Parameter) else None, 0
            v.bias, v.bias_offset = sc.pname(getattr(m, "v_bias", None)), 0
        oname = next(x for x in outs if getattr(m, x, None) is outm)
        att = scan.add(AttentionRecord(name, type(m).__name__, heads, kv, h, q, k, v,
                                       scan.proj(out), layout=f"fused {qn} + {oname}",
                                       input_dim=lin.in_features))
        att.mark_wrapped([qm], [qm, outm])
        return True
    return False


LAYOUTS: list[Layout] = [multihead_attention, channel_attention, separate, gpt2, interleaved,
                         fused]
"""The layouts, asked in order for every module (the first that claims a module has it)."""


def register_layout(layout: Layout, *, index: int = 0) -> None:
    """Ask `layout` before the layouts after `index` (default: before every other one)."""
    if not callable(layout):
        raise TypeError(f"a layout must be callable, got {layout!r}")
    LAYOUTS.insert(index, layout)
