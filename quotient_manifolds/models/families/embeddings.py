r"""Translations between summed embedding tables: word $+\,t$, position $-\,t$.

A model whose input is the sum of embedding rows, $e = E_w[\text{token}] + E_p[\text{position}]
(+ E_t[\text{type}])$, computes the same function after $E_w \mapsto E_w + \mathbb 1 t^\top$,
$E_p \mapsto E_p - \mathbb 1 t^\top$ for every $t \in \mathbb R^d$ (and likewise between the word
table and every other table). With a tied output head the word table also scores the outputs,
$z_v = h^\top e_v$, and the translation moves every logit by $h^\top t$: then it is a symmetry of
the softmax cross-entropy only, claimed only when the user's loss is unchanged.

Canonical representative: the first row of the other table set to zero (its value absorbed by
every word row: the word embeddings as they appear at position 0, segment 0), and frozen.

**The padding pair** (RoBERTa). Where positions are counted from the padding index $p$, so that
a token sits at position $p$ exactly when it is the padding token $p$, the two rows are only
ever read together (checked on the traced input with padding tokens added, before the probe):
$(E_w[p] + s, E_p[p] - s)$ keeps the function for every $s \in \mathbb R^d$
([`PadShiftFold`][quotient_manifolds.models.families.embeddings.PadShiftFold]). Canonical
representative: $E_p[p] = 0$, frozen; the shift of the whole tables then fixes row $p + 1$ of
the position table (the first position a token is read at) instead of row 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..precision import float64_internals, no_fastpath
from ..prober import Prober, output_tensors, relative_change
from ..symmetry import Centring, Fold, Scene, SymmetryFamily, random_normal, rms

__all__ = ["EmbeddingShiftFold", "EmbeddingShifts", "PadShiftFold", "TiedEmbeddingShiftFold"]

Params = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class EmbeddingShiftFold(Fold):
    r"""$(E_w, E_o) \mapsto (E_w + \mathbb 1 t^\top, E_o - \mathbb 1 t^\top)$; canonical
    representative $E_o[r] = 0$ (frozen), `row` $r = 0$ unless the padding pair takes it."""

    word: str = ""
    other: str = ""
    row: int = 0

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
            return self._move(params, params[self.other][self.row]), self.frozen(params)

    def frozen(self, params: Params) -> dict[str, torch.Tensor]:
        o = params[self.other]
        mask = torch.zeros(o.shape, dtype=torch.bool, device=o.device)
        mask[self.row] = True
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


@dataclass(frozen=True)
class PadShiftFold(Fold):
    r"""$(E_w[p], E_o[p]) \mapsto (E_w[p] + s, E_o[p] - s)$ for the padding index $p$ of both
    tables; canonical representative $E_o[p] = 0$ (frozen)."""

    word: str = ""
    other: str = ""
    pad: int = 0

    kind = "pad_shift"
    order = 2.75  # after the shift of the whole tables, which moves row p too

    @property
    def params(self) -> tuple[str, ...]:
        return (self.word, self.other)

    def _move(self, params: Params, s: torch.Tensor) -> dict[str, torch.Tensor]:
        w, o = params[self.word], params[self.other]
        i = (torch.tensor([self.pad], device=w.device),)
        sw = torch.zeros_like(w).index_put(i, s.to(w.dtype)[None])
        so = torch.zeros_like(o).index_put((i[0].to(o.device),), s.to(o.dtype)[None])
        return {**params, self.word: w + sw, self.other: o - so}

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            return self._move(params, params[self.other][self.pad]), self.frozen(params)

    def frozen(self, params: Params) -> dict[str, torch.Tensor]:
        o = params[self.other]
        mask = torch.zeros(o.shape, dtype=torch.bool, device=o.device)
        mask[self.pad] = True
        return {self.other: mask}

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        o = params[self.other]
        return self._move(params, a * rms(o) * random_normal(o.shape[1:], generator, o.dtype,
                                                             o.device))

    def lie_dim(self, params: Params) -> int:
        return int(params[self.other][self.pad].numel())

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._move(params, theta.view(params[self.other].shape[1:]))


def _padded(p: Prober, pad: int) -> tuple[tuple, dict] | None:
    """The traced inputs with the last token of every sequence replaced by `pad`."""
    ids = p.kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.dim() == 2:
        return p.args, {**p.kwargs, "input_ids": ids.clone().index_fill_(1, torch.tensor(
            [ids.shape[1] - 1], device=ids.device), pad)}
    return None


def _paired(p: Prober, word: str, other: str, pad: int) -> bool:
    r"""Whether row `pad` of the two tables is only read together, on the traced inputs with
    padding tokens added: $(E_w[p] + s, E_o[p] - s)$ keeps the outputs while $E_w[p] + s$
    alone does not (so the check is not vacuous)."""
    inputs = _padded(p, pad)
    if inputs is None or p.reference is None:
        return False
    s = torch.randn(p.params[other].shape[1:], generator=p.gen, dtype=torch.float64) * 3
    fold = PadShiftFold("", word, other, pad)
    both = fold.act_at(p.params, s)
    alone = {**p.params, word: both[word]}

    def run(params: Params) -> list[torch.Tensor]:
        with torch.no_grad(), no_fastpath(), float64_internals():
            return output_tensors(torch.func.functional_call(
                p.model, {**params, **p.buffers}, inputs[0], inputs[1]))
    try:
        ref = run(p.params)
        return relative_change(ref, run(both)) <= 1e-10 < relative_change(ref, run(alone))
    except Exception:  # noqa: BLE001 -- the model rejects the padded input
        return False


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
                    pad = t.padding_idx if t.padding_idx is not None else getattr(
                        m, "padding_idx", None)
                    paired = (isinstance(pad, int) and 0 <= pad < t.num_embeddings - 1
                              and pad < word.num_embeddings and _paired(p, w, o, pad))
                    row = pad + 1 if paired and isinstance(pad, int) else 0
                    scene.propose([EmbeddingShiftFold(name, w, o, row),
                                   TiedEmbeddingShiftFold(name, w, o, row, constant=True),
                                   TiedEmbeddingShiftFold(name, w, o, row)])
                    if paired and isinstance(pad, int):
                        scene.propose([PadShiftFold(name, w, o, pad)])
