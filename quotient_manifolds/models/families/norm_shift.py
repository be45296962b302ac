r"""The shift of a post-norm LayerNorm: moved into its readers' biases and past the residual.

In a post-norm block the output $y = \gamma \odot \hat x + \beta$ of a LayerNorm is read by linear
maps $z_j = W_j y + b_j$ and, through the residual connection, added to the input of the next
LayerNorm, $x' = y + W_o a + b_o$. Then $(\beta + t,\ b_j - W_j t,\ b_o - t)$ leaves every
$z_j$ and $x'$ unchanged, for every $t \in \mathbb R^d$
([`NormShiftFold`][quotient_manifolds.models.families.norm_shift.NormShiftFold]). (A pre-norm's
shift, read by linear maps only, is folded with its gain by the norm gain family.)

Canonical representative: $\beta = 0$ (frozen), its value moved into the readers' biases and the
compensating bias $b_o$. [`NormShifts`][quotient_manifolds.models.families.norm_shift.NormShifts]
takes as $b_o$ the bias of the last width-$d$ linear map called before the next LayerNorm (the
sublayer's output projection); the probe confirms it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..linear import Consumer, ReadQuery, linear_layer, readers_of, storage
from ..norms import is_norm, norm_bias
from ..prober import Prober
from ..symmetry import Fold, Scene, SymmetryFamily, full_mask, random_normal, rms
from .centring import centres

__all__ = ["NormShiftFold", "NormShifts", "TableShiftFold"]

Params = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class NormShiftFold(Fold):
    r"""$(\beta, b_j, b_o) \mapsto (\beta + t, b_j - W_j t, b_o - t)$; canonical representative
    $\beta = 0$ (frozen)."""

    shift: str = ""
    consumers: tuple[Consumer, ...] = ()
    residual_bias: str = ""

    kind = "norm_shift"
    order = 0.25

    @property
    def params(self) -> tuple[str, ...]:
        names = [self.shift, self.residual_bias]
        names += [n for c in self.consumers for n in (c.weight, c.bias) if n is not None]
        return tuple(dict.fromkeys(names))

    def _move(self, params: Params, t: torch.Tensor) -> dict[str, torch.Tensor]:
        out = dict(params)
        beta = out[self.shift]
        out[self.shift] = beta + t.to(beta.dtype)
        for c in self.consumers:
            M, b = c.read(out)
            if b is not None:
                c.write_bias(out, b - M @ t.to(M.dtype))
        rb = out[self.residual_bias]
        out[self.residual_bias] = rb - t.to(rb.dtype)
        return out

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            return self._move(params, -params[self.shift]), self.frozen(params)

    def frozen(self, params: Params) -> dict[str, torch.Tensor]:
        return {self.shift: full_mask(params, self.shift)}

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        beta = params[self.shift]
        return self._move(params, a * rms(beta) * random_normal(beta.shape, generator,
                                                                beta.dtype, beta.device))

    def lie_dim(self, params: Params) -> int:
        return params[self.shift].numel()

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._move(params, theta.view(params[self.shift].shape))


@dataclass(frozen=True)
class TableShiftFold(NormShiftFold):
    r"""The same with an embedding table $E$ in place of $\beta$, read directly by the first
    post-norm block (`nn.TransformerEncoder` over token embeddings): $(E + \mathbb 1 t^\top,
    b_j - W_j t, b_o - t)$; canonical representative $E[0] = 0$ (frozen)."""

    kind = "table_shift"

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            return self._move(params, -params[self.shift][0]), self.frozen(params)

    def frozen(self, params: Params) -> dict[str, torch.Tensor]:
        E = params[self.shift]
        mask = torch.zeros(E.shape, dtype=torch.bool, device=E.device)
        mask[0] = True
        return {self.shift: mask}

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        E = params[self.shift]
        return self._move(params, a * rms(E) * random_normal(E.shape[-1:], generator, E.dtype,
                                                             E.device))

    def lie_dim(self, params: Params) -> int:
        return int(params[self.shift].shape[-1])

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._move(params, theta.view(params[self.shift].shape[-1:]))


def _writer_bias(m: nn.Module, d: int) -> torch.Tensor | None:
    if isinstance(m, nn.MultiheadAttention):
        m = m.out_proj
    lin = linear_layer(m)
    if lin is None or lin.out_features != d or lin.bias is None:
        return None
    return lin.bias


class NormShifts(SymmetryFamily):
    """The shift of every LayerNorm whose output is also a residual (see the module
    docstring)."""

    name = "post-norm shifts"
    kind = "folds"
    symmetries = ("complete",)

    def present(self, scene: Scene) -> bool:
        return any(is_norm(m) and norm_bias(m) is not None for m in scene.modules.values())

    def find(self, scene: Scene) -> None:
        p = scene.prober
        calls = p.parameterised_calls()
        order = p.calls
        norms = [i for i, c in enumerate(order) if is_norm(p.modules[c.name])
                 and norm_bias(p.modules[c.name]) is not None
                 and isinstance(c.out, torch.Tensor)
                 and centres(p.modules[c.name], c.args, c.kwargs)]
        tables = [j for j, c in enumerate(order[:norms[0]] if norms else [])
                  if isinstance(p.modules[c.name], nn.Embedding)]
        for j in tables[:1]:  # an embedding table read directly by the first post-norm block
            self._propose(scene, p, calls, order, j, norms[0], TableShiftFold,
                          p.modules[order[j].name].weight)
        for k, i in enumerate(norms[:-1]):
            self._propose(scene, p, calls, order, i, norms[k + 1], NormShiftFold,
                          norm_bias(p.modules[order[i].name]))

    @staticmethod
    def _propose(scene: Scene, p: Prober, calls: list, order: list, i: int, nxt: int, fold: type,
                 beta: torch.Tensor | None) -> None:
        c = order[i]
        if not isinstance(c.out, torch.Tensor) or beta is None:
            return
        d = int(beta.shape[-1])
        found = readers_of(calls, ReadQuery(storage(c.out), d, p.name, p.pname))
        if not found or any(x.bias is None for x in found[0]):
            return
        if fold is TableShiftFold and not found[0]:
            return  # a table summed with others before a norm: the embedding shifts' case
        comp = next((b for j in range(nxt - 1, i, -1)
                     if (b := _writer_bias(p.modules[order[j].name], d)) is not None), None)
        if comp is None:
            return
        scene.propose([fold(c.name, p.name(beta), tuple(found[0]), p.name(comp))])
