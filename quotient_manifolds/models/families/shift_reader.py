r"""A LayerNorm's shift read by linear maps without bias: the shift and the readers' $\mathbb 1$
column trade against each other.

A LayerNorm $y = γ ⊙ \hat x + β$ has a centred normalised output, $\mathbb 1^\top \hat x = 0$.
A linear map without bias that reads it (a language-model head after the final LayerNorm:
GPT-2 with an untied head, OPT) computes $W y = W\operatorname{diag}(γ)\,\hat x + Wβ$, which
depends on $W$ only through $W\operatorname{diag}(γ)$ on $\mathbb 1^\perp$ and through $Wβ$. So
for every $a ∈ \mathbb R^d$ with $1 + v^\top a ≠ 0$, $v = \mathbb 1 ⊘ γ$, and
$M = I + a v^\top$ (the identity on $\operatorname{diag}(γ)\mathbb 1^\perp$),
$$
W_j \mapsto W_j M,\qquad β \mapsto M^{-1}β = β - a\,\frac{v^\top β}{1 + v^\top a}
$$
(every reader $j$ of the norm at once) computes the same function:
$W_j M \operatorname{diag}(γ)\hat x = W_j\operatorname{diag}(γ)\hat x + W_j a\,(\mathbb 1^\top
\hat x)$ and $W_j M M^{-1} β = W_j β$. This is the reader translation of a LayerNorm
([`ReaderCentringFold`][quotient_manifolds.models.families.centring.ReaderCentringFold]) where
no bias can take up the shift's contribution: the shift takes it up instead, and the group has
$d$ dimensions (it is what the norm's shift and the readers' $v$-components leave of a head
without bias).

Canonical representative: $β = γ$ (after the gain fold, $β = \mathbb 1$), frozen, reached by
$a = (β - γ)/d$ (so $Mγ = β$); it is defined while $v^\top β ≠ 0$ (the mean of $β ⊘ γ$ not
zero), and a `ProbeWarning` says when it nearly vanishes. The stream's rotations fix
$\mathbb 1$, so they keep this representative.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ...errors import ProbeWarning
from ..linear import Consumer
from ..symmetry import Fold, full_mask, random_normal

__all__ = ["ShiftReaderFold"]

Params = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class ShiftReaderFold(Fold):
    r"""$(W_j, β) \mapsto (W_j M, M^{-1}β)$, $M = I + a v^\top$, $v = \mathbb 1 ⊘ (o + w)$, on
    every reader of a LayerNorm (see the module docstring); canonical representative
    $β = o + w$, frozen."""

    consumers: tuple[Consumer, ...] = ()
    gain: str = ""
    shift: str = ""
    offset: float = 0.0

    kind = "shift_reader"
    order = 0.4

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([self.gain, self.shift] + [c.weight for c in self.consumers]))

    def _move(self, params: Params, a: torch.Tensor) -> dict[str, torch.Tensor]:
        out = dict(params)
        g = (params[self.gain] + self.offset).reshape(-1)
        beta = params[self.shift]
        v = 1.0 / g.to(a.dtype)
        b = beta.reshape(-1).to(a.dtype)
        out[self.shift] = (b - a * (v @ b) / (1 + v @ a)).view(beta.shape).to(beta.dtype)
        for c in self.consumers:
            W, bias = c.read(out)
            c.write(out, W + (W @ a.to(W.dtype))[:, None] * v[None, :].to(W.dtype), bias)
        return out

    def frozen(self, params: Params) -> dict[str, torch.Tensor]:
        return {self.shift: full_mask(params, self.shift)}

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            g = (params[self.gain] + self.offset).reshape(-1).to(torch.float64)
            b = params[self.shift].reshape(-1).to(torch.float64)
            s = float((b / g).mean())
            scale = float((b / g).abs().max()) or 1.0
            if abs(s) < 1e-6 * scale:
                warnings.warn(
                    f"the shift of {self.module} has a mean of its ratio to the gain of {s:.1e}: "
                    "its canonical representative (the shift equal to the gain) is "
                    "ill-determined, and the measure invariant only to about that precision",
                    ProbeWarning, stacklevel=3)
            a = (b - g) / g.numel()
            return self._move(params, a.to(params[self.shift].dtype)), self.frozen(params)

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            g = (params[self.gain] + self.offset).reshape(-1)
            v = 1.0 / g
            z = random_normal(g.shape, generator, g.dtype, g.device)
            x = 0.5 * a * z / v.norm()  # |vᵀx| ≲ a/2: M well conditioned
            if float((1 + v @ x).abs()) < 0.25:
                x = -x
            return self._move(params, x)

    def lie_dim(self, params: Params) -> int:
        return params[self.shift].numel()

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._move(params, theta.to(params[self.shift].dtype))

    def describe(self) -> dict:
        return {**super().describe(), "gain": self.gain, "shift": self.shift,
                "consumers": [c.weight for c in self.consumers]}
