r"""The geometry of a sharpness measure as one frozen configuration.

A [`Geometry`][quotient_manifolds.sharpness.config.Geometry] is the model's quotient geometry
([`QuotientConfig`][quotient_manifolds.models.config.QuotientConfig]: which quotient the
weights live in, how perturbations move them) plus the ball that bounds the perturbation.
Together with a solver ([`APGD`][quotient_manifolds.sharpness.solvers.APGD],
[`Average`][quotient_manifolds.sharpness.solvers.Average], …) it defines a measure; the named
measures are in [`MEASURES`][quotient_manifolds.sharpness.measures.MEASURES].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError
from ..models.config import QuotientConfig, check_choice
from .feasible import BALLS

__all__ = ["Geometry", "BALLS"]


@dataclass(frozen=True)
class Geometry(QuotientConfig):
    r"""Quotient geometry, perturbation and ball of a sharpness measure.

    Every attribute of [`QuotientConfig`][quotient_manifolds.models.config.QuotientConfig]
    (`metric`, `symmetry`, `retraction`, `eps`, `adaptive_eps`, `adaptive_retraction`,
    `exact_steps`, `blocks`, `declared`, `half`, `symmetries`), and:

    Attributes
    ----------
    ball : {"metric", "adaptive", "ellipsoid", "box"}
        The feasible set ([`feasible`][quotient_manifolds.sharpness.feasible]): the metric ball
        $\|\xi\|_w \le \rho$ (App. C); the adaptive-norm ball $\|\xi \oslash c\|_2 \le \rho$ with
        $\xi$ horizontal (App. G ablation (a)); the reference ℓ2 ellipsoid or ℓ∞ box of adaptive
        sharpness (Eq. 1; `metric=None` only).
    """

    ball: str = "metric"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("ball", self.ball, BALLS)
        if self.ball in ("ellipsoid", "box") and self.metric is not None:
            raise InvalidArgumentError(
                f"ball={self.ball!r} is the reference adaptive-sharpness algorithm, which has no "
                "horizontal constraint; use it with metric=None, or use ball='metric' or "
                "'adaptive' with GL blocks"
            )

    def replace(self, **changes: Any) -> Geometry:
        """A copy with `changes` applied (validated)."""
        out = super().replace(**changes)
        assert isinstance(out, Geometry)
        return out
