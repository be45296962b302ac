"""The result object of a sharpness call."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

__all__ = ["SharpnessResult"]


@dataclass
class SharpnessResult:
    """Outcome of [`geodesic_sharpness`][quotient_manifolds.geodesic_sharpness] or
    [`adaptive_sharpness`][quotient_manifolds.adaptive_sharpness].

    Attributes
    ----------
    value : float
        Mean over batches of the (worst-case or average) loss increase.
    per_batch : list of float
        Loss increase of each batch.
    base_loss, max_loss : list of float
        Unperturbed loss and perturbed (maximal, or mean for the average case) loss per batch.
    perturbation_norm : list of float
        Norm of the maximising perturbation per batch, in the feasible set's own norm (NaN for
        the average case).
    norms : list of dict
        Per batch, that norm and (for the metric and adaptive-norm balls) its GL-block and
        adaptive parts.
    method : str
        ``"geodesic"`` or ``"adaptive"``.
    kind : str
        ``"worst"`` or ``"average"``.
    settings : dict
        The radius, the geometry (`Geometry.settings()`), the settings of the solver that ran
        (and no other's), the number of perturbed parameters and of frozen zero weights.
    blocks : list of dict
        The GL blocks used (see
        [`BlockSpec.describe`][quotient_manifolds.models.BlockSpec.describe]).
    fallbacks : list of dict
        Modules whose weights fell back to the adaptive geometry, and why.
    n_evals : int
        Loss evaluations with gradient (or samples), all batches together.
    elapsed_s : float
        Wall time of the call.
    """

    value: float
    per_batch: list[float]
    base_loss: list[float]
    max_loss: list[float]
    perturbation_norm: list[float]
    method: str
    kind: str
    settings: dict
    blocks: list[dict] = field(default_factory=list)
    fallbacks: list[dict] = field(default_factory=list)
    norms: list[dict] = field(default_factory=list)
    n_evals: int = 0
    elapsed_s: float = 0.0

    def to_dict(self) -> dict:
        """A JSON-serialisable dict of every field."""
        return json.loads(json.dumps(asdict(self), default=str))

    def __repr__(self) -> str:
        return (
            f"SharpnessResult(method={self.method!r}, kind={self.kind!r}, value={self.value:.6g}, "
            f"batches={len(self.per_batch)}, blocks={len(self.blocks)}, "
            f"fallbacks={len(self.fallbacks)})"
        )
