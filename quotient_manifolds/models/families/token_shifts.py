r"""Token shifts of a vision transformer's input: a class token or patch bias against positions.

A ViT's input sequence is $e_0 = c + P_0$ for the class token $c$ and
$e_i = \mathrm{conv}(x)_i + b + P_i$ for the patches ($i \ge 1$), with $b$ the bias of the patch
convolution and $P$ the position table (HF ViT, DeiT, timm-style models that keep `cls_token`
and `position_embeddings` as parameters of one module). Two translations keep every $e_i$:

$$
(c + t,\; P_0 - t), \qquad (b + s,\; P_{1:} - \mathbb 1 s^\top), \qquad t, s \in \mathbb R^d,
$$

the analogue for parameters of the word/position shift of the summed embedding tables
([`embeddings`][quotient_manifolds.models.families.embeddings]).
[`TokenShifts`][quotient_manifolds.models.families.token_shifts.TokenShifts] proposes both
([`SliceShiftFold`][quotient_manifolds.models.families.token_shifts.SliceShiftFold]); the
probe confirms each. Canonical representative: the first position row of each slice set to
zero ($P_0 = 0$, $P_1 = 0$: the class token and the patch bias as they are read at the first
position), and frozen.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..symmetry import Fold, Scene, SymmetryFamily, random_normal, rms

__all__ = ["SliceShiftFold", "TokenShifts"]

Params = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class SliceShiftFold(Fold):
    r"""$(a + t,\ P_{r} - t$ for rows $r$ of `start:stop` along the position axis $-2)$, with
    $a$ of $d$ entries (any leading shape of size 1); canonical representative
    $P_{\text{start}} = 0$ (frozen)."""

    source: str = ""
    positions: str = ""
    start: int = 0
    stop: int = 1

    kind = "token_shift"
    order = 2.7  # after the writer centring, which it keeps

    @property
    def params(self) -> tuple[str, ...]:
        return (self.source, self.positions)

    def _move(self, params: Params, t: torch.Tensor) -> dict[str, torch.Tensor]:
        a, P = params[self.source], params[self.positions]
        rows = torch.zeros(P.shape[-2], dtype=P.dtype, device=P.device)
        rows[self.start:self.stop] = 1
        delta = rows[:, None] * t.to(P.dtype).reshape(1, -1)
        return {**params, self.source: a + t.to(a.dtype).reshape(a.shape),
                self.positions: P - delta.expand(P.shape)}

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            P = params[self.positions]
            return self._move(params, P[..., self.start, :].reshape(-1)), self.frozen(params)

    def frozen(self, params: Params) -> dict[str, torch.Tensor]:
        P = params[self.positions]
        mask = torch.zeros(P.shape, dtype=torch.bool, device=P.device)
        mask[..., self.start, :] = True
        return {self.positions: mask}

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        P = params[self.positions]
        return self._move(params, a * rms(P) * random_normal((P.shape[-1],), generator, P.dtype,
                                                             P.device))

    def lie_dim(self, params: Params) -> int:
        return int(params[self.positions].shape[-1])

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._move(params, theta)

    def describe(self) -> dict:
        return {**super().describe(), "rows": [self.start, self.stop]}


def _conv_bias(m: nn.Module) -> torch.Tensor | None:
    convs = [c for c in m.modules() if isinstance(c, nn.modules.conv._ConvNd)]
    if len(convs) != 1 or convs[0].bias is None:
        return None
    return convs[0].bias


class TokenShifts(SymmetryFamily):
    """Every module with own `cls_token` and `position_embeddings` parameters of one width
    (and the bias of its one patch convolution), see the module docstring."""

    name = "token shifts"
    kind = "folds"
    symmetries = ("complete",)

    def present(self, scene: Scene) -> bool:
        return any(isinstance(getattr(m, "position_embeddings", None), nn.Parameter)
                   for m in scene.modules.values())

    def find(self, scene: Scene) -> None:
        p = scene.prober
        for name, m in p.modules.items():
            P = getattr(m, "position_embeddings", None)
            if not isinstance(P, nn.Parameter) or P.dim() < 2:
                continue
            d, n = P.shape[-1], P.shape[-2]
            pos = p.name(P)
            cls = getattr(m, "cls_token", None)
            first = 0
            if isinstance(cls, nn.Parameter) and cls.numel() == d:
                scene.propose([SliceShiftFold(name, p.name(cls), pos, 0, 1)])
                first = 1
            b = _conv_bias(m)
            if b is not None and b.numel() == d and n > first:
                scene.propose([SliceShiftFold(name, p.name(b), pos, first, n)])
