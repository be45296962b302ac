r"""The table of sharpness measures, by name: the one place the CLI, the experiments and the
invariance checks look measures up.

Each entry is a frozen [`Measure`][quotient_manifolds.sharpness.measures.Measure]; call
`MEASURES[name].run(model, loss_fn, data, rho=…)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .result import SharpnessResult

__all__ = ["MEASURES", "Measure"]


@dataclass(frozen=True)
class Measure:
    """A named sharpness measure: which engine function, with which settings.

    Attributes
    ----------
    name : str
        The table key (hyphenated, e.g. `"geodesic-inv"`).
    method : str
        `"geodesic"` or `"adaptive"`.
    options : Mapping
        Keyword arguments of the engine call that define the measure.
    kind : str
        `"worst"` (Auto-PGD maximum) or `"average"` (Gaussian average).
    doc : str
        One line for tables and `--help`.
    """

    name: str
    method: str
    options: Mapping[str, Any] = field(default_factory=dict)
    kind: str = "worst"
    doc: str = ""

    def run(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], Any],
        data: Iterable,
        *,
        rho: float,
        n_iter: int | None = None,
        seed: int | None = None,
        progress: bool = False,
    ) -> SharpnessResult:
        """Evaluate this measure of `model` on `data` (mean over batches)."""
        from .engine import adaptive_sharpness, geodesic_sharpness

        fn = geodesic_sharpness if self.method == "geodesic" else adaptive_sharpness
        kw = dict(self.options, kind=self.kind, seed=seed, progress=progress)
        if n_iter is not None:
            kw["n_iter"] = n_iter
        return fn(model, loss_fn, data, rho=rho, **kw)


def _table(*measures: Measure) -> dict[str, Measure]:
    return {m.name: m for m in measures}


MEASURES: dict[str, Measure] = _table(
    Measure("adaptive", "adaptive", {"norm": "l2"},
            doc="adaptive sharpness (Eq. 1), reference ℓ2 algorithm"),
    Measure("adaptive-linf", "adaptive", {"norm": "linf"}, doc="adaptive sharpness, ℓ∞ box"),
    Measure("adaptive-metric", "adaptive", {"norm": "l2", "projection": "metric"},
            doc="adaptive sharpness with the Riemannian step and the metric projection"),
    Measure("geodesic-inv", "geodesic", {"metric": "inv", "retraction": "second_order"},
            doc="geodesic sharpness (Eq. 4), inv metric, second-order retraction (Eq. 5)"),
    Measure("geodesic-mix", "geodesic", {"metric": "mix", "retraction": "second_order"},
            doc="geodesic sharpness (Eq. 4), mix metric, second-order retraction (Eq. 5)"),
)
"""Name → [`Measure`][quotient_manifolds.sharpness.measures.Measure]."""
