r"""Translations between summed embedding tables: word $+\,t$, position $-\,t$.

A model whose input is the sum of embedding rows, $e = E_w[\text{token}] + E_p[\text{position}]
(+ E_t[\text{type}])$, computes the same function after $E_w \mapsto E_w + \mathbb 1 t^\top$,
$E_p \mapsto E_p - \mathbb 1 t^\top$ for every $t \in \mathbb R^d$ (and likewise between the word
table and every other table). With a tied output head the word table also scores the outputs,
$z_v = h^\top e_v$, and the translation moves every logit by $h^\top t$: then it is a symmetry of
the softmax cross-entropy only, claimed only when the user's loss is unchanged.

Canonical representative: the first row of the other table set to zero (its value absorbed by
every word row: the word embeddings as they appear at position 0, segment 0), and frozen.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..symmetry import Centring, Fold, Scene, SymmetryFamily, random_normal, rms

__all__ = ["EmbeddingShiftFold", "EmbeddingShifts", "TiedEmbeddingShiftFold"]

Params = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class EmbeddingShiftFold(Fold):
    r"""$(E_w, E_o) \mapsto (E_w + \mathbb 1 t^\top, E_o - \mathbb 1 t^\top)$; canonical
    representative $E_o[0] = 0$ (frozen)."""

    word: str = ""
    other: str = ""

    kind = "embedding_shift"
    order = 2.7

    @property
    def params(self) -> tuple[str, ...]:
        return (self.word, self.other)

    def _move(self, params: Params, t: torch.Tensor) -> dict[str, torch.Tensor]:
        w, o = params[self.word], params[self.other]
        return {**params, self.word: w + t.to(w.dtype), self.other: o - t.to(o.dtype)}

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            return self._move(params, params[self.other][0]), self.frozen(params)

    def frozen(self, params: Params) -> dict[str, torch.Tensor]:
        o = params[self.other]
        mask = torch.zeros(o.shape, dtype=torch.bool, device=o.device)
        mask[0] = True
        return {self.other: mask}

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        o = params[self.other]
        return self._move(params, a * rms(o) * random_normal(o.shape[1:], generator, o.dtype,
                                                             o.device))

    def lie_dim(self, params: Params) -> int:
        return int(params[self.other][0].numel())

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._move(params, theta.view(params[self.other].shape[1:]))


@dataclass(frozen=True)
class TiedEmbeddingShiftFold(EmbeddingShiftFold):
    r"""The same translation where the word table is also the output head: a symmetry of the
    softmax cross-entropy only.

    With `constant`, the group also holds $E_w \mapsto E_w + s\,\mathbb 1 \mathbb 1^\top$ (every
    entry of the word table plus one $s$): the translation $t = s\mathbb 1$ composed with the
    centring of the other table, whose rows a LayerNorm reads only through their mean-free part.
    The tied head moves every logit by the same $s\,h^\top \mathbb 1$. Without it the canonical
    point would not be invariant once the other table is centred: the centring removes the
    $\mathbb 1$-component of $t$ from $E_o$ but not from $E_w$. Canonical representative: as
    above, then the mean of the first word row removed from every entry of $E_w$ (the
    perturbations of that row keep a zero sum)."""

    constant: bool = False

    invariant = "loss"

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        out, frozen = super().apply(params)
        if self.constant:
            with torch.no_grad():
                w = out[self.word]
                out[self.word] = w - w[0].mean()
        return out, frozen

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        out = super().act(params, generator, a)
        if self.constant:
            w = out[self.word]
            out[self.word] = w + a * rms(w) * random_normal((), generator, w.dtype, w.device)
        return out

    def lie_dim(self, params: Params) -> int:
        return super().lie_dim(params) + int(self.constant)

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        d = super().lie_dim(params)
        out = super().act_at(params, theta[:d])
        if self.constant:
            out[self.word] = out[self.word] + theta[d].to(out[self.word].dtype)
        return out

    def constraints(self, params: Params) -> tuple[Centring, ...]:
        return (Centring(self.word, 1, 0, 1),) if self.constant else ()


class EmbeddingShifts(SymmetryFamily):
    """Every module with two or more embedding tables of one width: the largest is the word
    table, translated against each of the others."""

    name = "embedding shifts"
    kind = "folds"
    symmetries = ("complete",)

    def find(self, scene: Scene) -> None:
        p = scene.prober
        for name, m in p.modules.items():
            tables = [c for c in m.children() if isinstance(c, nn.Embedding)]
            widths = {t.embedding_dim for t in tables}
            if len(tables) < 2 or len(widths) != 1:
                continue
            word = max(tables, key=lambda t: t.num_embeddings)
            w = p.name(word.weight)
            for t in tables:
                if t is not word:
                    o = p.name(t.weight)
                    scene.propose([EmbeddingShiftFold(name, w, o), TiedEmbeddingShiftFold(
                        name, w, o, constant=True), TiedEmbeddingShiftFold(name, w, o)])
