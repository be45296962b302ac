r"""Key offsets on the unrotated coordinates of partial rotary attention.

A key $k_j = W_K y_j$ read from a LayerNorm output $y = \gamma \odot \hat x + \beta$ moves
by the same vector $u\,(v^\top \beta)$ at every position under $W_K \mapsto W_K + u v^\top$,
$v = \mathbb 1 \oslash \gamma$, since $v^\top(\gamma \odot \hat x) = \mathbb 1^\top \hat x = 0$
(after the gain fold, $v = \mathbb 1$). A constant key offset adds $q_i^\top c$ to
every score of query $i$, which the softmax ignores, as long as no rotation turns it: on the
coordinates that partial rotary embeddings (StableLM, Phi, GPT-NeoX with `rotary_pct < 1`)
leave alone. With a key bias the reader centring already claims this direction; without one,
[`KeyOffsets`][quotient_manifolds.models.families.key_offset.KeyOffsets] proposes it for those
rows of $W_K$, and the probe decides (an RMSNorm, whose output has no constant sum, fails it).

Canonical representative: each of those rows without its component along $v$ (centred, after
the gain fold). The group of the Q/K
block mixes the unrotated coordinates among themselves only, so it keeps the centred rows
centred, and the canonical point is the same on the whole orbit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..linear import ReadQuery, linear_layer, readers_of, storage
from ..norms import is_norm, norm_weight
from ..symmetry import Fold, Scene, SymmetryFamily, random_normal, rms
from .free_norm import free_norm

__all__ = ["KeyOffsetFold", "KeyOffsets"]

Params = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class KeyOffsetFold(Fold):
    r"""$W_K[r] \mapsto W_K[r] + u_r v^\top$, $v = \mathbb 1 \oslash \gamma$ (`gain`; $\mathbb 1$
    for a norm without one), on the rows `rows` (the unrotated key coordinates of every head);
    canonical representative: those rows without their component along $v$."""

    weight: str = ""
    rows: tuple[int, ...] = ()
    gain: str = ""

    kind = "key_offset"
    order = 0.45  # after the gain fold (0) and the shift against readers without bias (0.4)

    @property
    def params(self) -> tuple[str, ...]:
        return (self.weight, self.gain) if self.gain else (self.weight,)

    def _v(self, params: Params) -> torch.Tensor:
        W = params[self.weight]
        if not self.gain:
            return torch.ones(W.shape[1], dtype=W.dtype, device=W.device)
        return 1.0 / params[self.gain].to(W.dtype)

    def _move(self, params: Params, u: torch.Tensor) -> dict[str, torch.Tensor]:
        W = params[self.weight]
        idx = torch.tensor(self.rows, device=W.device)
        add = u.to(W.dtype)[:, None] * self._v(params)[None, :]
        return {**params, self.weight: W.index_add(0, idx, add)}

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            W, v = params[self.weight], self._v(params)
            return self._move(params, -(W[list(self.rows)] @ v) / (v @ v)), {}

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        W = params[self.weight]
        return self._move(params, a * rms(W) * random_normal((len(self.rows),), generator,
                                                             W.dtype, W.device))

    def lie_dim(self, params: Params) -> int:
        return len(self.rows)

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._move(params, theta)

    def describe(self) -> dict:
        return {**super().describe(), "weight": self.weight, "rows": list(self.rows)}


class KeyOffsets(SymmetryFamily):
    """The unrotated key rows of rotary Q/K blocks whose key map has no bias (module
    docstring)."""

    name = "key offsets"
    kind = "folds"
    symmetries = ("complete",)

    def present(self, scene: Scene) -> bool:
        return any(getattr(b.group, "pairs", ()) for b in scene.blocks)

    def find(self, scene: Scene) -> None:
        p = scene.prober
        gains: dict[str, str] = {}  # a linear reader of a norm -> the norm's gain ("" none)
        calls = p.parameterised_calls()
        for c in p.calls:
            m = p.modules[c.name]
            if (is_norm(m) or free_norm(m)) and isinstance(c.out, torch.Tensor):
                found = readers_of(calls, ReadQuery(storage(c.out), int(c.out.shape[-1]),
                                                    p.name, p.pname))
                w = None if free_norm(m) else norm_weight(m)
                gain = "" if w is None else p.name(w)
                for x in (found[0] if found else ()):
                    gains.setdefault(x.weight, gain)
        for b in scene.blocks:
            pairs = getattr(b.group, "pairs", ())
            if b.kind != "attention.qk" or not pairs or any(q.layout == "bias" for q in b.H):
                continue
            rotated = {i for pair in pairs for i in pair}
            free = [i for i in range(b.h) if i not in rotated]
            keys = [q for q in b.H if q.layout == "rows"]
            if not free or len(keys) != 1 or keys[0].param not in gains:
                continue
            q = keys[0]
            module = p.modules.get(q.param.rsplit(".", 1)[0])
            lin = linear_layer(module) if module is not None else None
            if lin is None or lin.transposed or lin.bias is not None:
                continue
            step = q.stride or b.h
            rows = tuple(q.offset + j * step + i for j in range(b.heads * q.stack)
                         for i in free)
            scene.propose([KeyOffsetFold(b.module, q.param, rows, gains[q.param])])
