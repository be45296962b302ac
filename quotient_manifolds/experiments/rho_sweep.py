r"""The ρ calibration and the ρ sweep of the fine-tuned populations.

Every member is measured with every measure of
[`SWEEP_MEASURES`][quotient_manifolds.experiments.rho_sweep.SWEEP_MEASURES] at the calibrated
radius of its norm family times `RHO_FACTORS` (1/3, 1, 3; the headline at 1).

**Calibration** ([`calibrate_rho`][quotient_manifolds.experiments.rho_sweep.calibrate_rho]):
on one converged member, the radius of each family is the point of the 1-2-5 grid
`RHO_CANDIDATES` whose loss increase is closest, in log scale, to `CALIBRATION_TARGET`
(0.1 nats). No generalisation gap is read.

**The average case** is not called with ``ρ / √D`` here (unlike the suite of
[`sharpness_suite`][quotient_manifolds.experiments.sharpness_suite]): on the fine-tuned
populations (``D`` = 10.6 M and 0.14 M perturbed weights) the samples of that radius
changed the loss by at most 2e-5 nats, with both signs (first-order sampling noise), and the
ranking of the members changed with the seed of the samples (Kendall τ between two seeds
−0.29 to +0.30 on 10–12 members). There the average case is called with ρ itself, the standard
deviation per direction (the reference convention ``δ = ρ |w| ⊙ N(0, I)``), and its ρ is
calibrated on its own, by the same rule as the worst case (``CALIBRATION_MEASURES``).
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import QuotientManifoldError
from ..models import Symmetries
from ..models.model_geometry import ParamSelection
from ..sharpness.measures import MEASURES
from .report import scatter_figure, summarize_members, tau_rho_figure, write_results
from .sharpness_suite import run_measure, to_float64
from .stats import conditional_tau, granulated, kendall_tau

__all__ = [
    "CALIBRATION_MEASURES",
    "CALIBRATION_TARGET",
    "DEFAULT_SWEEP",
    "PAPER_COMPLETE_SWEEP",
    "RHO_CANDIDATES",
    "RHO_FACTORS",
    "SWEEP_MEASURES",
    "SweepSettings",
    "block_fraction",
    "calibrate_rho",
    "finish_sweep",
    "measure_sweep",
    "sweep_done",
    "sweep_radii",
]

#: result key -> (name in the measure table `quotient_manifolds.sharpness.measures.MEASURES`,
#: norm family whose calibrated radius it uses). Keys with `full` are the full-symmetry
#: measures, keys with `complete` the complete-symmetry ones; `adaptive_metric` is the
#: adaptive baseline solved by the Riemannian step (the solver of the geodesic measures),
#: `adaptive` the reference solver.
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
    "geodesic_inv_complete": ("geodesic-inv-complete", "inv"),
    "geodesic_mix_complete": ("geodesic-mix-complete", "mix"),
    "geodesic_inv_complete_average": ("geodesic-inv-complete-average", "inv_average"),
    "geodesic_mix_complete_average": ("geodesic-mix-complete-average", "mix_average"),
}
#: the measures of the first two fine-tuned populations (`minilm-finetune`, `vit-finetune`):
#: every key above but the complete-symmetry ones (their measure protocol, and its hash)
DEFAULT_SWEEP = tuple(k for k in SWEEP_MEASURES if "complete" not in k)
#: the measures asked of the seed-only and soup populations: adaptive, the paper's geodesic
#: measure (GL(h) per head) and the complete-symmetry one, worst and average case
PAPER_COMPLETE_SWEEP = ("adaptive", "geodesic_inv", "geodesic_mix", "geodesic_inv_complete",
                        "geodesic_mix_complete", "adaptive_average", "geodesic_inv_average",
                        "geodesic_mix_average", "geodesic_inv_complete_average",
                        "geodesic_mix_complete_average")
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
    """The measure table the sweep reads its measures from (looked up at each call)."""
    return MEASURES


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
                res = run_measure(table[name], model, loss_fn, batches, rho=grid[k],
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


@dataclass(frozen=True)
class SweepSettings:
    """How [`measure_sweep`][quotient_manifolds.experiments.rho_sweep.measure_sweep] measures
    one member.

    Attributes
    ----------
    radii : dict
        `{family: [ρ, ...]}`, the radii of each norm family
        ([`sweep_radii`][quotient_manifolds.experiments.rho_sweep.sweep_radii]).
    n_iter : int
        APGD iterations (worst case) or Gaussian samples (average case).
    seed : int
        Seed of the samples.
    names : tuple of str
        Keys of `SWEEP_MEASURES` to compute (default: `DEFAULT_SWEEP`).
    params : callable, optional
        The perturbed weights, a predicate `(name, parameter) -> bool` (None: those with
        `requires_grad`).
    float64 : bool
        Measure a float64 copy of the model on float64 batches.
    """

    radii: Mapping[str, Sequence[float]]
    n_iter: int
    seed: int = 0
    names: tuple[str, ...] = DEFAULT_SWEEP
    params: ParamSelection = None
    float64: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(self.names))


def sweep_done(cached: Mapping, settings: SweepSettings, *, allow_errors: bool = False
               ) -> bool:
    """Whether `cached` (the values of
    [`measure_sweep`][quotient_manifolds.experiments.rho_sweep.measure_sweep]) holds every
    measure of `settings.names` at every radius of its family, finite (or, with
    `allow_errors`, a failed call whose error is recorded), so that nothing is left to run."""
    if "_unavailable" not in cached:  # written by the sweep's last save
        return False
    errors = cached.get("_errors", {})
    for name in settings.names:
        tname, fam = SWEEP_MEASURES[name]
        if tname in cached["_unavailable"]:
            continue
        for r in settings.radii[fam]:
            v = cached.get(name, {}).get(repr(float(r)))
            if v is None or not (math.isfinite(v) or (allow_errors and name in errors)):
                return False
    return True


def measure_sweep(
    model: nn.Module,
    loss_fn: Callable,
    batches: Sequence,
    *,
    settings: SweepSettings,
    cached: Mapping,
    save: Callable[[dict], None],
    bar: Any = None,
) -> dict:
    r"""Every measure of `settings.names` at every radius of its norm family, cached and
    resumable.

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
    s = settings
    m = copy.deepcopy(model).double() if s.float64 else model
    data = [to_float64(b) for b in batches] if s.float64 else list(batches)
    m64: nn.Module | None = None
    data64: list = []
    unavailable = []
    found: dict[str, Symmetries] = {}  # the same names and structure in m and m64
    for name in s.names:
        tname, fam = SWEEP_MEASURES[name]
        if tname not in table:
            unavailable.append(tname)
            if bar is not None:
                bar.update(len(s.radii[fam]))
            continue
        measure = table[tname]
        for r in s.radii[fam]:
            key = repr(float(r))
            old = values.get(name, {}).get(key)
            if old is not None and math.isfinite(old):
                if bar is not None:
                    bar.update(1)
                continue
            try:
                try:
                    res = run_measure(measure, m, loss_fn, data, rho=r, n_iter=s.n_iter,
                                      seed=s.seed, params=s.params, found=found)
                except (QuotientManifoldError, RuntimeError) as e:
                    # Gaussian samples of the average case have failed on float32 models
                    # (float32 draws against float64 factors): one retry on a float64 copy
                    if s.float64 or measure.kind != "average":
                        raise
                    if m64 is None:
                        m64 = copy.deepcopy(model).double()
                        data64 = [to_float64(b) for b in batches]
                    res = run_measure(measure, m64, loss_fn, data64, rho=r,
                                      n_iter=s.n_iter, seed=s.seed, params=s.params,
                                      found=found)
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
    radii = sweep_radii(calibration)
    primary = {name: float(calibration[fam]["rho"]) for name, (_, fam) in SWEEP_MEASURES.items()
               if fam in calibration}
    clean, res = summarize_members(experiment, members, gap_name=gap_name, primary=primary,
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
                         "geodesic_inv_full", "geodesic_mix_full", "geodesic_inv_complete",
                         "geodesic_mix_complete") if n in res["measures"]]
    figs = [scatter_figure(res, out_dir / "scatter.png", worst),
            tau_rho_figure(res, out_dir / "tau_vs_rho.png", reference=primary)]
    return write_results(out_dir, res, figs)


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan
