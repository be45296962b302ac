r"""The table of sharpness measures, by name: the one place the CLI, the experiments and the
invariance checks look measures up.

Each entry is a frozen [`Measure`][quotient_manifolds.sharpness.measures.Measure]: a
[`Geometry`][quotient_manifolds.sharpness.config.Geometry] and a kind (worst or average case). Call
`MEASURES[name].run(model, loss_fn, data, rho=…)`.

| name | geometry | meaning |
|---|---|---|
| `adaptive` | no GL block, ellipsoid | adaptive sharpness (Eq. 1), reference ℓ2 algorithm |
| `adaptive-linf` | no GL block, box | adaptive sharpness, ℓ∞ |
| `adaptive-metric` | no GL block, metric ball | adaptive metric, Riemannian step and projection |
| `geodesic-inv`, `geodesic-mix` | GL(h) per head, `symmetry="paper"` | the paper's geodesic sharpness (Eq. 4, Eq. 5) |
| `geodesic-inv-full`, `geodesic-mix-full` | `symmetry="full"` | attention heads (rotary, grouped), LoRA, norm gains, bias translations, q/k norms |
| `geodesic-inv-complete`, `geodesic-mix-complete` | `symmetry="complete"` | every symmetry the library recognises (the default geometry) |
| `…-adaptive-norm` | `ball="adaptive"` | App. G ablation (a): the adaptive norm instead of the Riemannian one |
| `…-first-order` | `retraction="first_order"` | App. G ablation (b): no second-order term |
| `…-average` | Gaussian average | the average case (App. D) |

Result keys in the experiments use underscores:
[`Measure.key`][quotient_manifolds.sharpness.measures.Measure.key].
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..models.model_geometry import ParamSelection
from .config import Geometry
from .result import SharpnessResult
from .solvers import APGD, Average

__all__ = ["MEASURES", "Measure", "measure"]

KINDS = ("worst", "average")


@dataclass(frozen=True)
class Measure:
    """A named sharpness measure: a geometry and a kind.

    Attributes
    ----------
    name : str
        The table key (hyphenated, e.g. `"geodesic-inv"`).
    geometry : Geometry
        Metric, symmetries, retractions and ball.
    kind : {"worst", "average"}
        Auto-PGD maximum or Gaussian average.
    doc : str
        One line for tables and `--help`.
    """

    name: str
    geometry: Geometry
    kind: str = "worst"
    doc: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def key(self) -> str:
        """The name with underscores (`"geodesic_inv"`), as used for result keys."""
        return self.name.replace("-", "_")

    @property
    def method(self) -> str:
        """`"adaptive"` (no GL block) or `"geodesic"`."""
        return "adaptive" if self.geometry.metric is None else "geodesic"

    @property
    def norm(self) -> str:
        """The norm of the ball: `"adaptive"` (the adaptive norm, any ball but the metric one
        with GL blocks) or the metric (`"inv"`, `"mix"`). Measures of one norm share a radius."""
        g = self.geometry
        return g.metric if g.metric is not None and g.ball == "metric" else "adaptive"

    def spec(self) -> dict[str, Any]:
        """The measure's definition as a JSON-friendly dict (for protocol hashes)."""
        return {"geometry": self.geometry.settings(), "kind": self.kind}

    def solver(self, n_iter: int | None = None, seed: int | None = None,
               progress: bool = False) -> APGD | Average:
        """The solver of this measure: `APGD` (worst) or `Average` (average)."""
        if self.kind == "average":
            return Average(n=20 if n_iter is None else n_iter, seed=seed, progress=progress)
        return APGD(n_iter=20 if n_iter is None else n_iter, progress=progress)

    def run(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], Any],
        data: Iterable,
        *,
        rho: float,
        n_iter: int | None = None,
        seed: int | None = None,
        params: ParamSelection = None,
        progress: bool = False,
    ) -> SharpnessResult:
        """Evaluate this measure of `model` on `data` (mean over batches).

        `n_iter` is the number of APGD iterations (worst case) or samples (average case),
        default 20; `seed` seeds the samples of the average case.
        """
        from .engine import geodesic_sharpness

        return geodesic_sharpness(model, loss_fn, data, rho=rho, geometry=self.geometry,
                                  solver=self.solver(n_iter, seed, progress), params=params)


def _table(*measures: Measure) -> dict[str, Measure]:
    return {m.name: m for m in measures}


def _geodesic(metric: str, symmetry: str = "paper", **kw) -> Geometry:
    return Geometry(metric=metric, symmetry=symmetry, **kw)


_ADAPTIVE = Geometry(metric=None, ball="ellipsoid")

MEASURES: dict[str, Measure] = _table(
    Measure("adaptive", _ADAPTIVE, doc="adaptive sharpness (Eq. 1), reference ℓ2 algorithm"),
    Measure("adaptive-linf", Geometry(metric=None, ball="box"),
            doc="adaptive sharpness, ℓ∞ box"),
    Measure("adaptive-metric", Geometry(metric=None, ball="metric"),
            doc="adaptive sharpness with the Riemannian step and the metric projection"),
    *(m for metric in ("inv", "mix") for m in (
        Measure(f"geodesic-{metric}", _geodesic(metric),
                doc=f"geodesic sharpness (Eq. 4), {metric} metric, GL(h) per head (the paper's "
                    "measure), second-order retraction (Eq. 5)"),
        Measure(f"geodesic-{metric}-complete", _geodesic(metric, "complete"),
                doc=f"geodesic sharpness, {metric} metric, every recognised symmetry (the "
                    "default group)"),
        Measure(f"geodesic-{metric}-full", _geodesic(metric, "full"),
                doc=f"geodesic sharpness, {metric} metric, the full group (attention, LoRA, "
                    "norm gains, bias translations, q/k norms)"),
        Measure(f"geodesic-{metric}-adaptive-norm", _geodesic(metric, ball="adaptive"),
                doc=f"App. G ablation (a): {metric}, the adaptive norm instead of the "
                    "Riemannian one"),
        Measure(f"geodesic-{metric}-first-order", _geodesic(metric, retraction="first_order"),
                doc=f"App. G ablation (b): {metric}, no second-order term (w + ξ)"),
        Measure(f"geodesic-{metric}-average", _geodesic(metric), kind="average",
                doc=f"average case: Gaussian ξ of the {metric} metric on the horizontal space"),
        Measure(f"geodesic-{metric}-complete-average", _geodesic(metric, "complete"),
                kind="average", doc=f"average case of geodesic-{metric}-complete"),
        Measure(f"geodesic-{metric}-full-average", _geodesic(metric, "full"), kind="average",
                doc=f"average case of geodesic-{metric}-full"),
    )),
    Measure("adaptive-average", _ADAPTIVE, kind="average",
            doc="average case of adaptive sharpness: δ = ρ|w| ⊙ N(0, I)"),
)
"""Name → [`Measure`][quotient_manifolds.sharpness.measures.Measure]."""


def measure(name: str) -> Measure:
    """`MEASURES[name]`, accepting underscores (`"geodesic_inv"`) for hyphens."""
    key = name.replace("_", "-")
    if key not in MEASURES:
        raise KeyError(f"unknown measure {name!r}; choose from {', '.join(MEASURES)}")
    return MEASURES[key]
