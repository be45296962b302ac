r"""Independent constructions of every symmetry the complete group claims, for the acceptance
test `test_zoo_invariance.py`: one function per claimed kind, in the table `CONSTRUCTIONS`.

A construction edits the parameters of a model copy in place by a random element of the
claimed group, written here from the structure of the model (its config: head counts, head
size, rotary dimensions; its module types and parameter names; numerical tests of a norm's gain
offset and centring) and the roles the claim names (which norm, which consumer rows, which
stream parts), never through the library's `act`, `act_at` or `reparametrize`. A claim that
is not a symmetry then changes the outputs; a measure that is not invariant then moves.

Translation orbits are walked far: entries $10/\sqrt{\text{fan-in}}$ on the weights (fan-in 1
for biases, norm shifts and table rows). Scalings and GL elements are well conditioned
($U \operatorname{diag}(e^{z/2}) V^\top$ with Haar $U, V$), signs included where the group has
them.

**Adding a family**: write `def my_kind(ctx, claim)` (edit `ctx.P` in place) and add it to
`CONSTRUCTIONS` under `claim_key(claim)`; the coverage test names the missing key.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quotient_manifolds.models.precision import float64_internals

__all__ = ["CONSTRUCTIONS", "Ctx", "claim_key", "claim_params", "is_loss_claim"]

SCALE = 10.0  # translations: entries SCALE / sqrt(fan-in)


# -- claims ---------------------------------------------------------------------------------
def is_block(claim: Any) -> bool:
    return hasattr(claim, "G") and hasattr(claim, "H")


def claim_key(claim: Any) -> str:
    """The construction-table key of a claim: block kind and group, or fold kind and class."""
    if is_block(claim):
        group = "GL" if claim.group is None else type(claim.group).__name__
        return f"block {claim.kind} [{group}]"
    return f"fold {claim.kind} [{type(claim).__name__}]"


def is_loss_claim(claim: Any) -> bool:
    """A symmetry of the loss only (the logits move, the log-probabilities do not)."""
    return getattr(claim, "invariant", "outputs") == "loss"


def claim_params(claim: Any) -> set[str]:
    if is_block(claim):
        return {p.param for p in (*claim.G, *claim.H)}
    return set(claim.params)


# -- random elements --------------------------------------------------------------------------
@dataclass
class Ctx:
    """A model copy being moved: its live parameters `P` (edited in place), the claims of the
    complete group on it, and one generator for every random draw."""

    model: nn.Module
    claims: list
    seed: int = 0
    P: dict[str, torch.Tensor] = field(init=False)
    modules: dict[str, nn.Module] = field(init=False)
    g: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.P = {n: p.data for n, p in self.model.named_parameters()}
        self.modules = dict(self.model.named_modules())
        self.g = torch.Generator().manual_seed(self.seed)

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=self.g, dtype=torch.float64) * scale

    def signs(self, n: int) -> torch.Tensor:
        return torch.randint(0, 2, (n,), generator=self.g).to(torch.float64) * 2 - 1

    def scales(self, n: int, signed: bool = True) -> torch.Tensor:
        """Non-zero factors $s\\,e^{z/2}$ (random signs $s$ when `signed`)."""
        lam = (0.5 * self.randn(n)).exp()
        return lam * self.signs(n) if signed else lam

    def haar(self, n: int) -> torch.Tensor:
        Q, R = torch.linalg.qr(self.randn(n, n))
        return Q * torch.sign(torch.diagonal(R))

    def gl(self, n: int) -> torch.Tensor:
        """A well-conditioned element of GL(n), not orthogonal."""
        return self.haar(n) @ torch.diag(self.scales(n, signed=False)) @ self.haar(n).T


# -- attention layouts from the config -------------------------------------------------------
@dataclass(frozen=True)
class Proj:
    """Rows `base + j*stride + [0, h)` of the `(out, in)` view of `weight` (and `bias`) are
    head `j`'s; `conv1d`: the weight is stored `(in, out)` (GPT-2)."""

    weight: str
    bias: str | None
    base: int
    stride: int
    conv1d: bool = False


@dataclass(frozen=True)
class Attn:
    heads: int
    kv_heads: int
    h: int
    q: Proj
    k: Proj
    v: Proj
    o: Proj  # columns j*h + [0, h) of its (out, in) view; `bias` the output bias
    rot: int = 0  # rotary dimensions (rotate-half pairs (i, i + rot/2)); 0: no rotary

    def group(self, j: int) -> int:
        """The key/value head that query head `j` reads."""
        return j // (self.heads // self.kv_heads)


def _view(P: dict, name: str, conv1d: bool) -> torch.Tensor:
    return P[name].T if conv1d else P[name]


def _cfg_heads(cfg: Any, path: str) -> int:
    if getattr(cfg, "model_type", "") == "bart":
        return cfg.encoder_attention_heads if ".encoder." in f".{path}" else (
            cfg.decoder_attention_heads)
    return cfg.num_attention_heads


def _rotary_dims(cfg: Any, h: int) -> int:
    rope = getattr(cfg, "rope_parameters", None)
    if not rope:
        return 0
    return int(h * rope.get("partial_rotary_factor", 1.0))


def _lin(ctx: Ctx, name: str, base: int = 0, stride: int = 0, h: int = 0) -> Proj:
    m = ctx.modules[name]
    bias = f"{name}.bias" if getattr(m, "bias", None) is not None else None
    return Proj(f"{name}.weight", bias, base, stride or h, type(m).__name__ == "Conv1D")


def attention_layout(ctx: Ctx, path: str) -> Attn:
    """The head slices of the attention module at `path`, from the module types and the
    config (never from the claim)."""
    m, pre = ctx.modules[path], f"{path}."
    kids = dict(m.named_children())
    if isinstance(m, nn.MultiheadAttention):
        d, h = m.embed_dim, m.head_dim
        W, b = pre + "in_proj_weight", (pre + "in_proj_bias" if m.in_proj_bias is not None
                                        else None)
        return Attn(m.num_heads, m.num_heads, h, Proj(W, b, 0, h), Proj(W, b, d, h),
                    Proj(W, b, 2 * d, h), _lin(ctx, pre + "out_proj", h=h))
    cfg = ctx.model.config
    heads = _cfg_heads(cfg, path)
    h = cfg.d_kv if cfg.model_type == "t5" else (getattr(cfg, "head_dim", None)
                                                  or cfg.hidden_size // heads)
    rot = _rotary_dims(cfg, h)
    for q, k, v, outs in (("q_proj", "k_proj", "v_proj", ("o_proj", "out_proj", "dense")),
                          ("q_lin", "k_lin", "v_lin", ("out_lin",)), ("q", "k", "v", ("o",)),
                          ("query", "key", "value", ())):
        if {q, k, v} <= set(kids):
            o = next((pre + n for n in outs if n in kids), None)
            if o is None:  # BERT, ViT: the output projection is the sibling output.dense
                o = path.rsplit(".", 1)[0] + ".output.dense"
            kq = _lin(ctx, pre + k, h=h)
            kv = _view(ctx.P, kq.weight, kq.conv1d).shape[0] // h
            return Attn(heads, kv, h, _lin(ctx, pre + q, h=h), kq, _lin(ctx, pre + v, h=h),
                        _lin(ctx, o, h=h), rot)
    if "c_attn" in kids:  # GPT-2: fused (in, 3d) Conv1D, [q | k | v]
        d = heads * h
        return Attn(heads, heads, h, *(_lin(ctx, pre + "c_attn", i * d, h) for i in range(3)),
                    _lin(ctx, pre + "c_proj", h=h), rot)
    if "query_key_value" in kids:  # GPT-NeoX, BLOOM: per head [q_j; k_j; v_j]
        return Attn(heads, heads, h, *(_lin(ctx, pre + "query_key_value", i * h, 3 * h)
                                       for i in range(3)), _lin(ctx, pre + "dense", h=h), rot)
    raise KeyError(f"no attention layout for {path} ({type(m).__name__}): add one to "
                   "attention_layout in tests/zoo_constructions.py")


def _left(P: dict, p: Proj, j: int, h: int, X: torch.Tensor) -> None:
    """Head `j`'s rows (and bias entries) of `p` multiplied by `X` from the left."""
    r = slice(p.base + j * p.stride, p.base + j * p.stride + h)
    M = _view(P, p.weight, p.conv1d)
    M[r] = X @ M[r]
    if p.bias is not None:
        P[p.bias][r] = X @ P[p.bias][r]


def _right_cols(P: dict, o: Proj, j: int, h: int, X: torch.Tensor) -> None:
    M = _view(P, o.weight, o.conv1d)
    M[:, j * h:(j + 1) * h] = M[:, j * h:(j + 1) * h] @ X


def _rotary_commutant(ctx: Ctx, h: int, rot: int) -> torch.Tensor:
    """A random element commuting with every rotary rotation: a scaled rotation
    [[a, -b], [b, a]] on each rotate-half pair (i, i + rot/2), any GL on the other dims."""
    A = torch.zeros(h, h, dtype=torch.float64)
    half = rot // 2
    for i in range(half):
        r, phi = float((0.5 * ctx.randn(1)).exp()), float(2 * math.pi * torch.rand(
            1, generator=ctx.g, dtype=torch.float64))
        a, b = r * math.cos(phi), r * math.sin(phi)
        A[i, i], A[i, i + half], A[i + half, i], A[i + half, i + half] = a, -b, b, a
    if rot < h:
        A[rot:, rot:] = ctx.gl(h - rot)
    return A


def qk_block(ctx: Ctx, claim: Any) -> None:
    r"""Per key head $g$: $W_Q^{(j)} \mapsto A_g^{-\top} W_Q^{(j)}$ for the query heads $j$
    reading it, $W_K^{(g)} \mapsto A_g W_K^{(g)}$ (biases alike): $q^\top k$ unchanged. $A_g$
    any element of GL(h) where GL(h) is claimed (a rotary model then changes its outputs), of
    the commutant of the config's rotary embedding where a subgroup is claimed."""
    L = attention_layout(ctx, claim.module)
    for g in range(L.kv_heads):
        A = ctx.gl(L.h) if claim.group is None else _rotary_commutant(ctx, L.h, L.rot)
        Ait = torch.linalg.inv(A).T
        for j in range(L.heads):
            if L.group(j) == g:
                _left(ctx.P, L.q, j, L.h, Ait)
        _left(ctx.P, L.k, g, L.h, A)


def vo_block(ctx: Ctx, claim: Any) -> None:
    r"""Per value head $g$: $W_V^{(g)} \mapsto A_g W_V^{(g)}$ (bias alike),
    $W_O^{(j)} \mapsto W_O^{(j)} A_g^{-1}$ for the query heads $j$ reading it."""
    L = attention_layout(ctx, claim.module)
    for g in range(L.kv_heads):
        A = ctx.gl(L.h)
        Ai = torch.linalg.inv(A)
        _left(ctx.P, L.v, g, L.h, A)
        for j in range(L.heads):
            if L.group(j) == g:
                _right_cols(ctx.P, L.o, j, L.h, Ai)


_MLP = (("up_proj", "down_proj"), ("fc1", "fc2"), ("wi", "wo"), ("linear1", "linear2"))


def mlp_block(ctx: Ctx, claim: Any) -> None:
    r"""Unit $i$: input row (and bias) $\times λ_i$, output column $/ λ_i$; $λ > 0$ where the
    claim is the connected group (a ReLU), any sign otherwise (the linear branch of a gated MLP):
    a sign claimed for a ReLU then changes the outputs."""
    pre = f"{claim.module}."
    kids = dict(ctx.modules[claim.module].named_children())
    up, down = next(((u, d) for u, d in _MLP if u in kids and d in kids), (None, None))
    if up is None:
        return _linear_pair(ctx, claim)
    W = ctx.P[pre + up + ".weight"]
    lam = ctx.scales(W.shape[0], signed=not claim.connected)
    W.mul_(lam[:, None])
    if pre + up + ".bias" in ctx.P:
        ctx.P[pre + up + ".bias"].mul_(lam)
    ctx.P[pre + down + ".weight"].div_(lam[None, :])


def _linear_pair(ctx: Ctx, claim: Any) -> None:
    r"""A unit scaling between two linear maps with a ReLU-like function applied between them
    in the model's `forward` (DistilBERT's `pre_classifier` -> `classifier`): the claim's note
    names the two modules, `source -> reader`; the source's output rows (and bias) $\times λ_i$,
    the reader's input columns $/ λ_i$, read from the module types ($λ > 0$: a sign changes
    the outputs through the ReLU)."""
    src, _, dst = claim.note.partition(" -> ")
    readers = [r.strip() for r in dst.split(",")]
    if not readers[0] or any(type(ctx.modules[m]) is not nn.Linear for m in (src, *readers)):
        raise KeyError(f"no MLP layout for {claim.module} ({claim.note!r}): add its (input, "
                       "output) pair to _MLP in tests/zoo_constructions.py")
    W = ctx.P[f"{src}.weight"]
    lam = ctx.scales(W.shape[0], signed=not claim.connected)
    W.mul_(lam[:, None])
    if f"{src}.bias" in ctx.P:
        ctx.P[f"{src}.bias"].mul_(lam)
    for r in readers:
        ctx.P[f"{r}.weight"].div_(lam[None, :])


# -- norms -------------------------------------------------------------------------------------
def _norm_probe(norm: nn.Module) -> nn.Module:
    m = copy.deepcopy(norm).double()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def gain_offset(norm: nn.Module, d: int) -> float:
    """$o$ in $γ = o + w$, measured: the norm's output with $w = 0$ (and no shift)."""
    m = _norm_probe(norm)
    for p in m.parameters():
        p.zero_()
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with float64_internals():
        y = m(x)
    return 0.0 if float(y.abs().max()) < 1e-8 else 1.0


def is_centring(norm: nn.Module, d: int) -> bool:
    """Whether the norm removes its input's mean (LayerNorm), measured."""
    m = _norm_probe(norm)
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with float64_internals():
        return bool((m(x) - m(x + 3.0)).abs().max() < 1e-10)


def _norm_params(ctx: Ctx, module: str) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    r"""Gain, shift and gain offset; a norm without parameters (OLMo's) has the constant gain
    $\mathbb 1$ (returned as a fresh tensor: nothing to edit) and no shift."""
    if f"{module}.weight" not in ctx.P:
        if any(True for _ in ctx.modules[module].parameters()):
            raise KeyError(f"{module}: a norm with parameters other than weight/bias")
        return torch.zeros(_free_width(ctx, module), dtype=torch.float64), None, 1.0
    w = ctx.P[f"{module}.weight"]
    return w, ctx.P.get(f"{module}.bias"), gain_offset(ctx.modules[module], w.numel())


def _free_width(ctx: Ctx, module: str) -> int:
    """The width of a parameter-free norm: from its `normalized_shape`, else the config."""
    shape = getattr(ctx.modules[module], "normalized_shape", None)
    return int(shape[-1]) if shape else int(ctx.model.config.hidden_size)


def _consumer(P: dict, c: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The `(rows, in)` view of a consumer's rows and the view of their bias entries."""
    W = P[c.weight]
    M = W if c.in_axis == 1 else W.T
    stop = M.shape[0] if c.stop < 0 else c.stop
    M = M[c.start:stop]
    b = None
    if c.bias is not None:
        b0 = c.start if c.bias_start is None else c.bias_start
        b = P[c.bias][b0:b0 + M.shape[0]]
    return M, b


def _scale_norm(ctx: Ctx, claim: Any, c: torch.Tensor, t: torch.Tensor | None) -> None:
    r"""$(γ, β, W_j, b_j) \mapsto (c ⊙ γ, c ⊙ β + t, W_j \operatorname{diag}(c)^{-1},
    b_j - W_j \operatorname{diag}(c)^{-1} t)$."""
    w, beta, o = _norm_params(ctx, claim.module)
    w.copy_(c * (w + o) - o)
    if beta is not None:
        beta.mul_(c)
        if t is not None:
            beta.add_(t)
    for cons in claim.consumers:
        M, b = _consumer(ctx.P, cons)
        M.div_(c[None, :])
        if t is not None and b is not None:
            b.sub_(M @ t)


def norm_gain(ctx: Ctx, claim: Any) -> None:
    """Gain scaling (signs included) and, where the claim folds the shift, a shift
    translation compensated in the consumers' biases."""
    w = ctx.P[f"{claim.module}.weight"]
    t = (ctx.randn(w.numel(), scale=SCALE) if claim.shift == "fold" else None)
    _scale_norm(ctx, claim, ctx.scales(w.numel()), t)


def fold_norm_by_hand(ctx: Ctx, claim: Any) -> None:
    """$γ \\to 1$ and (shift folded) $β \\to 0$: the norm-gain element $c = 1/γ$, $t = -β/γ$."""
    w, beta, o = _norm_params(ctx, claim.module)
    c = 1.0 / (w + o)
    t = None if beta is None or claim.shift != "fold" else -(beta * c)
    _scale_norm(ctx, claim, c, t)


def norm_shift(ctx: Ctx, claim: Any) -> None:
    r"""Post-norm: $(β + t,\ b_j - W_j t,\ b_\text{res} - t)$."""
    t = ctx.randn(ctx.P[claim.shift].numel(), scale=SCALE)
    ctx.P[claim.shift].add_(t)
    for cons in claim.consumers:
        M, b = _consumer(ctx.P, cons)
        if b is None:
            raise AssertionError(f"{claim.module}: consumer {cons.weight} has no bias to "
                                 "absorb the shift")
        b.sub_(M @ t)
    ctx.P[claim.residual_bias].sub_(t)


def table_shift(ctx: Ctx, claim: Any) -> None:
    r"""An embedding table read directly by a post-norm block: $(E + \mathbb 1 t^\top,\ b_j -
    W_j t,\ b_\text{res} - t)$, one $t$ for every row (the norm shift with the table in place of
    $β$)."""
    E = ctx.P[claim.shift]
    if not isinstance(ctx.modules[claim.shift.rpartition(".")[0]], nn.Embedding):
        raise AssertionError(f"{claim.shift}: a table shift claimed on no embedding table")
    t = ctx.randn(E.shape[-1], scale=SCALE)
    E.add_(t[None, :])
    for cons in claim.consumers:
        M, b = _consumer(ctx.P, cons)
        if b is None:
            raise AssertionError(f"{claim.module}: consumer {cons.weight} has no bias to "
                                 "absorb the shift")
        b.sub_(M @ t)
    ctx.P[claim.residual_bias].sub_(t)


def input_shear(ctx: Ctx, claim: Any) -> None:
    r"""A table read directly by a post-norm block: the shear $T = I + \mathbb 1 a^\top$ as a
    matrix, $E \to E T^\top$, every consumer's rows $W_j \to W_j T^{-1}$ (a matrix inverse);
    $a$ drawn with $1 + a^\top \mathbb 1 = e^{z}$ (the identity component)."""
    E = ctx.P[claim.table]
    if not isinstance(ctx.modules[claim.table.rpartition(".")[0]], nn.Embedding):
        raise AssertionError(f"{claim.table}: a shear claimed on no embedding table")
    d = E.shape[-1]
    a = ctx.randn(d)
    a = a - a.mean() + (math.exp(float(ctx.randn(1))) - 1) / d
    T = torch.eye(d, dtype=torch.float64) + torch.ones(d, 1, dtype=torch.float64) * a[None]
    E.copy_(E @ T.T)
    Tinv = torch.linalg.inv(T)
    for cons in claim.consumers:
        M, _ = _consumer(ctx.P, cons)
        M.copy_(M @ Tinv)


def shift_reader(ctx: Ctx, claim: Any) -> None:
    r"""A LayerNorm read by linear maps without bias: $(W_j, β) \mapsto (W_j M, M^{-1} β)$,
    $M = I + a v^\top$, $v = \mathbb 1 ⊘ γ$ (gain offset measured), $M^{-1}β$ by a linear
    solve; $a$ random with $|v^\top a| \le 1/2$ away from the singular $1 + v^\top a = 0$."""
    w, beta, o = _norm_params(ctx, claim.module)
    v = 1.0 / (w + o)
    a = ctx.randn(v.numel(), scale=2.0 / float(v.norm()))
    a = a * min(1.0, 0.5 / abs(float(v @ a)))
    M = torch.eye(v.numel(), dtype=torch.float64) + torch.outer(a, v)
    for cons in claim.consumers:
        W, b = _consumer(ctx.P, cons)
        if b is not None:
            raise AssertionError(f"{cons.weight} has a bias: the shift reader is claimed for "
                                 "readers without one")
        W.copy_(W @ M)
    beta.copy_(torch.linalg.solve(M, beta))


def reader_centring(ctx: Ctx, claim: Any) -> None:
    r"""$W \mapsto W + u (\mathbb 1 ⊘ γ)^\top$, $b \mapsto b - u\,\sum_i β_i/γ_i$."""
    w, beta, o = _norm_params(ctx, claim.module)
    v = 1.0 / (w + o)
    M, b = _consumer(ctx.P, claim.consumer)
    u = ctx.randn(M.shape[0], scale=SCALE / math.sqrt(M.shape[1]))
    M.add_(torch.outer(u, v))
    if beta is not None:
        if b is None:
            raise AssertionError(f"{claim.consumer.weight} reads a shifted LayerNorm and has "
                                 "no bias to absorb the centring")
        b.sub_(u * float(v @ beta))


# -- translations of writers, tables, biases ----------------------------------------------------
def output_axis(ctx: Ctx, name: str) -> int:
    """The output-feature axis of a parameter, from its module type."""
    t = ctx.P[name]
    mod = ctx.modules[name.rpartition(".")[0]]
    if t.dim() == 1:
        return 0
    if type(mod).__name__ == "Conv1D" or isinstance(mod, nn.Embedding):
        return 1
    if isinstance(mod, (nn.Linear, nn.modules.conv._ConvNd, nn.MultiheadAttention)):
        return 0
    return t.dim() - 1  # a bare parameter (cls token, position table): features last


def translate_writer(ctx: Ctx, claim: Any) -> None:
    r"""Constant along the output axis: $W + \mathbb 1 u^\top$ (Linear), $E + c\mathbb
    1^\top$ (tables, one constant per row), $b + c\mathbb 1$."""
    t = ctx.P[claim.param]
    axis = output_axis(ctx, claim.param)
    shape = list(t.shape)
    shape[axis] = 1
    table = isinstance(ctx.modules[claim.param.rpartition(".")[0]], nn.Embedding) or (
        t.dim() == 1)
    fan = 1 if table else math.prod(shape)
    t.add_(ctx.randn(*shape, scale=SCALE / math.sqrt(fan)))


def embedding_shift(ctx: Ctx, claim: Any) -> None:
    r"""$(E_w + \mathbb 1 t^\top, E_o - \mathbb 1 t^\top)$; where the claim says the word
    table's constant translation belongs to the group, also $E_w + s\mathbb 1 \mathbb 1^\top$."""
    t = ctx.randn(ctx.P[claim.word].shape[1], scale=SCALE)
    ctx.P[claim.word].add_(t)
    ctx.P[claim.other].sub_(t)
    if getattr(claim, "constant", False):
        ctx.P[claim.word].add_(float(ctx.randn(1, scale=SCALE)))


def summed_bias(ctx: Ctx, claim: Any) -> None:
    r"""$(b_A + t,\ b_M - t)$ for the two output biases the claim names."""
    t = ctx.randn(ctx.P[claim.keep].numel(), scale=SCALE)
    ctx.P[claim.keep].add_(t.view(ctx.P[claim.keep].shape))
    ctx.P[claim.zero].sub_(t.view(ctx.P[claim.zero].shape))


def key_offset(ctx: Ctx, claim: Any) -> None:
    r"""$W_K[r] + u_r (\mathbb 1 \oslash γ)^\top$ on the rows the claim names (the unrotated
    key coordinates), γ the reading norm's gain (1 without one)."""
    W = ctx.P[claim.weight]
    v = (1.0 / ctx.P[claim.gain]) if claim.gain else torch.ones(W.shape[1], dtype=W.dtype)
    u = ctx.randn(len(claim.rows), scale=SCALE)
    for r, ur in zip(claim.rows, u, strict=True):
        W[r] += ur * v


def pad_shift(ctx: Ctx, claim: Any) -> None:
    r"""RoBERTa's padding pair: $(E_w[p] + s,\ E_o[p] - s)$ for the config's `pad_token_id`
    $p$ (the position ids count from $p$, so position $p$ is read exactly with token $p$)."""
    p = int(ctx.model.config.pad_token_id)
    s = ctx.randn(ctx.P[claim.word].shape[1], scale=SCALE)
    ctx.P[claim.word][p] += s
    ctx.P[claim.other][p] -= s


def token_shift(ctx: Ctx, claim: Any) -> None:
    r"""A ViT's token shifts: $(c + t,\ P_0 - t)$ for the class token $c$, $(b + s,\ P_{1:} -
    \mathbb 1 s^\top)$ for the patch convolution's bias $b$: the rows from the module's
    structure (the class token sits at position 0, the patches after it)."""
    m = ctx.modules[claim.module]
    P = ctx.P[claim.positions]
    t = ctx.randn(P.shape[-1], scale=SCALE)
    cls = getattr(m, "cls_token", None)
    if cls is not None and claim.source == f"{claim.module}.cls_token":
        rows = slice(0, 1)
    elif claim.source.endswith(".bias") and isinstance(
            ctx.modules[claim.source.rpartition(".")[0]], nn.modules.conv._ConvNd):
        rows = slice(0 if cls is None else 1, P.shape[-2])
    else:
        raise AssertionError(f"{claim.source}: no token shift layout")
    ctx.P[claim.source].add_(t.reshape(ctx.P[claim.source].shape))
    P[..., rows, :] -= t


def score_shift(ctx: Ctx, claim: Any) -> None:
    r"""A relative-attention-bias table $B$ (buckets, heads): $B + \mathbb 1 c^\top$, one
    constant per head (column), which the softmax over the keys ignores."""
    B = ctx.P[claim.param]
    if not (isinstance(ctx.modules[claim.param.rpartition(".")[0]], nn.Embedding)
            and B.shape[1] == ctx.model.config.num_heads):
        raise AssertionError(f"{claim.param}: a score shift claimed on no (buckets, heads) table")
    B.add_(ctx.randn(1, B.shape[1], scale=SCALE))


# -- attention biases, q/k norms ------------------------------------------------------------------
def key_bias(ctx: Ctx, claim: Any) -> None:
    """Any translation of every key bias (the softmax over keys ignores $q^\\top b_K$)."""
    L = attention_layout(ctx, claim.module)
    if L.k.bias is None:
        raise AssertionError(f"{claim.module}: a key bias claimed, the key projection has none")
    for g in range(L.kv_heads):
        r = slice(L.k.base + g * L.k.stride, L.k.base + g * L.k.stride + L.h)
        ctx.P[L.k.bias][r] += ctx.randn(L.h, scale=SCALE)


def value_bias(ctx: Ctx, claim: Any) -> None:
    r"""$b_V^{(g)} + t_g$, $b_O - \sum_{j \text{ reads } g} W_O^{(j)} t_g$."""
    L = attention_layout(ctx, claim.module)
    O = _view(ctx.P, L.o.weight, L.o.conv1d)
    for g in range(L.kv_heads):
        t = ctx.randn(L.h, scale=SCALE)
        r = slice(L.v.base + g * L.v.stride, L.v.base + g * L.v.stride + L.h)
        ctx.P[L.v.bias][r] += t
        for j in range(L.heads):
            if L.group(j) == g:
                ctx.P[L.o.bias].sub_(O[:, j * L.h:(j + 1) * L.h] @ t)


def qk_norm(ctx: Ctx, claim: Any) -> None:
    r"""$γ_q \mapsto c ⊙ γ_q$, $γ_k \mapsto γ_k ⊘ c$, $c$ equal on each rotary pair (config),
    shared by the query heads of a key head when the gains are per head."""
    m = ctx.modules[claim.module]
    cfg = ctx.model.config
    L = attention_layout(ctx, claim.module)
    names = {}
    for side in ("q", "k"):
        norm = next(n for n in (f"{side}_norm", f"{side}_layernorm") if hasattr(m, n))
        names[side] = f"{claim.module}.{norm}"
    half = _rotary_dims(cfg, L.h) // 2

    def per_head() -> torch.Tensor:
        c = ctx.scales(L.h)
        c[half:2 * half] = c[:half]
        return c

    ck = [per_head() for _ in range(L.kv_heads)]
    for side in ("q", "k"):
        w, beta, o = _norm_params(ctx, names[side])
        if w.numel() == L.h:  # one gain vector for every head: one factor
            c = ck[0]
        elif side == "q":  # per query head: the factor of the key head it reads
            c = torch.cat([ck[L.group(j)] for j in range(w.numel() // L.h)])
        else:
            c = torch.cat(ck[:w.numel() // L.h])
        c = c if side == "q" else 1.0 / c
        w.copy_(c * (w + o) - o)
        if beta is not None:
            beta.mul_(c)


_NORM_NAME = re.compile(r"(layer|rms).?norm", re.IGNORECASE)


def _shift_to_ones(ctx: Ctx, claim: Any, fold_gain: bool) -> None:
    r"""By hand: the gain folded into the bias-free readers ($γ \to \mathbb 1$, $β \to β ⊘ γ$,
    $W_j \to W_j \operatorname{diag}(γ)$) unless a norm-gain claim did, then $(W_j M, M^{-1}β)$
    with $M = I + a\mathbb 1^\top$, $a = (β - \mathbb 1)/d$, so that $M^{-1}β = \mathbb 1$:
    the stream's rotations fixing $\mathbb 1$ then keep $W_j β$."""
    w, beta, o = _norm_params(ctx, claim.module)
    if fold_gain:
        g = w + o
        for cons in claim.consumers:
            _consumer(ctx.P, cons)[0].mul_(g[None, :])
        beta.div_(g)
        w.copy_(torch.ones_like(w) - o)
    d = beta.numel()
    a = (beta - 1.0) / d
    M = torch.eye(d, dtype=torch.float64) + torch.outer(a, torch.ones(d, dtype=torch.float64))
    for cons in claim.consumers:
        W = _consumer(ctx.P, cons)[0]
        W.copy_(W @ M)
    beta.copy_(torch.linalg.solve(M, beta))


# -- residual rotations ---------------------------------------------------------------------------
def rotation(ctx: Ctx, claim: Any) -> None:
    r"""Fold by hand the gains (and folded shifts) of every norm read by the stream parts,
    then rotate the stream by a Haar $Q$ ($O(d)$; fixing $\mathbb 1$ when a norm removes the
    mean): every part's stream vectors $v \mapsto Q v$ ($E Q^\top$, $Q W_\text{out}$,
    $W_\text{in} Q^\top$)."""
    readers = {p.param for p in claim.parts if not p.writer}
    norms = [c for c in ctx.claims if not is_block(c) and c.kind == "norm_gain"
             and {q.weight for q in c.consumers} & readers]
    centred = False
    for c in norms:
        fold_norm_by_hand(ctx, c)
        d = ctx.P[f"{c.module}.weight"].numel()
        centred |= is_centring(ctx.modules[c.module], d)
    folded = {c.module for c in norms}
    for c in ctx.claims:  # a LayerNorm read by heads without bias: its shift brought to 1
        if not is_block(c) and c.kind == "shift_reader" and {
                q.weight for q in c.consumers} & readers:
            _shift_to_ones(ctx, c, fold_gain=c.module not in folded)
            centred |= is_centring(ctx.modules[c.module], ctx.P[c.shift].numel())
    for name, m in ctx.modules.items():  # parameter-free norms (OLMo): centring, measured
        if _NORM_NAME.search(type(m).__name__) and not any(True for _ in m.parameters()):
            centred |= is_centring(m, _free_width(ctx, name))
    d = claim.parts[0].view(ctx.P).shape[-1]
    Q = ctx.haar(d)
    if centred:
        one = torch.full((d, 1), 1 / math.sqrt(d), dtype=torch.float64)
        B = torch.linalg.qr(torch.cat([one, ctx.randn(d, d - 1)], 1))[0]
        B[:, 0] = one[:, 0]
        R = torch.eye(d, dtype=torch.float64)
        R[1:, 1:] = ctx.haar(d - 1)
        Q = B @ R @ B.T
    for p in claim.parts:
        t = ctx.P[p.param]
        if t.dim() == 1:
            t.copy_(Q @ t)
            continue
        v = t if p.axis == 1 else t.T
        stop = v.shape[0] if p.stop < 0 else p.stop
        v[p.start:stop] = v[p.start:stop] @ Q.T


Construction = Callable[[Ctx, Any], None]

CONSTRUCTIONS: dict[str, Construction] = {
    "block attention.qk [GL]": qk_block,
    "block attention.qk [RotaryCommutant]": qk_block,
    "block attention.vo [GL]": vo_block,
    "block mlp [GL]": mlp_block,
    "fold norm_gain [NormGainFold]": norm_gain,
    "fold norm_gain [ReturnedNormGainFold]": norm_gain,
    "fold table_shift [TableShiftFold]": table_shift,
    "fold input_shear [ShearFold]": input_shear,
    "fold shift_reader [ShiftReaderFold]": shift_reader,
    "fold pad_shift [PadShiftFold]": pad_shift,
    "fold token_shift [SliceShiftFold]": token_shift,
    "fold score_shift [ScoreShiftFold]": score_shift,
    "fold norm_shift [NormShiftFold]": norm_shift,
    "fold reader_centring [ReaderCentringFold]": reader_centring,
    "fold key_bias [KeyBiasFold]": key_bias,
    "fold value_bias [ValueBiasFold]": value_bias,
    "fold summed_bias [SummedBiasFold]": summed_bias,
    "fold key_offset [KeyOffsetFold]": key_offset,
    "fold centring [CentringFold]": translate_writer,
    "fold softmax_shift [SoftmaxShiftFold]": translate_writer,
    "fold embedding_shift [EmbeddingShiftFold]": embedding_shift,
    "fold embedding_shift [TiedEmbeddingShiftFold]": embedding_shift,
    "fold qk_norm [QKNormScaleFold]": qk_norm,
    "fold rotation [RotationFold]": rotation,
}
"""Claim key → independent construction. Add a line for every new family."""


def apply_claims(model: nn.Module, claims: list, which: list, seed: int = 0) -> nn.Module:
    """A copy of `model` moved by the constructions of `which` (claims of `claims`), in order."""
    moved = copy.deepcopy(model)
    ctx = Ctx(moved, claims, seed)
    with torch.no_grad():
        for c in which:
            CONSTRUCTIONS[claim_key(c)](ctx, c)
    return moved
