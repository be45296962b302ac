r"""The records of discovery: what is claimed, what falls back, and what each probe measured.

Plain frozen dataclasses with no behaviour beyond applying the folds in order, so every layer
(discovery, the model geometry, the sharpness engine, reports) can read them without importing
the machinery that made them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from ..errors import BlockSpecError
from .blocks import BlockSpec

__all__ = [
    "SYMMETRIES",
    "PROBE_RTOL",
    "PROBE_EXCITATION",
    "Fallback",
    "FoldLike",
    "DEFAULT_SYMMETRY",
    "ProbeRecord",
    "Symmetries",
    "parameter_layout",
]

SYMMETRIES = ("complete", "full", "paper")
"""The symmetry groups a measure can quotient out: `"complete"` (the default), every one the
library claims; `"full"`, the attention heads with the rotary subgroup and grouped heads, LoRA,
norm gains, the key and value bias translations and q/k norms (the default before the complete
group, kept so that earlier results can be reproduced); `"paper"`, the paper's GL(h) per
attention head."""

DEFAULT_SYMMETRY = "complete"
"""The group of every call that does not name one."""

PROBE_RTOL = 1e-10
"""Largest relative output change a symmetric transformation may cause."""

PROBE_EXCITATION = 1e-3
"""Smallest relative output change the non-symmetric control of a block probe must cause."""


@dataclass(frozen=True)
class Fallback:
    """Weights of a module that get no symmetry block, and why (they use the adaptive
    geometry)."""

    module: str
    kind: str
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ProbeRecord:
    r"""The outcome of one block's function-preservation probe.

    Attributes
    ----------
    module, kind : str
        The block's module path and kind.
    probed : str
        The module that was re-run (the smallest one holding every parameter of the block).
    error : float
        Relative output change under a random element of the claimed group (`nan` if the
        module could not be run).
    control : float
        Relative output change under the one-sided, non-symmetric change $G \mapsto G A^{-1}$.
    scale : float
        Factor by which the hidden-state inputs were scaled for the final measurement.
    passed : bool
        `error <= tolerance`, `control >= PROBE_EXCITATION` and `error <= 1e-4 control`.
    reason : str
        Why it failed (empty when it passed).
    tolerance : float
        `PROBE_RTOL` ($10^{-10}$) for a module that computes in float64 throughout; for one
        that casts to a lower precision inside (e.g. a rotary embedding in float32), $100
        \epsilon$ of that precision.
    """

    module: str
    kind: str
    probed: str
    error: float
    control: float
    scale: float
    passed: bool
    reason: str = ""
    tolerance: float = PROBE_RTOL

    def to_dict(self) -> dict:
        return asdict(self)


def parameter_layout(model: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The names and shapes of `model.named_parameters()`: what a
    [`Symmetries`][quotient_manifolds.models.records.Symmetries] found on one model must match
    to be used on another."""
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters())


class FoldLike(Protocol):
    """What [`Symmetries`][quotient_manifolds.models.records.Symmetries] needs of a fold."""

    kind: str

    def apply(self, params: Mapping[str, torch.Tensor]
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]: ...

    def act(self, params: Mapping[str, torch.Tensor], generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class Symmetries:
    """Everything discovery claims about a model.

    Attributes
    ----------
    blocks : tuple of BlockSpec
        The verified blocks (resolved), frozen factor parts removed.
    fallbacks : tuple of Fallback
        Modules (or parts of modules) without a block, with the reason.
    folds : tuple of Fold
        Canonicalisation steps (not with `symmetry="paper"`), applied in order by
        `canonicalize`.
    probes : tuple of ProbeRecord
        The function-preservation probe of every claim that could be probed (including the
        rejected ones).
    symmetry : str
        `"complete"`, `"full"` or `"paper"`.
    discovered : tuple of BlockSpec
        The verified blocks before the frozen parts were removed (bias rows included): what
        the fold families and the mapping checks read. Equal to `blocks` when there are no
        folds.
    """

    blocks: tuple[BlockSpec, ...]
    fallbacks: tuple[Fallback, ...] = ()
    folds: tuple[Any, ...] = ()
    probes: tuple[ProbeRecord, ...] = ()
    symmetry: str = DEFAULT_SYMMETRY
    discovered: tuple[BlockSpec, ...] = ()
    layout: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def check_model(self, model: Any) -> None:
        """Raise [`BlockSpecError`][quotient_manifolds.errors.BlockSpecError] unless these
        symmetries can describe `model`: its parameter names and shapes are those they were
        discovered on, and every parameter a block reads exists."""
        mine = parameter_layout(model)
        if self.layout and self.layout != mine:
            have, want = dict(mine), dict(self.layout)
            diff = sorted(set(have) ^ set(want)) + sorted(
                n for n in set(have) & set(want) if have[n] != want[n])
            raise BlockSpecError(
                f"these symmetries were discovered on another model ({len(want)} parameters, "
                f"{type(model).__name__} has {len(have)}; they differ at "
                f"{', '.join(map(repr, diff[:3]))}{' …' if len(diff) > 3 else ''}); discover "
                "them on this model: qm.symmetries_of(model, loss_fn, data)")
        names = dict(mine)
        missing = sorted({n for b in self.blocks for n in b.params if n not in names})
        if missing:
            raise BlockSpecError(
                f"these symmetries name parameters that {type(model).__name__} does not have "
                f"({', '.join(map(repr, missing[:3]))}); discover them on this model: "
                "qm.symmetries_of(model, loss_fn, data)")

    def canonicalize(
        self, params: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The canonical representative of `params` and the frozen entries.

        Applies every fold in order. Pure: `params` and the model are not touched.

        Returns
        -------
        tuple of dict
            `(canonical params, {name: bool mask of the entries fixed at their canonical
            value})`; parameters no fold touches are passed through unchanged.
        """
        out = dict(params)
        frozen: dict[str, torch.Tensor] = {}
        for fold in self.folds:
            new, masks = fold.apply(out)
            out = {**out, **new}
            for name, m in masks.items():
                frozen[name] = m if name not in frozen else frozen[name] | m
        return out, frozen

    def to_dict(self) -> dict:
        """A JSON-friendly summary."""
        return {
            "symmetry": self.symmetry,
            "blocks": [b.describe() for b in self.blocks],
            "fallbacks": [f.to_dict() for f in self.fallbacks],
            "folds": [getattr(f, "kind", type(f).__name__) for f in self.folds],
            "probes": [p.to_dict() for p in self.probes],
        }
