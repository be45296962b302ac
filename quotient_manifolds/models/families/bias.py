r"""Bias translations of attention: the dead key bias, and the value bias through the output.

Softmax rows sum to one and are unchanged by a constant added along them, so two bias
translations of attention change nothing: a key bias $b_K$ adds $q_i^\top b_K$ to every score
of query $i$ ([`KeyBiasFold`][quotient_manifolds.models.families.bias.KeyBiasFold]), and a value
bias reaches the output as the constant $W_O b_V$
([`ValueBiasFold`][quotient_manifolds.models.families.bias.ValueBiasFold]).
[`BiasTranslations`][quotient_manifolds.models.families.bias.BiasTranslations] proposes one fold
per bias row of the verified attention blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..blocks import BlockSpec, FactorPart, claimed_mask, gather_block, scatter_block
from ..prober import Prober
from ..symmetry import Fold, Scene, SymmetryFamily, random_normal

__all__ = ["BiasTranslations", "KeyBiasFold", "ValueBiasFold"]

Params = Mapping[str, torch.Tensor]


def _part_block(part: FactorPart, heads: int, h: int, module: str = "") -> BlockSpec:
    """A one-part block, to read, write and mark a factor part with the block machinery."""
    return BlockSpec("custom", module, heads, h, (part,), (part,))


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

    part: FactorPart
    heads: int = 1
    h: int = 1

    kind = "key_bias"
    order = 1

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
            return self._write(params, lambda x: x + a * random_normal(x.shape, generator, x.dtype,
                                                                 x.device))

    def lie_dim(self, params: Params) -> int:
        return int(claimed_mask(self._block(), params)[self.part.param].sum())

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._write(params, lambda x: x + theta.to(x.dtype).view(x.shape))

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

    part: FactorPart
    out: tuple[FactorPart, ...] = ()
    out_bias: str = ""
    heads: int = 1
    h: int = 1

    kind = "value_bias"
    order = 2

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
            return self._shift(params, lambda bv: a * random_normal(
                bv.shape, generator, bv.dtype, bv.device), -1.0)

    def lie_dim(self, params: Params) -> int:
        return self.heads * self.h

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._shift(params, lambda bv: theta.to(bv.dtype).view(bv.shape), -1.0)

    def describe(self) -> dict:
        d = super().describe()
        d.update(part=(self.part.param, self.part.layout, self.part.offset),
                 out=[(q.param, q.layout, q.offset) for q in self.out], out_bias=self.out_bias)
        return d


def _out_bias(p: Prober, part: FactorPart) -> str | None:
    """The bias of the module whose weight is `part.param` (the output projection)."""
    for m in p.modules.values():
        w = getattr(m, "weight", None)
        if isinstance(w, nn.Parameter) and p.pname(w) == part.param:
            b = getattr(m, "bias", None)
            return p.pname(b) if isinstance(b, nn.Parameter) else None
        if isinstance(m, nn.MultiheadAttention) and p.pname(m.out_proj.weight) == part.param:
            return p.pname(m.out_proj.bias)
    return None


class BiasTranslations(SymmetryFamily):
    """The key bias of every Q/K block and the value bias of every V/O block whose output
    projection has a bias."""

    name = "bias translations"
    kind = "folds"
    symmetries = ("complete", "full")

    def present(self, scene: Scene) -> bool:
        return any(q.layout == "bias" for b in scene.blocks for q in (*b.G, *b.H))

    def find(self, scene: Scene) -> None:
        p = scene.prober
        for b in scene.blocks:
            if b.kind == "attention.qk":
                for part in b.G + b.H:
                    if part.layout == "bias":
                        scene.propose([KeyBiasFold(b.module, part, b.heads, b.h)])
        for b in scene.blocks:
            # H must be the output weight alone (one part, or stacked parts of the one weight)
            if b.kind != "attention.vo" or not b.H or any(
                    q.layout == "bias" or q.param != b.H[0].param for q in b.H):
                continue
            ob = _out_bias(p, b.H[0])
            if ob is None:
                continue
            for part in b.G:
                if part.layout == "bias" and part.stack == 1:
                    scene.propose([ValueBiasFold(b.module, part, tuple(b.H), ob, b.heads, b.h)])
