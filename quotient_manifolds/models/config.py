r"""What a model's quotient geometry is, as one frozen configuration.

A [`QuotientConfig`][quotient_manifolds.models.config.QuotientConfig] says which quotient the
weights live in (the metric of the GL blocks, which symmetries) and how perturbations move them
(the retractions, the relaxations $\varepsilon$). It is everything
[`ModelGeometry`][quotient_manifolds.models.model_geometry.ModelGeometry] needs. A sharpness
measure adds its feasible set: [`Geometry`][quotient_manifolds.sharpness.config.Geometry]
extends this configuration by the ball.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._args import check_int, check_real
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..manifolds import RETRACTIONS
from .records import DEFAULT_SYMMETRY, SYMMETRIES, Symmetries

__all__ = ["QuotientConfig", "METRICS", "HALF"]

METRICS = ("inv", "mix", None)
HALF = ("error", "float32")


def check_choice(name: str, value: object, allowed: tuple) -> None:
    """Raise [`InvalidArgumentError`][quotient_manifolds.errors.InvalidArgumentError] (a
    `ValueError`) unless `value` is one of `allowed`."""
    try:
        ok = any(value is a or (isinstance(value, type(a)) and value == a) for a in allowed)
    except (TypeError, ValueError, RuntimeError):  # e.g. a tensor, whose == is elementwise
        ok = False
    if not ok:
        raise InvalidArgumentError(f"{name} must be one of {allowed}, got {value!r}; pass one "
                                   f"of those, e.g. {name}={allowed[0]!r}")


@dataclass(frozen=True)
class QuotientConfig:
    r"""The quotient geometry of a model: metric, symmetries, retractions, relaxations.

    Attributes
    ----------
    metric : {"inv", "mix", None}
        Metric of the GL(h) blocks: Eq. 9 (`"inv"`) or Eq. 10 (`"mix"`). `None`: no GL block,
        every weight has the adaptive metric $\xi^2/(w^2 + \varepsilon)$ (adaptive sharpness).
    symmetry : {"complete", "full", "paper"}
        Which symmetries are quotiented out: `"complete"` (the default), every symmetry the
        library recognises (the full group, and MLP neurons, LayerNorm translations, embedding
        and softmax shifts, residual rotations; see the symmetries page); `"full"`, the
        attention heads with the rotary subgroup and grouped heads, LoRA, norm gains, the key
        and value bias translations and q/k norms; `"paper"`, GL(h) per recognised attention
        head with the bias rows appended (the paper's measure)
        ([`SYMMETRIES`][quotient_manifolds.models.records.SYMMETRIES]).
    retraction : {"second_order", "exact", "first_order"}
        How GL blocks are perturbed: Eq. 5 (the paper), the geodesic by RK4, or $w + \xi$
        (App. G ablation (b)).
    eps : float
        Gram relaxation $G^\top G + \varepsilon I$ of the GL blocks, a finite number ≥ 0; 0
        requires full column rank.
    adaptive_eps : float
        $\varepsilon$ of the adaptive metric of every other weight, a finite number ≥ 0; with
        0, zero weights cannot move and are excluded.
    adaptive_retraction : {"first_order", "second_order", "exact"}
        How the other weights are perturbed ($w + \xi$ in the paper).
    exact_steps : int
        RK4 steps of `retraction="exact"`, an integer ≥ 1 (not a float, not a bool).
    blocks : tuple of BlockSpec, optional
        Use exactly these GL blocks instead of discovering them (`()`: none).
    declared : tuple of BlockSpec
        Blocks added to the discovered ones
        ([`declare_block`][quotient_manifolds.models.blocks.declare_block]).
    half : {"error", "float32"}
        A float16/bfloat16 model raises `PrecisionError` (`"error"`), or runs its forward in its
        dtype with the geometry in float32 (`"float32"`).
    symmetries : Symmetries, optional
        Use these symmetries instead of discovering them: those of
        [`discover`][quotient_manifolds.models.discover] or
        [`symmetries_of`][quotient_manifolds.sharpness.engine.symmetries_of] for the same
        model and `symmetry`. Discovery probes the model, so a sweep over radii or measures
        discovers once and passes the result here. Ignored when `blocks` is given.
    """

    metric: str | None = "inv"
    symmetry: str = DEFAULT_SYMMETRY
    retraction: str = "second_order"
    eps: float = 0.0
    adaptive_eps: float = 0.0
    adaptive_retraction: str = "first_order"
    exact_steps: int = 8
    blocks: tuple | None = None
    declared: tuple = field(default=())
    half: str = "error"
    symmetries: Symmetries | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_choice("metric", self.metric, METRICS)
        check_choice("symmetry", self.symmetry, SYMMETRIES)
        check_choice("retraction", self.retraction, RETRACTIONS)
        check_choice("adaptive_retraction", self.adaptive_retraction, RETRACTIONS)
        check_choice("half", self.half, HALF)
        # finite, in range, of a numeric type; stored as plain float / int
        object.__setattr__(self, "eps", check_real("eps", self.eps, minimum=0.0, example=1e-6))
        object.__setattr__(self, "adaptive_eps", check_real("adaptive_eps", self.adaptive_eps,
                                                            minimum=0.0, example=1e-6))
        object.__setattr__(self, "exact_steps", check_int("exact_steps", self.exact_steps,
                                                          example=8))
        sym = self.symmetries
        if sym is not None:
            if not isinstance(sym, Symmetries):
                raise ArgumentTypeError(
                    f"symmetries must be a Symmetries (from discover), got {sym!r}")
            if self.metric is not None and sym.symmetry != self.symmetry:
                raise InvalidArgumentError(
                    f"the symmetries were discovered with symmetry={sym.symmetry!r} but the "
                    f"geometry has symmetry={self.symmetry!r}; discover them with "
                    f"symmetry={self.symmetry!r}")
        if self.blocks is not None:
            object.__setattr__(self, "blocks", tuple(self.blocks))
        object.__setattr__(self, "declared", tuple(self.declared))

    def replace(self, **changes: Any) -> QuotientConfig:
        """A copy with `changes` applied (validated)."""
        return dataclasses.replace(self, **changes)

    def settings(self) -> dict[str, Any]:
        """The settings as a JSON-friendly dict (blocks described, not listed as objects)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["blocks"] = None if self.blocks is None else [b.describe() for b in self.blocks]
        out["declared"] = [b.describe() for b in self.declared]
        sym = out.pop("symmetries")
        if sym is not None:  # given, not discovered (absent otherwise: protocol hashes)
            out["symmetries"] = {"given": True, "symmetry": sym.symmetry,
                                 "blocks": len(sym.blocks), "folds": len(sym.folds)}
        if self.retraction != "exact" and self.adaptive_retraction != "exact":
            out.pop("exact_steps")
        return out

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> QuotientConfig:
        """The configuration of a settings dict (as written by `settings`, without blocks)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"blocks", "declared", "symmetries"}
        return cls(**{k: v for k, v in settings.items() if k in names})
