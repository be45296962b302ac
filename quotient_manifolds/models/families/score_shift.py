r"""Attention-score shifts: a table of relative position biases, one column per head, shifted by
a constant per head.

T5's self-attention adds a learned bias to every score, $s_{hij} = q_{hi}^\top k_{hj} +
B[\mathrm{bucket}(j - i),\, h]$, read from an embedding table $B$ of shape
(buckets, heads). The softmax over $j$ does not see a constant added to all of a head's
scores, so
$$
B \mapsto B + \mathbb 1 c^\top,\qquad c ∈ \mathbb R^{\text{heads}},
$$
computes the same function (the causal mask added to the same scores does not change this).
Canonical representative: the mean of each column removed, the column sums of the
perturbations zero (a
[`CentringFold`][quotient_manifolds.models.families.centring.CentringFold] along the buckets).

[`ScoreShifts`][quotient_manifolds.models.families.score_shift.ScoreShifts] proposes it for
every embedding table narrower than the widest one (which writes the stream) and lets the
whole-model probe decide: a table whose columns are not softmax scores fails it.
"""

from __future__ import annotations

from torch import nn

from ..symmetry import Scene, SymmetryFamily
from .centring import CentringFold

__all__ = ["ScoreShiftFold", "ScoreShifts"]


class ScoreShiftFold(CentringFold):
    """[`CentringFold`][quotient_manifolds.models.families.centring.CentringFold] of a score
    bias table along its rows (one constant per head)."""

    kind = "score_shift"


class ScoreShifts(SymmetryFamily):
    """Tables of attention-score biases (see the module docstring)."""

    name = "score shifts"
    kind = "folds"
    symmetries = ("complete",)

    @staticmethod
    def _tables(scene: Scene) -> list[tuple[str, nn.Embedding]]:
        tables = [(n, m) for n, m in scene.modules.items() if isinstance(m, nn.Embedding)]
        if not tables:
            return []
        d = max(m.embedding_dim for _, m in tables)
        return [(n, m) for n, m in tables if m.embedding_dim < d and m.num_embeddings > 1]

    def present(self, scene: Scene) -> bool:
        return bool(self._tables(scene))

    def find(self, scene: Scene) -> None:
        p = scene.prober
        called = {c.name for c in p.calls}
        for name, _ in self._tables(scene):
            if name in called:
                scene.propose([ScoreShiftFold(name, p.name(p.modules[name].weight), 0)])
