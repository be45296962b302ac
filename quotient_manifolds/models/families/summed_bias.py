r"""Summed output biases: two maps whose outputs are added with nothing in between.

A parallel block (GPT-NeoX, Phi, GPT-J) adds its attention and its MLP to the stream at once,

$$
h' = h + \mathrm{Attn}(\mathrm{LN}(h)) + \mathrm{MLP}(\mathrm{LN}(h)),
$$

so the output bias $b_A$ of the attention's output projection and the output bias $b_M$ of the
MLP reach the model only through their sum: $(b_A + t,\ b_M - t)$ computes the same function
for every $t \in \mathbb R^d$. In a sequential block a norm reads $h + \mathrm{Attn}(\cdot)$
before the MLP adds to it, and the probe rejects the pair.

Canonical representative: $b_A \leftarrow b_A + b_M$, $b_M \leftarrow 0$, and $b_M$ frozen
(unique on the orbit: $t = b_M$).
[`SummedBiases`][quotient_manifolds.models.families.summed_bias.SummedBiases] proposes each
pair of consecutive biased linear maps that write the stream (output width $d$, not reading a
norm); the probe decides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..linear import linear_layer
from ..norms import is_norm, norm_weight
from ..stream import norm_readers
from ..symmetry import Fold, Scene, SymmetryFamily, random_normal, rms

__all__ = ["SummedBiasFold", "SummedBiases"]

Params = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class SummedBiasFold(Fold):
    r"""$(b_A, b_M) \mapsto (b_A + t, b_M - t)$; canonical representative $b_M = 0$ (frozen)."""

    keep: str = ""
    zero: str = ""

    kind = "summed_bias"
    order = 2.6  # after the writer centring (2.5), whose zero sums it keeps

    @property
    def params(self) -> tuple[str, ...]:
        return (self.keep, self.zero)

    def _move(self, params: Params, t: torch.Tensor) -> dict[str, torch.Tensor]:
        a, b = params[self.keep], params[self.zero]
        return {**params, self.keep: a + t.to(a.dtype), self.zero: b - t.to(b.dtype)}

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            return self._move(params, params[self.zero]), self.frozen(params)

    def frozen(self, params: Params) -> dict[str, torch.Tensor]:
        return {self.zero: torch.ones(params[self.zero].shape, dtype=torch.bool,
                                      device=params[self.zero].device)}

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        b = params[self.keep]
        scale = a * (rms(b) or 1.0)
        return self._move(params, scale * random_normal(b.shape, generator, b.dtype, b.device))

    def lie_dim(self, params: Params) -> int:
        return int(params[self.zero].numel())

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._move(params, theta.view(params[self.zero].shape))

    def describe(self) -> dict:
        return {**super().describe(), "keep": self.keep, "zero": self.zero}


class SummedBiases(SymmetryFamily):
    """Pairs of output biases added to the stream together (see the module docstring)."""

    name = "summed biases"
    kind = "folds"
    symmetries = ("complete",)

    def present(self, scene: Scene) -> bool:
        return any(is_norm(m) for m in scene.modules.values())

    def find(self, scene: Scene) -> None:
        p = scene.prober
        norms = [c for c in p.calls if is_norm(p.modules[c.name])]
        widths = [norm_weight(p.modules[c.name]).numel() for c in norms]
        if not widths:
            return
        d = max(set(widths), key=widths.count)
        readers = norm_readers(p, {c.name for c in norms}, d)
        writers: list[tuple[str, str]] = []
        for c in p.calls:
            lin = linear_layer(p.modules[c.name])
            if (lin is None or lin.bias is None or lin.out_features != d
                    or p.name(lin.weight) in readers):
                continue
            bias = p.pname(lin.bias)
            if bias is not None and bias not in (b for _, b in writers) and not p.tied(bias):
                writers.append((c.name, bias))
        for (name, keep), (_, zero) in zip(writers, writers[1:]):
            scene.propose([SummedBiasFold(name, keep, zero)])
