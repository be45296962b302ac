r"""The sharpness measures shared by the trained transformer populations (issue 5).

Every population member is measured with the same suite (paper §6 and App. G):

==============================  =========================================================
name                            call
==============================  =========================================================
``adaptive``                    :func:`~quotient_manifolds.adaptive_sharpness`, ℓ2, worst
``geodesic_inv`` / ``_mix``     :func:`~quotient_manifolds.geodesic_sharpness`, Eq. 5
                                (second-order) retraction, worst case (paper Eq. 4)
``geodesic_*_first_order``      App. G ablation (b), the second-order term dropped:
                                ``retraction="first_order"`` (``w + ξ``)
``geodesic_*_adaptive_norm``    App. G ablation (a), the Riemannian norm replaced by the
                                adaptive norm: the ball is ``‖ξ ⊘ |w|‖₂ ≤ ρ`` instead of
                                ``‖ξ‖_w ≤ ρ`` (``ball_norm="adaptive"``)
``*_average``                   average case, ``n_iter`` Gaussian samples (spec §7.2)
==============================  =========================================================

**Average-case radius.** The engine draws ``ξ ~ N(0, ρ² g⁻¹)`` (adaptive:
``δ = ρ |w| ⊙ N(0, I)``), whose norm is ``≈ ρ √D`` in a model with ``D`` weights, far
outside the worst-case ball of the same ρ. The suite therefore calls the engine with
``ρ / √D`` (``D`` = number of trainable weights of the member) for the ``*_average``
measures, so that ``E‖ξ‖² = ρ²``: the samples lie, up to ``O(1/√D)``, on the sphere of the
worst-case ball, and the nominal ρ of an average measure is directly comparable with the
worst-case one. Results are keyed by the nominal ρ.

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
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from ..errors import QuotientManifoldError

__all__ = [
    "MEASURES",
    "MAIN_MEASURES",
    "measure_rho",
    "measure_tasks",
    "measure_member",
    "finish_population",
    "float32_default",
]

#: name → (method, keyword arguments of the engine call)
MEASURES: dict[str, tuple[str, dict]] = {
    "adaptive": ("adaptive", dict(kind="worst")),
    "geodesic_inv": ("geodesic", dict(metric="inv", retraction="second_order", kind="worst")),
    "geodesic_mix": ("geodesic", dict(metric="mix", retraction="second_order", kind="worst")),
    "geodesic_inv_first_order": ("geodesic", dict(metric="inv", retraction="first_order",
                                                  kind="worst")),
    "geodesic_mix_first_order": ("geodesic", dict(metric="mix", retraction="first_order",
                                                  kind="worst")),
    "geodesic_inv_adaptive_norm": ("geodesic", dict(metric="inv", retraction="second_order",
                                                    kind="worst", ball_norm="adaptive")),
    "geodesic_mix_adaptive_norm": ("geodesic", dict(metric="mix", retraction="second_order",
                                                    kind="worst", ball_norm="adaptive")),
    "adaptive_average": ("adaptive", dict(kind="average")),
    "geodesic_inv_average": ("geodesic", dict(metric="inv", retraction="second_order",
                                              kind="average")),
    "geodesic_mix_average": ("geodesic", dict(metric="mix", retraction="second_order",
                                              kind="average")),
}

#: the three measures of the paper's Table 1 (the scatter figure)
MAIN_MEASURES = ("adaptive", "geodesic_inv", "geodesic_mix")


@contextlib.contextmanager
def float32_default():
    """Build members in float32 whatever the caller's default dtype (reproducible inits)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def measure_rho(name: str, rho: Mapping[str, float]) -> float:
    """The radius of measure ``name``: the adaptive-norm ρ or the metric's own ρ."""
    method, kw = MEASURES[name]
    if method == "adaptive" or kw.get("ball_norm") == "adaptive":
        return float(rho["adaptive"])
    return float(rho[kw["metric"]])


def measure_tasks(
    rho: Mapping[str, float], grid: Sequence[float] = (1.0,), names: Iterable[str] = tuple(MEASURES)
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
    names: Iterable[str] = tuple(MEASURES),
    float64: bool = True,
    bar=None,
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
        ``{"adaptive": ρ, "inv": ρ, "mix": ρ}`` (see :func:`measure_rho`).
    n_iter : int
        APGD iterations (worst case) or Gaussian samples (average case).
    seed : int
        Seed of the Gaussian samples.
    cached : dict
        ``{name: {str(ρ): value}}`` already measured under the same protocol.
    save : callable
        Called with the updated dict after each new measure (crash-safe resume).
    grid : sequence of float
        Multipliers of ρ for the :data:`MAIN_MEASURES` (robustness to ρ; the headline
        uses the multiplier 1); the ablations and average-case measures use ρ only.
    names : iterable of str
        Measures to compute (default: all of :data:`MEASURES`).
    bar : tqdm, optional
        Advanced once per ``(measure, ρ)`` pair.

    Returns
    -------
    dict
        ``{name: {str(ρ): value}}``; a failed measure is NaN and its error is stored
        under ``{"error": message}`` in ``values["_errors"][name]``.
    """
    from ..sharpness import adaptive_sharpness, geodesic_sharpness

    values: dict = {k: dict(v) for k, v in cached.items()}
    m = copy.deepcopy(model).double() if float64 else model
    data = [_to64(b) for b in batches] if float64 else list(batches)
    n_weights = sum(p.numel() for p in m.parameters() if p.requires_grad)
    for name, r in measure_tasks(rho, grid, names):
        key = repr(r)
        if key in values.get(name, {}):
            if bar is not None:
                bar.update(1)
            continue
        method, kw = MEASURES[name]
        fn = adaptive_sharpness if method == "adaptive" else geodesic_sharpness
        r_call = r / math.sqrt(n_weights) if kw["kind"] == "average" else r
        try:
            val = float(fn(m, loss_fn, data, rho=r_call, n_iter=n_iter, seed=seed,
                           progress=False, **kw).value)
        except QuotientManifoldError as e:  # e.g. rank-deficient head: recorded, not hidden
            val = math.nan
            values.setdefault("_errors", {})[name] = f"{type(e).__name__}: {e}"
        values.setdefault(name, {})[key] = val
        save(values)
        if bar is not None:
            bar.update(1)
    return values


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
    (:func:`~quotient_manifolds.experiments.report.summarize`). With
    ``second_gap = (label, field)`` the τ of every measure and hyperparameter is also
    computed against ``member[field]`` and stored under ``"vs_" + field`` as
    ``{"gap", "measures", "baselines"}`` (same per-measure schema as the headline block).
    """
    from .report import scatter_figure, summarize
    from .store import atomic_write_text

    primary = {name: measure_rho(name, rho) for name in MEASURES}
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
    out_dir.mkdir(parents=True, exist_ok=True)
    figs = [scatter_figure(res, out_dir / "scatter.png",
                           [n for n in MAIN_MEASURES if n in res["measures"]])]
    ablations = [n for n in MEASURES if n not in MAIN_MEASURES and n in res["measures"]
                 and math.isfinite(res["measures"][n]["tau"])]
    if ablations:
        figs.append(scatter_figure(res, out_dir / "scatter_ablations.png", ablations))
    res["figures"] = [p.name for p in figs]
    atomic_write_text(out_dir / "results.json", json.dumps(res, indent=1, default=float))
    return res
