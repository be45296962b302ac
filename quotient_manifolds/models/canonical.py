r"""Canonical representatives of the symmetries that are not GL(h) blocks.

Norm gains in pre-norm blocks, the dead key bias, the value/output bias translation and the
gain scaling of q/k norms are removed by evaluating every measure at a **canonical point** of
the orbit, computed from the parameters without touching the model (docs: "Symmetries").

Each symmetry is a [`Fold`][quotient_manifolds.models.canonical.Fold]: a small frozen record
of the parameters it acts on, with two pure functions of a parameter dict,

* `apply(params) -> (canonical params, frozen masks)`: the canonical representative of the
  fold's orbit (e.g. a norm gain set to one and folded into its consumers' input columns);
* `act(params, generator, a=1.0) -> params`: a random element of the fold's group applied to
  `params` (used by [`reparametrize`][quotient_manifolds.models.reparam.reparametrize]).

[`find_folds`][quotient_manifolds.models.canonical.find_folds] finds the candidates by
tracing one forward pass of a float64 copy of the model and keeps only those that a
function-preservation probe confirms: a random element of the fold's group must leave every
output of the copy unchanged to a relative $10^{-10}$.

Folds commute with the GL(h) actions of the blocks: a fold multiplies a projection weight
from the input side (`W ← W diag(γ)`, i.e. a left multiplication of the factor $G = W^\top$),
or replaces a bias row by zero, while a group element multiplies the factors from the right
($G A^{-1}$, $H A^\top$).
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .blocks import BlockSpec, FactorPart, claimed_mask, gather_block, scatter_block
from .probe import (
    _cast_tree,
    _device,
    _no_fastpath,
    example_inputs,
    float64_copy,
    float64_internals,
    normalize_inputs,
)
from .records import PROBE_RTOL, Fallback

__all__ = [
    "PROBE_RTOL",
    "Consumer",
    "Fold",
    "KeyBiasFold",
    "NormGainFold",
    "QKNormScaleFold",
    "ValueBiasFold",
    "apply_folds",
    "find_folds",
]

#: Relative output change (max |Δ| / max |output|, float64) under which a probe passes.

Params = Mapping[str, torch.Tensor]


# -- small helpers ------------------------------------------------------------------------
def _randn(shape, generator, dtype, device) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype=dtype,
                                                                            device=device)


def _random_scale(shape, generator, a: float, dtype, device) -> torch.Tensor:
    r"""$c = a\,s\,e^{z}$ with $z \sim N(0, 1)$ and a random sign $s$: a random element of
    $(\mathbb R^*)^k$ (never zero)."""
    z = torch.randn(shape, generator=generator, dtype=torch.float64)
    s = torch.randint(0, 2, shape, generator=generator).to(torch.float64) * 2 - 1
    return (a * s * z.exp()).to(dtype=dtype, device=device)


def _part_block(part: FactorPart, heads: int, h: int, module: str = "") -> BlockSpec:
    """A one-part block, to read, write and mark a factor part with the block machinery."""
    return BlockSpec("custom", module, heads, h, (part,), (part,))


def _mask(params: Params, name: str) -> torch.Tensor:
    t = params[name]
    return torch.ones(t.shape, dtype=torch.bool, device=t.device)


def _merge(frozen: dict[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> None:
    for k, m in new.items():
        frozen[k] = m if k not in frozen else frozen[k] | m


# -- consumers of a norm --------------------------------------------------------------------
@dataclass(frozen=True)
class Consumer:
    r"""A linear map that reads a norm's output: rows `start:stop` of a weight and its bias.

    Attributes
    ----------
    weight : str
        Parameter name of the weight.
    in_axis : int
        The weight's input axis: `1` for `nn.Linear` (`(out, in)`), `0` for the transposed
        `Conv1D` of GPT-2 (`(in, out)`).
    start, stop : int
        The output features that read the norm (all of them: `0, -1`; a slice of a fused
        `in_proj_weight`: e.g. `d, 2d` for the keys).
    bias : str or None
        Parameter name of the bias of these outputs, or None (no bias).
    bias_start : int or None
        Where the outputs' bias entries start in `bias` (None: at `start`, the same slice as
        the weight rows; `0` for the separate `q_bias`/`v_bias` of timm's BEiT and EVA).
    """

    weight: str
    in_axis: int = 1
    start: int = 0
    stop: int = -1
    bias: str | None = None
    bias_start: int | None = None

    def _bias_slice(self, stop: int) -> tuple[int, int]:
        b0 = self.start if self.bias_start is None else self.bias_start
        return b0, b0 + stop - self.start

    def _stop(self, t: torch.Tensor) -> int:
        return t.shape[1 - self.in_axis] if self.stop < 0 else self.stop

    def read(self, params: Params) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(M, b)`: the `(out, in)` matrix of the slice and its bias (or None)."""
        W = params[self.weight]
        stop = self._stop(W)
        M = W[self.start:stop] if self.in_axis == 1 else W[:, self.start:stop].transpose(0, 1)
        if self.bias is None:
            return M, None
        b0, b1 = self._bias_slice(stop)
        return M, params[self.bias].reshape(-1)[b0:b1]

    def write(self, params: dict, M: torch.Tensor, b: torch.Tensor | None) -> None:
        """Out-of-place write of `(M, b)` into `params`."""
        W = params[self.weight]
        stop = self._stop(W)
        if self.in_axis == 1:
            params[self.weight] = W.slice_scatter(M.to(W.dtype), 0, self.start, stop)
        else:
            params[self.weight] = W.slice_scatter(M.transpose(0, 1).to(W.dtype), 1, self.start,
                                                  stop)
        if b is not None and self.bias is not None:
            t = params[self.bias]
            b0, b1 = self._bias_slice(stop)
            flat = t.reshape(-1).slice_scatter(b.to(t.dtype), 0, b0, b1)
            params[self.bias] = flat.view(t.shape)


# -- folds ------------------------------------------------------------------------------------
def _required(cls: str, name: str) -> FactorPart:
    """Default factory of a field that needs a value (it follows `Fold.module`, so it has a
    default in the dataclass)."""
    raise TypeError(f"{cls}() missing required argument: {name!r}")


@dataclass(frozen=True)
class Fold:
    """One canonicalisation step of a symmetry that is not a GL(h) block.

    Subclasses define `apply` (the canonical representative), `act` (a random group element)
    and `frozen` (the entries fixed at their canonical value, never perturbed).  Folds are
    applied in the order `find_folds` returns them (norm gains, then the key bias, then the
    value bias, then q/k-norm gains).
    """

    module: str

    kind = "fold"

    @property
    def params(self) -> tuple[str, ...]:
        """Names of every parameter the fold reads or writes."""
        raise NotImplementedError

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Return `(new params, frozen masks)`; the input is never modified."""
        raise NotImplementedError

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        """`params` moved by a random element of this fold's group (out of place)."""
        raise NotImplementedError

    def frozen(self, params: Params) -> dict[str, torch.Tensor]:
        """Boolean masks of the entries that `apply` fixes (they depend on no value)."""
        return {}

    def describe(self) -> dict:
        """A JSON-friendly summary."""
        return {"kind": self.kind, "module": self.module, "params": list(self.params)}


@dataclass(frozen=True)
class NormGainFold(Fold):
    r"""The gain (and shift) of a pre-norm LayerNorm/RMSNorm, folded into its consumers.

    A norm $y = γ ⊙ \hat x + β$ ($\hat x$ the normalised input, $γ = o + w$ with the
    parameter $w$ and a constant offset $o$: $o = 1$ for Gemma's norms, else $0$) whose output
    is read only by the linear maps $z_j = W_j y + b_j$ has the symmetry
    $(γ, β, W_j) ↦ (c ⊙ γ, c ⊙ β, W_j \operatorname{diag}(c)^{-1})$ for every
    $c ∈ (\mathbb R^*)^d$, and, when every consumer has a bias (or its output shift is dead,
    like a key projection's), $(β, b_j) ↦ (β + t, b_j − W_j t)$ for every $t ∈ \mathbb R^d$.

    Canonical representative: $W_j ← W_j \operatorname{diag}(γ)$, $γ ← 1$ (frozen) and, with
    `shift="fold"`, $b_j ← b_j + W_j β$, $β ← 0$ (frozen); with `shift="scale"` (a consumer
    without bias whose shift is not dead) $β ← β ⊘ γ$, which needs $γ$ without zeros.

    Attributes
    ----------
    weight, bias : str, str or None
        The norm's gain parameter $w$ and shift $β$.
    offset : float
        $o$ in $γ = o + w$.
    consumers : tuple of Consumer
        Every linear map that reads the norm's output.
    shift : {"fold", "scale", "none"}
        How $β$ is canonicalised (`"none"`: the norm has no $β$).
    """

    weight: str = ""
    bias: str | None = None
    offset: float = 0.0
    consumers: tuple[Consumer, ...] = ()
    shift: str = "none"

    kind = "norm_gain"

    @property
    def params(self) -> tuple[str, ...]:
        names = [self.weight, self.bias] + [c.weight for c in self.consumers]
        if self.shift == "fold":
            names += [c.bias for c in self.consumers]
        return tuple(dict.fromkeys(n for n in names if n is not None))

    def frozen(self, params: Params) -> dict[str, torch.Tensor]:
        out = {self.weight: _mask(params, self.weight)}
        if self.bias is not None and self.shift == "fold":
            out[self.bias] = _mask(params, self.bias)
        return out

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            out = dict(params)
            w = out[self.weight]
            g = w + self.offset
            beta = None if self.bias is None else out[self.bias]
            for c in self.consumers:
                M, b = c.read(out)
                if self.shift == "fold" and b is not None:
                    assert beta is not None, "shift='fold' needs the norm's bias"
                    b = b + M @ beta.to(M.dtype)
                c.write(out, M * g.to(M.dtype), b)
            out[self.weight] = torch.full_like(w, 1.0 - self.offset)
            if self.bias is not None and beta is not None:  # beta is read from the bias
                out[self.bias] = torch.zeros_like(beta) if self.shift == "fold" else beta / g
            return out, self.frozen(params)

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            out = dict(params)
            w = out[self.weight]
            c = _random_scale(w.shape, generator, a, w.dtype, w.device)
            out[self.weight] = c * (w + self.offset) - self.offset
            t = None
            if self.bias is not None:
                out[self.bias] = c * out[self.bias]
                if self.shift == "fold":
                    t = a * _randn(w.shape, generator, w.dtype, w.device)
                    out[self.bias] = out[self.bias] + t
            for cons in self.consumers:
                M, b = cons.read(out)
                M = M / c.to(M.dtype)
                if t is not None and b is not None:
                    b = b - M @ t.to(M.dtype)
                cons.write(out, M, b)
            return out

    def describe(self) -> dict:
        d = super().describe()
        d.update(offset=self.offset, shift=self.shift,
                 consumers=[c.weight + ("" if c.stop < 0 else f"[{c.start}:{c.stop}]")
                            for c in self.consumers])
        return d


@dataclass(frozen=True)
class KeyBiasFold(Fold):
    r"""The key bias, dead under the softmax: $b_K ← 0$ (frozen).

    Adding $t$ to every key adds $q_i^\top t$ to every score of query $i$, a constant along
    the softmax axis, so the attention weights do not change (this fails with rotary
    embeddings, which rotate $t$ differently at every position; the probe rejects it then).

    Attributes
    ----------
    part : FactorPart
        The key-bias entries, as they appear in the Q/K block.
    heads, h : int
        The block's head count and head dimension (the part covers `heads·h` entries).
    """

    part: FactorPart = field(default_factory=lambda: _required("KeyBiasFold", "part"))
    heads: int = 1
    h: int = 1

    kind = "key_bias"

    @property
    def params(self) -> tuple[str, ...]:
        return (self.part.param,)

    def _block(self) -> BlockSpec:
        return _part_block(self.part, self.heads, self.h, self.module)

    def frozen(self, params: Params) -> dict[str, torch.Tensor]:
        return {self.part.param: claimed_mask(self._block(), params)[self.part.param]}

    def _write(self, params, fn) -> dict:
        out = dict(params)
        blk = self._block()
        x = gather_block(blk, out)
        x = x[:, : x.shape[-2] // 2]  # G = H = the part (one row, or one per stacked head)
        y = fn(x)
        # one-part block: write the same rows as G and H (identical values, out of place)
        scatter_block(blk, torch.cat([y, y], dim=-2), out)
        return out

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            return self._write(params, torch.zeros_like), self.frozen(params)

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return self._write(params, lambda x: x + a * _randn(x.shape, generator, x.dtype,
                                                                 x.device))

    def describe(self) -> dict:
        d = super().describe()
        d.update(part=(self.part.param, self.part.layout, self.part.offset))
        return d


@dataclass(frozen=True)
class ValueBiasFold(Fold):
    r"""The value bias folded through the output projection: $b_O ← b_O + W_O b_V$,
    $b_V ← 0$ (frozen).

    Softmax rows sum to one, so a value bias reaches the output as the constant
    $W_O b_V$ (with grouped K/V heads, through every output block that reads the shared value
    head): $(b_V + t,\ b_O − W_O t)$ is a symmetry for every $t$.

    Attributes
    ----------
    part : FactorPart
        The value-bias row of the V/O block's $G$ factor.
    out : tuple of FactorPart
        The output-projection weight: the V/O block's $H$ factor, one part or several stacked
        parts of the same weight (grouped K/V heads: the output blocks of every query head
        that reads the value head).
    out_bias : str
        The output projection's bias $b_O$.
    heads, h : int
        The block's head count and head dimension.
    """

    part: FactorPart = field(default_factory=lambda: _required("ValueBiasFold", "part"))
    out: tuple[FactorPart, ...] = ()
    out_bias: str = ""
    heads: int = 1
    h: int = 1

    kind = "value_bias"

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.part.param, *(q.param for q in self.out),
                                    self.out_bias)))

    def _block(self) -> BlockSpec:
        return BlockSpec("custom", self.module, self.heads, self.h, (self.part,), self.out)

    def frozen(self, params: Params) -> dict[str, torch.Tensor]:
        return {self.part.param: claimed_mask(_part_block(self.part, self.heads, self.h),
                                              params)[self.part.param]}

    def _shift(self, params, fn, sign: float) -> dict:
        out = dict(params)
        blk = self._block()
        x = gather_block(blk, out)  # (heads, 1 + m, h): [b_V row; H]
        bv, H = x[:, :1], x[:, 1:]
        t = fn(bv)  # (heads, 1, h): the translation added to b_V
        through = (H @ t.transpose(-1, -2)).reshape(-1)  # W_O t for every head and block
        bo = out[self.out_bias]
        contrib = through.reshape(-1, bo.numel()).sum(0).to(bo.dtype).view(bo.shape)
        out[self.out_bias] = bo + sign * contrib
        scatter_block(blk, torch.cat([bv + t, H], dim=-2), out)
        return out

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            # t = -b_V: b_V → 0 and b_O → b_O + W_O b_V
            return self._shift(params, lambda bv: -bv, -1.0), self.frozen(params)

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return self._shift(
                params, lambda bv: a * _randn(bv.shape, generator, bv.dtype, bv.device), -1.0)

    def describe(self) -> dict:
        d = super().describe()
        d.update(part=(self.part.param, self.part.layout, self.part.offset),
                 out=[(q.param, q.layout, q.offset) for q in self.out], out_bias=self.out_bias)
        return d


@dataclass(frozen=True)
class QKNormScaleFold(Fold):
    r"""The gains of a q/k norm, balanced per class: $γ_q ← c ⊙ γ_q$, $γ_k ← γ_k ⊘ c$.

    With q/k norms the attention scores are $(γ_q ⊙ \hat q)^\top R (γ_k ⊙ \hat k)$ (with
    $R = R_i^\top R_j$ for rotary embeddings), unchanged when $γ_q$ is scaled by $c$ and
    $γ_k$ by $1/c$, for any $c$ that is constant on each class: each coordinate without rotary
    embeddings, each rotated pair with them, shared by the query heads of one K/V group.
    The gains of q/k norms shared by all heads give one class per coordinate (or pair).

    Canonical representative: per class $k$, $c_k = s_k (‖γ_{k}‖ / ‖γ_{q}‖)^{1/2}$ over the
    class's entries, with the sign $s_k$ that makes $\sum γ_q$ positive; afterwards
    $‖γ_q‖ = ‖γ_k‖$ on every class.  Nothing is frozen (the canonical set is not a set of
    fixed entries), but the canonical point is the same for every element of the orbit.

    Attributes
    ----------
    q_weight, k_weight : str
        The gains' parameters $w$ ($γ = o + w$).
    q_bias, k_bias : str or None
        LayerNorm shifts, scaled with the gains.
    q_offset, k_offset : float
        $o$ of each norm.
    q_class, k_class : tuple of int
        The class of every gain entry.
    layout : str
        Which classes were tried and confirmed (`"coordinate"`, `"rotate_half"`,
        `"interleaved"`).
    """

    q_weight: str = ""
    k_weight: str = ""
    q_bias: str | None = None
    k_bias: str | None = None
    q_offset: float = 0.0
    k_offset: float = 0.0
    q_class: tuple[int, ...] = ()
    k_class: tuple[int, ...] = ()
    layout: str = "coordinate"

    kind = "qk_norm"

    @property
    def params(self) -> tuple[str, ...]:
        names = (self.q_weight, self.q_bias, self.k_weight, self.k_bias)
        return tuple(n for n in names if n is not None)

    def _n(self) -> int:
        return max(max(self.q_class), max(self.k_class)) + 1

    def _scale(self, params, c: torch.Tensor) -> dict:
        out = dict(params)
        qi = torch.tensor(self.q_class, device=c.device)
        ki = torch.tensor(self.k_class, device=c.device)
        cq, ck = c[qi], c[ki]
        wq, wk = out[self.q_weight], out[self.k_weight]
        out[self.q_weight] = cq.to(wq.dtype) * (wq + self.q_offset) - self.q_offset
        out[self.k_weight] = (wk + self.k_offset) / ck.to(wk.dtype) - self.k_offset
        if self.q_bias is not None:
            out[self.q_bias] = cq.to(wq.dtype) * out[self.q_bias]
        if self.k_bias is not None:
            out[self.k_bias] = out[self.k_bias] / ck.to(wk.dtype)
        return out

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            wq, wk = params[self.q_weight], params[self.k_weight]
            gq = (wq + self.q_offset).to(torch.float64)
            gk = (wk + self.k_offset).to(torch.float64)
            n = self._n()
            qi = torch.tensor(self.q_class, device=wq.device)
            ki = torch.tensor(self.k_class, device=wq.device)
            sq = torch.zeros(n, dtype=torch.float64, device=wq.device).index_add(0, qi, gq * gq)
            sk = torch.zeros(n, dtype=torch.float64, device=wq.device).index_add(0, ki, gk * gk)
            if self.q_bias is not None:
                bq = params[self.q_bias].to(torch.float64)
                sq = sq.index_add(0, qi, bq * bq)
            if self.k_bias is not None:
                bk = params[self.k_bias].to(torch.float64)
                sk = sk.index_add(0, ki, bk * bk)
            ok = (sq > 0) & (sk > 0)
            c = torch.where(ok, (sk / torch.where(ok, sq, 1.0)) ** 0.25, 1.0)
            total = torch.zeros(n, dtype=torch.float64, device=wq.device).index_add(0, qi, gq)
            c = torch.where(total < 0, -c, c)
            return self._scale(params, c), {}

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            w = params[self.q_weight]
            c = _random_scale((self._n(),), generator, a, torch.float64, w.device)
            return self._scale(params, c)

    def describe(self) -> dict:
        d = super().describe()
        d.update(layout=self.layout, classes=self._n())
        return d


#: the order in which folds are applied (a norm fold writes consumer biases that the
#: key/value folds then canonicalise)
ORDER = {NormGainFold: 0, KeyBiasFold: 1, ValueBiasFold: 2, QKNormScaleFold: 3}


# -- applying folds, stripping blocks -----------------------------------------------------------
def apply_folds(
    folds: Sequence[Fold], params: Params
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    r"""The canonical point of `params` and the frozen masks of `folds`, applied in order.

    A pure function: `params` is not modified, and tensors that no fold touches are passed
    through (not copied).

    Returns
    -------
    (dict, dict)
        `{name: tensor}` of every parameter and `{name: bool mask}` of the entries the folds
        fix (shaped like the parameter; names absent from it have no frozen entry).
    """
    out: dict[str, torch.Tensor] = dict(params)
    frozen: dict[str, torch.Tensor] = {}
    for f in folds:
        out, fr = f.apply(out)
        _merge(frozen, fr)
    return out, frozen


# -- probing -------------------------------------------------------------------------------------
_NORM_NAME = re.compile(r"(layer|rms).?norm", re.IGNORECASE)


def _is_norm(m: nn.Module) -> bool:
    if isinstance(m, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
        return getattr(m, "weight", None) is not None
    w = getattr(m, "weight", None)
    return (bool(_NORM_NAME.search(type(m).__name__)) and isinstance(w, nn.Parameter)
            and w.dim() == 1)


def _norm_weight(m: nn.Module) -> torch.Tensor:
    """The gain of a module that `_is_norm` accepts (it has one)."""
    w = m.weight
    assert isinstance(w, torch.Tensor)
    return w


def _is_conv1d(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (type(m).__name__ == "Conv1D" and isinstance(w, nn.Parameter) and w.dim() == 2
            and hasattr(m, "nf"))


def _storage(t) -> int | None:
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
    return None


def _tensors(x) -> list[torch.Tensor]:
    """Every floating-point output tensor, skipping key/value caches."""
    if isinstance(x, torch.Tensor):
        return [x] if x.is_floating_point() else []
    if isinstance(x, Mapping):
        return [t for k, v in x.items() if not any(s in str(k) for s in ("past", "cache"))
                for t in _tensors(v)]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return []


def _default_inputs(model: nn.Module, generator: torch.Generator) -> tuple[tuple, dict] | None:
    """A small input for the model
    ([`example_inputs`][quotient_manifolds.models.probe.example_inputs]), or None."""
    try:
        return example_inputs(model, generator)
    except Exception:  # noqa: BLE001 - no input is known for this model
        return None


#: Rows of the example input (along dim 0) on which folds are probed: the forward passes of
#: the probes are the cost of discovery under the full group, and a random group element
#: that is not a symmetry changes the output of every row.
PROBE_ROWS = 2


def _leading(tree) -> int | None:
    """Dim-0 size of the first tensor (of dim ≥ 1) in `tree`, or None."""
    if isinstance(tree, torch.Tensor):
        return int(tree.shape[0]) if tree.dim() else None
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(
        tree, (tuple, list)) else ()
    for x in items:
        n = _leading(x)
        if n is not None:
            return n
    return None


def _first_rows(tree, rows: int, batch: int | None = None):
    """`tree` with every tensor whose dim 0 has the batch size (that of the first tensor, or
    `batch`) cut to its first `rows` rows."""
    batch = _leading(tree) if batch is None else batch
    if batch is None or batch <= rows:
        return tree
    if isinstance(tree, torch.Tensor):
        return tree[:rows] if tree.dim() and tree.shape[0] == batch else tree
    if isinstance(tree, (tuple, list)):
        return type(tree)(_first_rows(x, rows, batch) for x in tree)
    if isinstance(tree, dict):
        return {k: _first_rows(x, rows, batch) for k, x in tree.items()}
    return tree


class _Prober:
    """A float64 copy of a model, one traced forward pass, and function-preservation probes."""

    def __init__(self, model: nn.Module, inputs: tuple[tuple, dict], seed: int = 0) -> None:
        self.model = float64_copy(model)  # without the user's hooks
        dev = _device(self.model)
        args = _cast_tree(tuple(inputs[0]), torch.float64, dev)
        kwargs = _cast_tree(dict(inputs[1]), torch.float64, dev)
        try:
            if "use_cache" in inspect.signature(self.model.forward).parameters:
                kwargs.setdefault("use_cache", False)
        except (TypeError, ValueError):
            pass
        self.gen = torch.Generator().manual_seed(seed)
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        self.users: dict[int, int] = {}
        for _, m in self.model.named_modules(remove_duplicate=False):
            for p in m.parameters(recurse=False):
                self.users[id(p)] = self.users.get(id(p), 0) + 1
        self.params = {n: p.detach() for n, p in self.model.named_parameters()}
        self.buffers = {n: b.detach() for n, b in self.model.named_buffers()}
        self.modules = dict(self.model.named_modules())
        self.calls: list[tuple[str, tuple, dict, object]] = []
        batch = _leading((tuple(args), kwargs))
        self.args = _first_rows(tuple(args), PROBE_ROWS, batch)
        self.kwargs = _first_rows(kwargs, PROBE_ROWS, batch)
        try:
            with torch.no_grad():
                self.ref = self._trace()
        except Exception:  # noqa: BLE001 -- dim 0 was not a batch dimension: the whole input
            if batch is None or batch <= PROBE_ROWS:
                raise
            self.args, self.kwargs, self.calls = tuple(args), kwargs, []
            with torch.no_grad():
                self.ref = self._trace()

    def pname(self, p) -> str | None:
        return None if p is None else self.names.get(id(p))

    def name(self, p: torch.Tensor) -> str:
        """The name of `p`, a parameter of the model (KeyError if it is none, e.g. the tensor
        that a parametrisation computes)."""
        n = self.names.get(id(p))
        if n is None:
            raise KeyError(f"a tensor of shape {tuple(p.shape)} is not a parameter of the model")
        return n

    def tied(self, name: str) -> bool:
        """Whether the parameter is used by more than one module (tied weights)."""
        p = dict(self.model.named_parameters())[name]
        return self.users.get(id(p), 0) > 1

    def _trace(self):
        hooks = []

        def hook(name):
            def f(mod, args, kwargs, out):
                self.calls.append((name, args, kwargs, out))
            return f

        for name, m in self.model.named_modules():
            hooks.append(m.register_forward_hook(hook(name), with_kwargs=True))
        try:
            with _no_fastpath(), float64_internals():  # the fused path calls no submodule
                out = self.model(*self.args, **self.kwargs)
        finally:
            for hk in hooks:
                hk.remove()
        return [t.detach() for t in _tensors(out)]

    def run(self, params: Params) -> list[torch.Tensor]:
        d = dict(params)
        d.update(self.buffers)
        with torch.no_grad(), _no_fastpath(), float64_internals():
            out = torch.func.functional_call(self.model, d, self.args, self.kwargs)
        return [t.detach() for t in _tensors(out)]

    def change(self, params: Params) -> float:
        """Largest relative output change of the model at `params`, against the traced run."""
        out = self.run(params)
        if len(out) != len(self.ref):
            return math.inf
        worst = 0.0
        for a, b in zip(self.ref, out, strict=True):
            if a.shape != b.shape:
                return math.inf
            scale = float(a.abs().max()) if a.numel() else 0.0
            diff = float((a - b).abs().max()) if a.numel() else 0.0
            if not math.isfinite(diff):
                return math.inf
            worst = max(worst, diff / max(scale, 1e-300))
        return worst

    def probe(self, fold: Fold | _JointAct, repeats: int = 1) -> float:
        """Relative output change under random elements of the fold's group (0 if exact)."""
        worst = 0.0
        for _ in range(repeats):
            worst = max(worst, self.change(fold.act(self.params, self.gen)))
        return worst

    # -- structure ------------------------------------------------------------------
    def norm_calls(self):
        for name, args, kwargs, out in self.calls:
            m = self.modules.get(name)
            if m is not None and _is_norm(m) and isinstance(out, torch.Tensor):
                yield name, m, args, kwargs, out

    def consumers(self, ptr: int | None, d: int) -> tuple[list[Consumer], list[str]] | None:
        """The linear maps whose input shares storage `ptr`, and the names of their modules.

        None when a module with its own parameters that is not a known linear map reads it.
        """
        found: dict[tuple, Consumer] = {}
        mods: list[str] = []
        for name, args, kwargs, _ in self.calls:
            m = self.modules.get(name)
            if m is None or not any(True for _ in m.parameters(recurse=False)):
                continue
            if isinstance(m, nn.MultiheadAttention):
                slots = [args[i] if len(args) > i else kwargs.get(k)
                         for i, k in enumerate(("query", "key", "value"))]
                d_e = m.embed_dim
                for i, t in enumerate(slots):
                    if _storage(t) != ptr:
                        continue
                    b = self.pname(m.in_proj_bias)
                    if m._qkv_same_embed_dim:
                        c = Consumer(self.name(m.in_proj_weight), 1, i * d_e, (i + 1) * d_e, b)
                    else:
                        w = (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)[i]
                        if b is not None:
                            return None  # separate weights with a fused bias: not supported
                        c = Consumer(self.name(w), 1, 0, -1, None)
                    found[(c.weight, c.start)] = c
                    mods.append(name)
                continue
            x = args[0] if args else kwargs.get("input", kwargs.get("x"))
            if _storage(x) != ptr:
                continue
            qkv = getattr(m, "qkv", None)
            qb, vb = getattr(m, "q_bias", None), getattr(m, "v_bias", None)
            if (isinstance(qkv, nn.Linear) and isinstance(qb, nn.Parameter) and qkv.in_features == d
                    and isinstance(vb, nn.Parameter) and qkv.out_features == 3 * qb.numel()):
                # timm BEiT/EVA: F.linear(x, qkv.weight, cat(q_bias, k_bias, v_bias)) with a
                # zero key-bias buffer, so the qkv module itself is never called
                a, wn = qb.numel(), self.name(qkv.weight)
                for c in (Consumer(wn, 1, 0, a, self.pname(qb), 0), Consumer(wn, 1, a, 2 * a),
                          Consumer(wn, 1, 2 * a, 3 * a, self.pname(vb), 0)):
                    found[(c.weight, c.start)] = c
                mods.append(name)
                continue
            if isinstance(m, nn.Linear) and m.in_features == d:
                c = Consumer(self.name(m.weight), 1, 0, -1, self.pname(m.bias))
            elif _is_conv1d(m) and m.weight.shape[0] == d:
                c = Consumer(self.name(m.weight), 0, 0, -1, self.pname(m.bias))
            else:
                return None
            found[(c.weight, c.start)] = c
            mods.append(name)
        return list(found.values()), mods

    def reaches_only(self, norm: str, consumer_modules: Sequence[str]) -> bool:
        """Whether the norm's output reaches the outputs only through `consumer_modules`.

        One forward and backward pass with the consumers' inputs detached: the gradient of
        the outputs with respect to the norm's output is then zero exactly when no other path
        (a residual connection, a returned hidden state) reads it.
        """
        store: dict = {}
        mods = set(consumer_modules)
        ptrs: set = set()
        hooks = []

        def post(mod, args, out):
            y = out.detach().requires_grad_(True)
            store["y"] = y
            ptrs.add(_storage(y))
            return y

        def pre(mod, args, kwargs):
            cut = tuple(a.detach() if _storage(a) in ptrs else a for a in args)
            kw = {k: (v.detach() if _storage(v) in ptrs else v) for k, v in kwargs.items()}
            return cut, kw

        hooks.append(self.modules[norm].register_forward_hook(post))
        for name in mods:
            hooks.append(self.modules[name].register_forward_pre_hook(pre, with_kwargs=True))
        try:
            with torch.enable_grad(), _no_fastpath(), float64_internals():
                d = {n: p.detach() for n, p in self.params.items()}
                d.update(self.buffers)
                out = _tensors(torch.func.functional_call(self.model, d, self.args,
                                                          self.kwargs))
                y = store.get("y")
                if y is None:
                    return False
                outs = [t for t in out if t.requires_grad]
                if not outs:
                    return True
                gen = self.gen
                total = functools.reduce(operator.add, (
                    (t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in outs))
                (g,) = torch.autograd.grad(total, [y], allow_unused=True)
        finally:
            for hk in hooks:
                hk.remove()
        return g is None or not bool(g.abs().max() > 0)

    def offset(self, name: str, m: nn.Module, args, kwargs) -> float | None:
        """`o` in `γ = o + w`, from two calls of the norm alone (None if `w` is unused)."""
        w = self.name(_norm_weight(m))
        b = self.pname(getattr(m, "bias", None)) if isinstance(
            getattr(m, "bias", None), nn.Parameter) else None
        prefix = name + "." if name else ""

        def call(wv):
            d = {w[len(prefix):]: wv}
            if b is not None:
                d[b[len(prefix):]] = torch.zeros_like(self.params[b])
            with torch.no_grad(), float64_internals():
                return torch.func.functional_call(m, d, args, kwargs)

        y0 = call(torch.zeros_like(self.params[w]))
        y1 = call(torch.ones_like(self.params[w]))
        if not (isinstance(y0, torch.Tensor) and isinstance(y1, torch.Tensor)):
            return None
        dy = y1 - y0
        sel = dy.abs() > 1e-6 * float(dy.abs().max() or 1.0)
        if not bool(sel.any()):
            return None
        return float(round(float((y0[sel] / dy[sel]).median()), 6))


def _rotary_dims(attn: nn.Module, h: int) -> list[int]:
    cfg = getattr(attn, "config", None)
    dims = [h]
    for key in ("partial_rotary_factor", "rotary_pct"):
        f = getattr(cfg, key, None)
        if f:
            dims.append(int(h * float(f)))
    r = getattr(cfg, "rotary_dim", None)
    if r:
        dims.append(int(r))
    return [r for r in dict.fromkeys(dims) if r >= 2 and r % 2 == 0]


def _class_layouts(h: int, dims: Sequence[int]) -> list[tuple[str, list[int]]]:
    """Candidate coordinate classes of a q/k-norm gain of size `h`, finest group first."""
    out = [("coordinate", list(range(h)))]
    for r in dims:
        half = r // 2
        out.append((f"rotate_half(r={r})",
                    [j % half if j < r else half + (j - r) for j in range(h)]))
        out.append((f"interleaved(r={r})",
                    [j // 2 if j < r else half + (j - r) for j in range(h)]))
    return out


def _qk_candidates(p: _Prober, name: str, attn: nn.Module) -> list[QKNormScaleFold]:
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if not (isinstance(qn, nn.Module) and isinstance(kn, nn.Module) and _is_norm(qn)
            and _is_norm(kn)):
        return []
    cfg = getattr(attn, "config", None)
    heads = (getattr(attn, "num_heads", None) or getattr(attn, "num_attention_heads", None)
             or getattr(cfg, "num_attention_heads", None))
    h = getattr(attn, "head_dim", None) or getattr(cfg, "head_dim", None)
    q_weight, k_weight = _norm_weight(qn), _norm_weight(kn)
    lq, lk = q_weight.numel(), k_weight.numel()
    if not h:
        h = lq if lq == lk else (lq // heads if heads else None)
    if not heads or not h:
        return []
    kv = (getattr(attn, "num_key_value_heads", None) or getattr(attn, "num_kv_heads", None)
          or getattr(cfg, "num_key_value_heads", None) or heads)
    r = max(1, heads // max(1, kv))
    offsets: dict[str, float] = {}
    for nm, m in (("q", qn), ("k", kn)):
        call = next(((a, k) for n2, a, k, _ in p.calls if p.modules.get(n2) is m), None)
        if call is None:
            return []
        off = p.offset(f"{name}.{nm}_norm", m, *call)
        if off is None:
            return []
        offsets[nm] = off
    out = []
    for layout, cls in _class_layouts(int(h), _rotary_dims(attn, int(h))):
        C = max(cls) + 1
        if lq == h and lk == h:
            qc, kc = cls, cls
        elif lq == heads * h and lk == kv * h:
            qc = [(e // h // r) * C + cls[e % h] for e in range(lq)]
            kc = [(e // h) * C + cls[e % h] for e in range(lk)]
        else:
            return []
        bq = p.pname(getattr(qn, "bias", None)) if isinstance(getattr(qn, "bias", None),
                                                               nn.Parameter) else None
        bk = p.pname(getattr(kn, "bias", None)) if isinstance(getattr(kn, "bias", None),
                                                               nn.Parameter) else None
        out.append(QKNormScaleFold(name, p.name(q_weight), p.name(k_weight), bq, bk,
                                   offsets["q"], offsets["k"], tuple(qc), tuple(kc), layout))
    return out


def _fallback(module: str, kind: str, reason: str) -> Fallback:
    return Fallback(module, kind, reason)


def _passing(p: _Prober, folds: Sequence[Fold]) -> list[bool]:
    """Which candidates pass their probe, by group testing.

    All candidates are probed together (one forward pass); only a failing group is halved.
    Every candidate is a symmetry exactly when the joint random element leaves the outputs
    unchanged (barring a cancellation of probability zero).
    """
    if not folds:
        return []
    if p.probe(_JointAct(folds)) <= PROBE_RTOL:
        return [True] * len(folds)
    if len(folds) == 1:
        return [False]
    k = len(folds) // 2
    return _passing(p, folds[:k]) + _passing(p, folds[k:])


def _select(p: _Prober, alternatives: Sequence[Sequence[Fold]]) -> list[Fold | None]:
    """For each structure, the first of its alternative folds that passes (None if none)."""
    chosen: list[Fold | None] = [None] * len(alternatives)
    pending = [i for i, alt in enumerate(alternatives) if alt]
    r = 0
    while pending:
        ok = _passing(p, [alternatives[i][r] for i in pending])
        nxt = []
        for i, good in zip(pending, ok, strict=True):
            if good:
                chosen[i] = alternatives[i][r]
            elif r + 1 < len(alternatives[i]):
                nxt.append(i)
        pending, r = nxt, r + 1
    return chosen


def _norm_folds(p: _Prober, fallbacks: list, excluded: set) -> list[Fold]:
    structures: list[tuple[str, list[str], list[NormGainFold]]] = []
    seen: set = set()
    for name, m, args, kwargs, y in p.norm_calls():
        if name in seen or name in excluded:
            continue
        seen.add(name)
        d = m.weight.numel()
        if y.shape[-1] != d:
            continue
        found = p.consumers(_storage(y), d)
        if found is None or not found[0]:
            continue  # read by an unknown module, or by no linear map: not a pre-norm
        cons, mods = found
        w = p.name(_norm_weight(m))
        bias = getattr(m, "bias", None)
        b = p.pname(bias) if isinstance(bias, nn.Parameter) else None
        offset = p.offset(name, m, args, kwargs)
        if offset is None:
            continue
        tied = [c.weight for c in cons if p.tied(c.weight)]
        if tied:
            if p.reaches_only(name, mods):
                fallbacks.append(_fallback(name, "norm", (
                    f"the norm's gain feeds {tied[0]!r}, which is tied to another module "
                    "(e.g. the input embedding); folding the gain would change that module, so "
                    "the gain symmetry is not removed")))
            continue
        g = p.params[w] + offset
        cands = []
        if b is None:
            cands.append(NormGainFold(name, w, None, offset, tuple(cons), "none"))
        else:
            cands.append(NormGainFold(name, w, b, offset, tuple(cons), "fold"))
            if bool((g != 0).all()):
                cands.append(NormGainFold(name, w, b, offset, tuple(cons), "scale"))
        structures.append((name, mods, cands))
    chosen = _select(p, [c for _, _, c in structures])
    folds: list[Fold] = []
    for (name, mods, cands), f in zip(structures, chosen, strict=True):
        if f is not None:
            folds.append(f)
            continue
        if not p.reaches_only(name, mods):
            continue  # post-norm (residual) or a returned hidden state: no symmetry
        worst = min(p.probe(c) for c in cands)
        if cands[0].bias is not None and len(cands) == 1:
            why = "its shift cannot be folded into the consumers and the gain has zero entries"
        else:
            why = f"a random gain scaling changed the output by {worst:.1e} (relative)"
            if worst < 1e-5:
                why += (", about float32 rounding: the norm may compute in float32 "
                        "internally, which a float64 probe cannot confirm")
        fallbacks.append(_fallback(name, "norm", f"pre-norm structure found, but {why}; "
                                   "the gain symmetry is not removed"))
    return folds


def _blocks_of(blocks: Iterable[BlockSpec], kind: str) -> list[BlockSpec]:
    return [b for b in blocks if b.kind == kind]


def _out_bias(p: _Prober, part: FactorPart) -> str | None:
    """The bias of the module whose weight is `part.param` (the output projection)."""
    for m in p.modules.values():
        w = getattr(m, "weight", None)
        if isinstance(w, nn.Parameter) and p.pname(w) == part.param:
            b = getattr(m, "bias", None)
            return p.pname(b) if isinstance(b, nn.Parameter) else None
        if isinstance(m, nn.MultiheadAttention) and p.pname(m.out_proj.weight) == part.param:
            return p.pname(m.out_proj.bias)
    return None


def _bias_folds(p: _Prober, blocks: Sequence[BlockSpec]) -> list[Fold]:
    cands: list[Fold] = []
    for b in _blocks_of(blocks, "attention.qk"):
        cands += [KeyBiasFold(b.module, part, b.heads, b.h) for part in b.G + b.H
                  if part.layout == "bias"]
    for b in _blocks_of(blocks, "attention.vo"):
        # H must be the output weight alone (one part, or stacked parts of the one weight)
        if not b.H or any(q.layout == "bias" or q.param != b.H[0].param for q in b.H):
            continue
        ob = _out_bias(p, b.H[0])
        if ob is None:
            continue
        cands += [ValueBiasFold(b.module, part, tuple(b.H), ob, b.heads, b.h) for part in b.G
                  if part.layout == "bias" and getattr(part, "stack", 1) == 1]
    return [f for f in _select(p, [[c] for c in cands]) if f is not None]


def _qk_norm_folds(p: _Prober, fallbacks: list) -> tuple[list[Fold], set]:
    structures: list[tuple[str, Sequence[Fold]]] = []
    extra: list[Fold] = []
    names: set = set()
    for name, m in p.modules.items():
        cands = _qk_candidates(p, name, m)
        if not cands:
            continue
        names.update({f"{name}.q_norm", f"{name}.k_norm"})
        structures.append((name, cands))
        kb = cands[0].k_bias
        if kb is not None:  # a LayerNorm k_norm's shift is added to every key: dead
            extra.append(KeyBiasFold(name, FactorPart(kb, "bias", 0), 1, p.params[kb].numel()))
    chosen = _select(p, [c for _, c in structures])
    for (name, _), f in zip(structures, chosen, strict=True):
        if f is None:
            fallbacks.append(_fallback(name, "qk_norm", (
                "no per-coordinate or per-rotary-pair scaling of the q/k norm gains left the "
                "output unchanged; the gain symmetry is not removed")))
    folds = [f for f in chosen if f is not None]
    folds += [f for f in _select(p, [[c] for c in extra]) if f is not None]
    return folds, names


def find_folds(
    model: nn.Module,
    blocks: Sequence[BlockSpec],
    *,
    example_inputs: tuple[tuple, dict] | None = None,
    seed: int = 0,
) -> tuple[list[Fold], list]:
    r"""The folds of `model`, each confirmed by a function-preservation probe.

    Candidates come from one traced forward pass of a float64 copy of the model (the model
    itself is never run or changed):

    * a LayerNorm/RMSNorm whose output is read only by linear maps (`nn.Linear`, GPT-2's
      `Conv1D`, the input projections of `nn.MultiheadAttention`) and reaches the outputs
      through nothing else: a pre-norm.  Post-norm blocks (BERT), whose norm output is also
      the residual stream, have no such symmetry and are skipped;
    * every bias row of a Q/K block (the key bias), every bias row of a V/O block whose output
      projection has a bias (the value bias);
    * the `q_norm`/`k_norm` pair of an attention module (Qwen3, OLMo2, Gemma3, timm).

    Each candidate is kept only if a random element of its group leaves every output of the
    copy unchanged to [`PROBE_RTOL`][quotient_manifolds.models.probe.PROBE_RTOL]
    (relative).  At the end, all kept folds together are probed once more, and the canonical
    point is checked to compute the same function.

    Parameters
    ----------
    model : nn.Module
        Only read (deep-copied to float64).
    blocks : sequence of BlockSpec
        The model's resolved GL blocks (bias rows included, as discovered).
    example_inputs : optional
        An input the model accepts: `(args, kwargs)`, a dict of keyword arguments, a tuple of
        positional arguments or a tensor.  Default: a small random input derived from the
        model's configuration (Hugging Face, timm); without one, or if the model fails on it,
        no fold is claimed and a fallback says so.
    seed : int
        Seed of the probe inputs and group elements.

    Returns
    -------
    (list of Fold, list of Fallback)
        The folds, in application order, and the structures that look like a symmetry but are
        not removed, with the reason.
    """
    gen = torch.Generator().manual_seed(seed)
    # only norm layers and bias rows of the blocks can fold: without either there is nothing
    # to probe (and nothing to report)
    if not (any(_is_norm(m) for m in model.modules())
            or any(q.layout == "bias" for b in blocks for q in (*b.G, *b.H))):
        return [], []
    inputs = example_inputs if example_inputs is not None else _default_inputs(model, gen)
    if inputs is None:
        return [], [_fallback("", "folds", (
            "no example input is known for this model, so norm gains and bias "
            "translations cannot be probed and are not removed; pass "
            "example_inputs=(args, kwargs)"))]
    try:
        p = _Prober(model, normalize_inputs(inputs), seed)
    except Exception as e:  # noqa: BLE001 - any failure of the user's forward pass
        return [], [_fallback("", "folds", (
            f"the model failed on the example input ({type(e).__name__}: {e}), so no fold can "
            "be probed; pass example_inputs= with an input the model accepts"))]
    if not p.ref or not all(bool(torch.isfinite(t).all()) for t in p.ref):
        return [], [_fallback("", "folds", (
            "the model's output on the example input has no floating-point tensor, or a "
            "non-finite one, so no probe can confirm a fold; pass example_inputs= with an input "
            "that gives finite outputs"))]
    fallbacks: list = []
    qk, qk_names = _qk_norm_folds(p, fallbacks)
    folds = _norm_folds(p, fallbacks, qk_names) + _bias_folds(p, blocks) + qk
    folds.sort(key=lambda f: ORDER[type(f)])
    if folds:
        joint = _JointAct(folds)
        err = max(p.probe(joint), p.change(apply_folds(folds, p.params)[0]))
        if err > PROBE_RTOL:  # folds that pass one by one but not together: claim none
            return [], fallbacks + [_fallback("", "folds", (
                f"the folds pass one by one but together change the output by {err:.1e}; "
                "none is claimed"))]
    return folds, fallbacks


class _JointAct:
    """Every fold's random group element, one after the other (for the joint probe)."""

    def __init__(self, folds: Sequence[Fold]) -> None:
        self.folds = tuple(folds)

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        for f in self.folds:
            params = f.act(params, generator, a)
        return dict(params)
