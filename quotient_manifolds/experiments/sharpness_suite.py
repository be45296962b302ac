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
([`measure_sweep`][quotient_manifolds.experiments.sharpness_suite.measure_sweep]) does not
use ``ρ / √D``: on them (``D`` = 10.6 M and 0.14 M perturbed weights) the samples of that radius
changed the loss by at most 2e-5 nats, with both signs (first-order sampling noise), and the
ranking of the members changed with the seed of the samples (Kendall τ between two seeds
−0.29 to +0.30 on 10–12 members). There the average case is called with ρ itself, the standard
deviation per direction (the reference convention ``δ = ρ |w| ⊙ N(0, I)``), and its ρ is
calibrated on its own, by the same rule as the worst case (``CALIBRATION_MEASURES``).

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
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import QuotientManifoldError
from ..models import Symmetries
from ..sharpness.config import Geometry
from ..sharpness.engine import symmetries_of
from ..sharpness.measures import Measure, measure

__all__ = [
    "SUITE",
    "CALIBRATION_MEASURES",
    "MAIN_MEASURES",
    "RHO_FACTORS",
    "SWEEP_MEASURES",
    "block_fraction",
    "calibrate_rho",
    "finish_sweep",
    "measure_sweep",
    "sweep_radii",
    "measure_rho",
    "measure_tasks",
    "measure_member",
    "measure_population",
    "finish_population",
    "float32_default",
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


def _to64(batch):
    if isinstance(batch, torch.Tensor):
        return batch.double() if batch.is_floating_point() else batch
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to64(b) for b in batch)
    if isinstance(batch, Mapping):
        return {k: _to64(v) for k, v in batch.items()}
    return batch


def measure_member(
    model: nn.Module,
    loss_fn: Callable,
    batches: Sequence,
    *,
    rho: Mapping[str, float],
    n_iter: int,
    seed: int,
    cached: Mapping[str, Mapping[str, float]],
    save: Callable[[dict], None],
    grid: Sequence[float] = (1.0,),
    names: Iterable[str] = tuple(SUITE),
    float64: bool = True,
    bar: Any = None,
) -> dict[str, dict[str, float]]:
    r"""Every measure of one member, reusing ``cached`` values and saving after each one.

    Parameters
    ----------
    model : nn.Module
        The trained member (not modified; a float64 copy is measured if ``float64``).
    loss_fn : callable
        ``loss_fn(model, batch) -> scalar``.
    batches : sequence
        The fixed measurement batches (identical for every member).
    rho : dict
        ``{"adaptive": ρ, "inv": ρ, "mix": ρ}`` (see `measure_rho`).
    n_iter : int
        APGD iterations (worst case) or Gaussian samples (average case).
    seed : int
        Seed of the Gaussian samples.
    cached : dict
        ``{name: {str(ρ): value}}`` already measured under the same protocol.
    save : callable
        Called with the updated dict after each new measure (crash-safe resume).
    grid : sequence of float
        Multipliers of ρ for the `MAIN_MEASURES` (robustness to ρ; the headline
        uses the multiplier 1); the ablations and average-case measures use ρ only.
    names : iterable of str
        Measures to compute (default: all of `SUITE`).
    bar : tqdm, optional
        Advanced once per ``(measure, ρ)`` pair.

    Returns
    -------
    dict
        ``{name: {str(ρ): value}}``; a failed measure is NaN and its error is stored
        under ``{"error": message}`` in ``values["_errors"][name]``.
    """
    values: dict = {k: dict(v) for k, v in cached.items()}
    m = copy.deepcopy(model).double() if float64 else model
    data = [_to64(b) for b in batches] if float64 else list(batches)
    n_weights = sum(p.numel() for p in m.parameters() if p.requires_grad)
    found: dict[str, Symmetries] = {}
    for name, r in measure_tasks(rho, grid, names):
        key = repr(r)
        if key in values.get(name, {}):
            if bar is not None:
                bar.update(1)
            continue
        meas = SUITE[name]
        r_call = r / math.sqrt(n_weights) if meas.kind == "average" else r
        try:
            val = float(_run_measure(meas, m, loss_fn, data, rho=r_call, n_iter=n_iter,
                                     seed=seed, params=None, found=found).value)
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
    build: Callable[[Any], nn.Module],
    batches: Callable[[Any], Sequence],
    loss_fn: Callable,
    rho: Mapping[str, float],
    grid: Sequence[float],
    n_iter: int,
    progress: bool,
    seed: int = 0,
) -> None:
    r"""[`measure_member`][quotient_manifolds.experiments.sharpness_suite.measure_member] for
    every member of a population, cached in its store.

    Per member (`.id`, `.hyper`, `.meta`; `.measures` is set): `build(member)` makes the
    model under `float32_default`, the member's saved state is loaded into it, and the suite
    runs on `batches(member)`, reusing and saving the values stored under `mhash`. One tqdm
    bar on stderr when `progress`.
    """
    import sys

    from tqdm.auto import tqdm

    bar = tqdm(total=len(members) * len(measure_tasks(rho, grid)),
               desc=f"{experiment}: sharpness", file=sys.stderr, disable=not progress)
    for m in members:
        state, _ = store.load_member(m.id)
        with float32_default():
            model = build(m)
        model.load_state_dict(state)
        m.measures = measure_member(
            model, loss_fn, batches(m), rho=rho, grid=grid, n_iter=n_iter, seed=seed,
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
    from .report import scatter_figure

    primary = {name: measure_rho(name, rho) for name in SUITE}
    clean, res = _summarize_members(experiment, members, gap_name=gap_name, primary=primary,
                                    settings=settings, second_gap=second_gap, extra=extra,
                                    n_boot=n_boot)
    out_dir.mkdir(parents=True, exist_ok=True)
    figs = [scatter_figure(res, out_dir / "scatter.png",
                           [n for n in MAIN_MEASURES if n in res["measures"]])]
    ablations = [n for n in SUITE if n not in MAIN_MEASURES and n in res["measures"]
                 and math.isfinite(res["measures"][n]["tau"])]
    if ablations:
        figs.append(scatter_figure(res, out_dir / "scatter_ablations.png", ablations))
    return _write_results(out_dir, res, figs)


def _summarize_members(
    experiment: str,
    members: Sequence[Mapping],
    *,
    gap_name: str,
    primary: Mapping[str, float],
    settings: Mapping,
    second_gap: tuple[str, str] | None,
    extra: Mapping | None,
    n_boot: int,
) -> tuple[list[dict], dict]:
    """The members without their private measure keys (a failed measure's error moved to
    `measure_errors`), and their summary with the τ against the second gap under
    `vs_<field>`."""
    from .report import summarize

    clean = []
    for m in members:
        rec = {**m, "measures": {k: v for k, v in m["measures"].items() if not k.startswith("_")}}
        if m["measures"].get("_errors"):
            rec["measure_errors"] = m["measures"]["_errors"]
        clean.append(rec)
    blob = dict(extra or {})
    if second_gap is not None:
        label, field = second_gap
        alt = summarize(experiment, [{**m, "gap": m[field]} for m in clean], gap_name=label,
                        primary_rho=primary, settings={}, n_boot=n_boot)
        blob[f"vs_{field}"] = {"gap": label, "measures": alt["measures"],
                               "baselines": alt["baselines"]}
    res = summarize(experiment, clean, gap_name=gap_name, primary_rho=primary,
                    settings=settings, n_boot=n_boot, extra=blob)
    return clean, res


def _write_results(out_dir: Path, res: dict, figs: Sequence[Path]) -> dict:
    """`res` with the names of its figures, written to `out_dir/results.json`."""
    from .store import atomic_write_text

    res["figures"] = [p.name for p in figs]
    atomic_write_text(out_dir / "results.json", json.dumps(res, indent=1, default=float))
    return res


# -- the ρ-sweep suite of the fine-tuned populations ---------------------------------------
#: result key -> (name in the measure table `quotient_manifolds.sharpness.measures.MEASURES`,
#: norm family whose calibrated radius it uses). Keys with `full` are the full-symmetry
#: measures; `adaptive_metric` is the adaptive baseline solved by the Riemannian step (the
#: solver of the geodesic measures), `adaptive` the reference solver.
SWEEP_MEASURES: dict[str, tuple[str, str]] = {
    "adaptive": ("adaptive", "adaptive"),
    "adaptive_metric": ("adaptive-metric", "adaptive"),
    "geodesic_inv": ("geodesic-inv", "inv"),
    "geodesic_mix": ("geodesic-mix", "mix"),
    "geodesic_inv_full": ("geodesic-inv-full", "inv"),
    "geodesic_mix_full": ("geodesic-mix-full", "mix"),
    "adaptive_average": ("adaptive-average", "adaptive_average"),
    "geodesic_inv_average": ("geodesic-inv-average", "inv_average"),
    "geodesic_mix_average": ("geodesic-mix-average", "mix_average"),
    "geodesic_inv_full_average": ("geodesic-inv-full-average", "inv_average"),
    "geodesic_mix_full_average": ("geodesic-mix-full-average", "mix_average"),
}
#: a selection of the perturbed weights: a predicate `(name, parameter) -> bool`, or None (all)
ParamSelection = Callable[[str, torch.Tensor], bool] | None
#: the measure whose loss increase calibrates each family's radius: the worst case of each
#: norm, and the average case of each norm on its own (its ρ is the standard deviation per
#: direction, a different scale)
CALIBRATION_MEASURES = {"adaptive": "adaptive", "inv": "geodesic-inv", "mix": "geodesic-mix",
                        "adaptive_average": "adaptive-average",
                        "inv_average": "geodesic-inv-average",
                        "mix_average": "geodesic-mix-average"}
#: the 1-2-5 grid of candidate radii, and the target loss increase of the calibration
RHO_CANDIDATES = tuple(m * 10.0**e for e in range(-5, 2) for m in (1.0, 2.0, 5.0))
CALIBRATION_TARGET = 0.1
#: the sweep: the calibrated radius times these factors (headline: factor 1)
RHO_FACTORS = (1 / 3, 1.0, 3.0)


def _measure_table() -> Any:
    from ..sharpness.measures import MEASURES as TABLE

    return TABLE


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


def _run_measure(measure: Any, model: nn.Module, loss_fn: Callable, batches: Sequence, *,
                 rho: float, n_iter: int, seed: int, params: ParamSelection,
                 found: dict[str, Symmetries] | None = None) -> Any:
    """`measure.run(...)` on the weights selected by `params` (None: those with
    `requires_grad`); with `found`, the symmetries are discovered once per symmetry."""
    if found is not None:
        measure = _discovered_once(measure, model, loss_fn, batches, found)
    return measure.run(model, loss_fn, batches, rho=rho, n_iter=n_iter, seed=seed,
                       params=params)


def calibrate_rho(
    model: nn.Module,
    loss_fn: Callable,
    batches: Sequence,
    *,
    n_iter: int,
    params: ParamSelection = None,
    seed: int = 0,
    target: float = CALIBRATION_TARGET,
    start: Mapping[str, float] | None = None,
    max_evals: int = 12,
    families: Mapping[str, str] | None = None,
) -> dict[str, dict]:
    r"""The radius of each norm family, by a fixed rule on one calibration member.

    For each family of `families` (default `CALIBRATION_MEASURES`: the worst case of the
    adaptive, inv and mix norms, and the average case of each) its measure is evaluated on
    the 1-2-5 grid `RHO_CANDIDATES`, walking up from
    `start[family]` while the loss increase is below `target` and down while it is above,
    until the target is bracketed (or `max_evals` radii were tried); the radius is the grid
    point whose increase is closest to `target` in log scale. No generalisation gap is read.

    Returns
    -------
    dict
        `{family: {"rho": ρ*, "trace": [[ρ, increase], ...]}}`.
    """
    table = _measure_table()
    found: dict[str, Symmetries] = {}
    start = {"adaptive": 0.1, "inv": 0.01, "mix": 0.01, **dict(start or {})}
    grid = list(RHO_CANDIDATES)
    out = {}
    for fam, name in (CALIBRATION_MEASURES if families is None else families).items():
        i = min(range(len(grid)),
                key=lambda k: abs(math.log(grid[k] / start.get(fam, 0.01))))
        trace: dict[int, float] = {}

        def inc(k, name=name, trace=trace):
            if k not in trace:
                res = _run_measure(table[name], model, loss_fn, batches, rho=grid[k],
                                   n_iter=n_iter, seed=seed, params=params, found=found)
                trace[k] = float(res.value)
            return trace[k]

        step = 1 if inc(i) < target else -1
        while 0 <= i + step < len(grid) and len(trace) < max_evals:
            j = i + step
            if (inc(j) < target) != (step == 1):  # crossed the target
                break
            i = j
        best = min(trace, key=functools.partial(_log_distance, trace, target))
        out[fam] = {"rho": grid[best], "trace": [[grid[k], trace[k]] for k in sorted(trace)]}
    return out


def _log_distance(trace: Mapping[int, float], target: float, k: int) -> float:
    return abs(math.log(max(trace[k], 1e-300) / target))


def sweep_radii(calibration: Mapping[str, Mapping]) -> dict[str, list[float]]:
    """`{family: [ρ* · f for f in RHO_FACTORS]}`."""
    return {fam: [float(c["rho"] * f) for f in RHO_FACTORS] for fam, c in calibration.items()}


def measure_sweep(
    model: nn.Module,
    loss_fn: Callable,
    batches: Sequence,
    *,
    radii: Mapping[str, Sequence[float]],
    n_iter: int,
    seed: int,
    cached: Mapping,
    save: Callable[[dict], None],
    names: Iterable[str] = tuple(SWEEP_MEASURES),
    params: ParamSelection = None,
    float64: bool = False,
    bar: Any = None,
) -> dict:
    r"""Every measure of `names` at every radius of its norm family, cached and resumable.

    Every measure is called with the radius of its family (worst case: the ball's radius;
    average case: the standard deviation per direction, module docstring). An
    average-case call that fails on a float32 model is retried once on a float64 copy (the
    reason is kept under `values["_float64_retry"][name]`). Each
    value is stored under `values[name][repr(ρ)]`; the result's norm split (GL blocks /
    adaptive part / total, per batch) under `values["_norms"][name][repr(ρ)]`; a failed call
    is NaN with its error under `values["_errors"][name]` (retried on the next run); a
    name missing from the measure table is listed under `values["_unavailable"]`.
    """
    table = _measure_table()
    values: dict = {k: (dict(v) if isinstance(v, dict) else list(v)) for k, v in cached.items()}
    m = copy.deepcopy(model).double() if float64 else model
    data = [_to64(b) for b in batches] if float64 else list(batches)
    m64: nn.Module | None = None
    data64: list = []
    unavailable = []
    found: dict[str, Symmetries] = {}  # the same names and structure in m and m64
    for name in names:
        tname, fam = SWEEP_MEASURES[name]
        if tname not in table:
            unavailable.append(tname)
            if bar is not None:
                bar.update(len(radii[fam]))
            continue
        measure = table[tname]
        for r in radii[fam]:
            key = repr(float(r))
            old = values.get(name, {}).get(key)
            if old is not None and math.isfinite(old):
                if bar is not None:
                    bar.update(1)
                continue
            try:
                try:
                    res = _run_measure(measure, m, loss_fn, data, rho=r, n_iter=n_iter,
                                       seed=seed, params=params, found=found)
                except (QuotientManifoldError, RuntimeError) as e:
                    # Gaussian samples of the average case have failed on float32 models
                    # (float32 draws against float64 factors): one retry on a float64 copy
                    if float64 or measure.kind != "average":
                        raise
                    if m64 is None:
                        m64 = copy.deepcopy(model).double()
                        data64 = [_to64(b) for b in batches]
                    res = _run_measure(measure, m64, loss_fn, data64, rho=r,
                                       n_iter=n_iter, seed=seed, params=params, found=found)
                    values.setdefault("_float64_retry", {})[name] = f"{type(e).__name__}: {e}"
                val = float(res.value)
                values.setdefault("_norms", {}).setdefault(name, {})[key] = res.norms
                values.get("_errors", {}).pop(name, None)
            except QuotientManifoldError as e:
                val = math.nan
                values.setdefault("_errors", {})[name] = f"{type(e).__name__}: {e}"
            values.setdefault(name, {})[key] = val
            save(values)
            if bar is not None:
                bar.update(1)
    values["_unavailable"] = sorted(set(unavailable))
    save(values)
    return values


def block_fraction(norms: Any) -> float:
    """Share of the squared perturbation norm on the GL blocks (mean over batches); NaN if
    the result has no block/adaptive split (adaptive measures)."""
    fr = []
    for d in norms or ():
        if isinstance(d, Mapping) and "blocks" in d and d.get("total"):
            fr.append(float(d["blocks"]) ** 2 / float(d["total"]) ** 2)
    return float(sum(fr) / len(fr)) if fr else math.nan


def finish_sweep(
    experiment: str,
    out_dir: Path,
    members: Sequence[Mapping],
    *,
    gap_name: str,
    calibration: Mapping[str, Mapping],
    settings: Mapping,
    second_gap: tuple[str, str] | None = None,
    extra: Mapping | None = None,
    n_boot: int = 2000,
    granulated_axes: Sequence[str] | None = None,
) -> dict:
    r"""`results.json` of a ρ-sweep population, its τ-against-ρ and scatter figures.

    On top of the schema of [`summarize`][quotient_manifolds.experiments.report.summarize]
    (every measure with its `by_rho`; the headline ρ is the calibrated radius of its norm):

    * `granulated`: per measure at the headline ρ, the granulated τ of Jiang et al. (2020)
      over `granulated_axes` (default: every hyperparameter and the seed): per axis the
      groups of members that differ only in it, the τ inside each, their mean, the number
      of groups and members used, and the mean over the axes `psi`
      ([`granulated`][quotient_manifolds.experiments.stats.granulated]); the same for every
      sampled hyperparameter as the measure under `granulated_baselines`; against the
      second gap under `vs_<field>.granulated`;
    * `conditional`: the hyperparameter with the largest |τ| against the gap (`on`) and, per
      measure, τ within its strata
      ([`conditional_tau`][quotient_manifolds.experiments.stats.conditional_tau]);
    * `budget_split`: per worst-case geodesic measure, the share of the squared norm of the
      maximising perturbation on the GL blocks at the headline ρ, per member, its range, and
      its τ against the gap;
    * `calibration` and `radii`.
    """
    from .report import scatter_figure, tau_rho_figure
    from .stats import conditional_tau, granulated, kendall_tau

    radii = sweep_radii(calibration)
    primary = {name: float(calibration[fam]["rho"]) for name, (_, fam) in SWEEP_MEASURES.items()
               if fam in calibration}
    clean, res = _summarize_members(experiment, members, gap_name=gap_name, primary=primary,
                                    settings=settings, second_gap=second_gap, extra=extra,
                                    n_boot=n_boot)
    gaps = [float(m["gap"]) for m in clean]
    hypers = [m["hyper"] for m in clean]
    with_seed = [{**m["hyper"], "seed": m.get("seed")} for m in clean]
    ids = [str(m["id"]) for m in clean]
    finite = {h: d for h, d in res["baselines"].items() if math.isfinite(d["tau"])}
    strongest = max(finite, key=lambda h: abs(finite[h]["tau"])) if finite else None

    def at_headline(name):
        d = res["measures"][name]
        key = next(r for r in d["by_rho"] if float(r) == d["rho"])
        return key, [m["measures"].get(name, {}).get(key, math.nan) for m in clean]

    res["granulated"] = {}
    res["conditional"] = {"on": strongest, "measures": {}, "baselines": {}}
    res["budget_split"] = {}
    for name in res["measures"]:
        key, xs = at_headline(name)
        res["granulated"][name] = granulated(xs, gaps, with_seed, axes=granulated_axes,
                                             ids=ids)
        if strongest is not None:
            res["conditional"]["measures"][name] = conditional_tau(
                xs, gaps, [h.get(strongest) for h in hypers])
        if name.startswith("geodesic") and "average" not in name:  # a maximiser's split
            fr = [block_fraction(m["measures_norms"].get(name, {}).get(key))
                  if "measures_norms" in m else math.nan for m in members]
            ok = [f for f in fr if math.isfinite(f)]
            res["budget_split"][name] = {
                "rho": float(key), "block_fraction": dict(zip([m["id"] for m in members], fr)),
                "min": min(ok) if ok else math.nan, "max": max(ok) if ok else math.nan,
                "median": float(sorted(ok)[len(ok) // 2]) if ok else math.nan,
                "tau_vs_gap": kendall_tau(fr, gaps, n_boot=n_boot)}
    if second_gap is not None:  # the granulated τ against the second gap too
        fld = second_gap[1]
        res[f"vs_{fld}"]["granulated"] = {
            name: granulated(at_headline(name)[1], [float(m[fld]) for m in clean], with_seed,
                             axes=granulated_axes, ids=ids) for name in res["measures"]}
    res["granulated_baselines"] = {
        h: granulated([_num(m["hyper"].get(h)) for m in clean], gaps, with_seed,
                      axes=granulated_axes, ids=ids) for h in res["baselines"]}
    if strongest is not None:
        for h in res["baselines"]:
            if h != strongest:
                res["conditional"]["baselines"][h] = conditional_tau(
                    [_num(m["hyper"].get(h)) for m in clean], gaps,
                    [m["hyper"].get(strongest) for m in clean])
    res["calibration"] = {k: dict(v) for k, v in calibration.items()}
    res["radii"] = radii
    out_dir.mkdir(parents=True, exist_ok=True)
    worst = [n for n in ("adaptive", "adaptive_metric", "geodesic_inv", "geodesic_mix",
                         "geodesic_inv_full", "geodesic_mix_full") if n in res["measures"]]
    figs = [scatter_figure(res, out_dir / "scatter.png", worst),
            tau_rho_figure(res, out_dir / "tau_vs_rho.png", reference=primary)]
    return _write_results(out_dir, res, figs)


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan
