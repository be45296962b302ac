r"""The sharpness measures shared by the trained transformer populations.

Every population member is measured with the same suite (paper §6 and App. G):

* ``adaptive`` — adaptive sharpness (Eq. 1), reference ℓ2 algorithm, worst
* ``geodesic_inv`` / ``_mix`` — geodesic sharpness (Eq. 4), GL(h) per head, Eq. 5 (second-order)
  retraction, worst case
* ``geodesic_*_first_order`` — App. G ablation (b): ``w + ξ``, no second-order term
* ``geodesic_*_adaptive_norm`` — App. G ablation (a): the ball is ``‖ξ ⊘ |w|‖₂ ≤ ρ`` (ξ horizontal)
  instead of ``‖ξ‖_w ≤ ρ``
* ``*_average`` — average case, ``n_iter`` Gaussian samples

The keys are the measure names of the one table with underscores
([`key`][quotient_manifolds.sharpness.measures.Measure.key]).

**Average-case radius.** The engine draws ``ξ ~ N(0, ρ² g⁻¹)`` (adaptive:
``δ = ρ |w| ⊙ N(0, I)``), whose norm is ``≈ ρ √D`` in a model with ``D`` weights, far
outside the worst-case ball of the same ρ. The suite therefore calls the engine with
``ρ / √D`` (``D`` = number of trainable weights of the member) for the ``*_average``
measures, so that ``E‖ξ‖² = ρ²``: the samples lie, up to ``O(1/√D)``, on the sphere of the
worst-case ball, and the nominal ρ of an average measure is directly comparable with the
worst-case one. Results are keyed by the nominal ρ.

**The ρ sweep of the fine-tuned populations**
([`rho_sweep`][quotient_manifolds.experiments.rho_sweep]) calls the average case with ρ
itself, not ``ρ / √D``, and calibrates its ρ on its own (that module's docstring says why).

The radius of each measure is fixed by the experiment *before* any τ is computed, one per
norm: ``rho["adaptive"]`` for every ball measured in the adaptive norm (``adaptive``,
``adaptive_average`` and the ``*_adaptive_norm`` ablations), ``rho["inv"]`` and
``rho["mix"]`` for the metric balls of the two metrics.

**Choice of ρ** (the same rule for every population, applied once, before any member of
the population was trained): two *calibration* members outside the population (seeds 100
and 101; one that generalises, one that does not) are trained, and for each norm the ρ of
the 1-2-5 grid {…, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2} is taken at which the geometric
mean of their two worst-case loss increases is closest (in log scale) to 0.1 nats: large
enough to stand far above float rounding, small enough to stay below the saturation of the
cross-entropy. The calibration numbers are listed in ``docs/results/<name>.md``.

The evaluation runs in float64 on a copy of the model (the members train in float32):
near an interpolating minimum the loss increase at small ρ is comparable with the float32
rounding of the loss itself (measured in ``docs/results/grokking.md``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import QuotientManifoldError
from ..models import Symmetries
from ..models.model_geometry import ParamSelection
from ..sharpness.config import Geometry
from ..sharpness.engine import symmetries_of
from ..sharpness.measures import Measure, measure
from ..tree import tree_map
from .report import scatter_figure, summarize_members, write_results

__all__ = [
    "SUITE",
    "MAIN_MEASURES",
    "SuiteSettings",
    "finish_population",
    "float32_default",
    "measure_member",
    "measure_population",
    "measure_rho",
    "measure_tasks",
    "run_measure",
    "to_float64",
]


#: result key → measure of the one table (`quotient_manifolds.sharpness.measures.MEASURES`)
SUITE: dict[str, Measure] = {m.key: m for m in map(measure, (
    "adaptive", "geodesic-inv", "geodesic-mix", "geodesic-inv-first-order",
    "geodesic-mix-first-order", "geodesic-inv-adaptive-norm", "geodesic-mix-adaptive-norm",
    "adaptive-average", "geodesic-inv-average", "geodesic-mix-average"))}

#: the three measures of the paper's Table 1 (the scatter figure)
MAIN_MEASURES = ("adaptive", "geodesic_inv", "geodesic_mix")


@contextlib.contextmanager
def float32_default() -> Iterator[None]:
    """Build members in float32 whatever the caller's default dtype (reproducible inits)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def measure_rho(name: str, rho: Mapping[str, float]) -> float:
    """The radius of measure ``name``: the adaptive-norm ρ or the metric's own ρ."""
    return float(rho[SUITE[name].norm])


def measure_tasks(
    rho: Mapping[str, float], grid: Sequence[float] = (1.0,), names: Iterable[str] = tuple(SUITE)
) -> list[tuple[str, float]]:
    """``(measure, ρ)`` pairs: the main measures at ``ρ·g`` for ``g`` in ``grid``, others at ρ."""
    out = []
    for name in names:
        r = measure_rho(name, rho)
        for g in (grid if name in MAIN_MEASURES else (1.0,)):
            out.append((name, float(r * g)))
    return out


def to_float64(batch: Any) -> Any:
    """`batch` with every floating tensor in float64 (integer tensors and other leaves
    unchanged)."""
    return tree_map(lambda t: t.double() if t.is_floating_point() else t, batch)


@dataclass(frozen=True)
class SuiteSettings:
    r"""How the suite measures every member of a population.

    Attributes
    ----------
    rho : dict
        `{"adaptive": ρ, "inv": ρ, "mix": ρ}`: the radius of each norm (`measure_rho`).
    n_iter : int
        APGD iterations (worst case) or Gaussian samples (average case).
    seed : int
        Seed of the Gaussian samples.
    grid : tuple of float
        Multipliers of ρ for the `MAIN_MEASURES` (robustness to ρ; the headline uses the
        multiplier 1); the ablations and average-case measures use ρ only.
    names : tuple of str
        Measures to compute (default: all of `SUITE`).
    float64 : bool
        Measure a float64 copy of the model on float64 batches.
    """

    rho: Mapping[str, float]
    n_iter: int
    seed: int = 0
    grid: tuple[float, ...] = (1.0,)
    names: tuple[str, ...] = tuple(SUITE)
    float64: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", tuple(self.grid))
        object.__setattr__(self, "names", tuple(self.names))

    def tasks(self) -> list[tuple[str, float]]:
        """The `(measure, ρ)` pairs of one member (`measure_tasks`)."""
        return measure_tasks(self.rho, self.grid, self.names)


def measure_member(
    model: nn.Module,
    loss_fn: Callable,
    batches: Sequence,
    *,
    settings: SuiteSettings,
    cached: Mapping[str, Mapping[str, float]],
    save: Callable[[dict], None],
    bar: Any = None,
) -> dict[str, dict[str, float]]:
    r"""Every measure of one member, reusing ``cached`` values and saving after each one.

    Parameters
    ----------
    model : nn.Module
        The trained member (not modified; a float64 copy is measured if
        ``settings.float64``).
    loss_fn : callable
        ``loss_fn(model, batch) -> scalar``.
    batches : sequence
        The fixed measurement batches (identical for every member).
    settings : SuiteSettings
        The radii, iterations, seed, ρ grid and measures.
    cached : dict
        ``{name: {str(ρ): value}}`` already measured under the same protocol.
    save : callable
        Called with the updated dict after each new measure (crash-safe resume).
    bar : tqdm, optional
        Advanced once per ``(measure, ρ)`` pair.

    Returns
    -------
    dict
        ``{name: {str(ρ): value}}``; a failed measure is NaN and its error is stored
        under ``{"error": message}`` in ``values["_errors"][name]``.
    """
    values: dict = {k: dict(v) for k, v in cached.items()}
    f64 = settings.float64
    m = copy.deepcopy(model).double() if f64 else model
    data = [to_float64(b) for b in batches] if f64 else list(batches)
    n_weights = sum(p.numel() for p in m.parameters() if p.requires_grad)
    found: dict[str, Symmetries] = {}
    for name, r in settings.tasks():
        key = repr(r)
        if key in values.get(name, {}):
            if bar is not None:
                bar.update(1)
            continue
        meas = SUITE[name]
        r_call = r / math.sqrt(n_weights) if meas.kind == "average" else r
        try:
            val = float(run_measure(meas, m, loss_fn, data, rho=r_call, n_iter=settings.n_iter,
                                    seed=settings.seed, params=None, found=found).value)
        except QuotientManifoldError as e:  # e.g. rank-deficient head: recorded, not hidden
            val = math.nan
            values.setdefault("_errors", {})[name] = f"{type(e).__name__}: {e}"
        values.setdefault(name, {})[key] = val
        save(values)
        if bar is not None:
            bar.update(1)
    return values


def measure_population(
    experiment: str,
    store: Any,
    members: Sequence[Any],
    mhash: str,
    *,
    settings: SuiteSettings,
    build: Callable[[Any], nn.Module],
    batches: Callable[[Any], Sequence],
    loss_fn: Callable,
    progress: bool,
) -> None:
    r"""[`measure_member`][quotient_manifolds.experiments.sharpness_suite.measure_member] for
    every member of a population, cached in its store.

    Per member (`.id`, `.hyper`, `.meta`; `.measures` is set): `build(member)` makes the
    model under `float32_default`, the member's saved state is loaded into it, and the suite
    runs on `batches(member)` with `settings`, reusing and saving the values stored under
    `mhash`. One tqdm bar on stderr when `progress`.
    """
    from tqdm.auto import tqdm

    bar = tqdm(total=len(members) * len(settings.tasks()),
               desc=f"{experiment}: sharpness", file=sys.stderr, disable=not progress)
    for m in members:
        state, _ = store.load_member(m.id)
        with float32_default():
            model = build(m)
        model.load_state_dict(state)
        m.measures = measure_member(
            model, loss_fn, batches(m), settings=settings,
            cached=store.load_measures(m.id, mhash),
            save=functools.partial(store.save_measures, m.id, mhash), bar=bar)
    bar.close()


def finish_population(
    experiment: str,
    out_dir: Path,
    members: Sequence[Mapping],
    *,
    gap_name: str,
    rho: Mapping[str, float],
    settings: Mapping,
    second_gap: tuple[str, str] | None = None,
    extra: Mapping | None = None,
    n_boot: int = 2000,
) -> dict:
    r"""Summarise, write ``results.json`` and the scatter figures.

    ``members`` are ``{"id", "gap", "hyper", "measures", ...}`` records
    (`summarize`). With
    ``second_gap = (label, field)`` the τ of every measure and hyperparameter is also
    computed against ``member[field]`` and stored under ``"vs_" + field`` as
    ``{"gap", "measures", "baselines"}`` (same per-measure schema as the headline block).
    """
    primary = {name: measure_rho(name, rho) for name in SUITE}
    clean, res = summarize_members(experiment, members, gap_name=gap_name, primary=primary,
                                   settings=settings, second_gap=second_gap, extra=extra,
                                   n_boot=n_boot)
    out_dir.mkdir(parents=True, exist_ok=True)
    figs = [scatter_figure(res, out_dir / "scatter.png",
                           [n for n in MAIN_MEASURES if n in res["measures"]])]
    ablations = [n for n in SUITE if n not in MAIN_MEASURES and n in res["measures"]
                 and math.isfinite(res["measures"][n]["tau"])]
    if ablations:
        figs.append(scatter_figure(res, out_dir / "scatter_ablations.png", ablations))
    return write_results(out_dir, res, figs)


def _discovered_once(measure: Measure, model: nn.Module, loss_fn: Callable,
                     batches: Sequence, found: dict[str, Symmetries]) -> Measure:
    """`measure` with the model's symmetries given: discovered on the first call for its
    `symmetry`, then reused from `found` (one discovery per model and symmetry in a sweep)."""
    g = getattr(measure, "geometry", None)
    if (not isinstance(g, Geometry) or g.metric is None or g.blocks is not None
            or g.symmetries is not None or g.declared):
        return measure
    if g.symmetry not in found:
        found[g.symmetry] = symmetries_of(model, loss_fn, batches, geometry=g)
    return dataclasses.replace(measure, geometry=g.replace(symmetries=found[g.symmetry]))


def run_measure(measure: Any, model: nn.Module, loss_fn: Callable, batches: Sequence, *,
                rho: float, n_iter: int, seed: int, params: ParamSelection,
                found: dict[str, Symmetries] | None = None) -> Any:
    """`measure.run(...)` on the weights selected by `params`
    ([`select_parameters`][quotient_manifolds.models.model_geometry.select_parameters]; None:
    those with `requires_grad`); with `found`, the symmetries are discovered once per symmetry and
    reused from it."""
    if found is not None:
        measure = _discovered_once(measure, model, loss_fn, batches, found)
    return measure.run(model, loss_fn, batches, rho=rho, n_iter=n_iter, seed=seed,
                       params=params)
