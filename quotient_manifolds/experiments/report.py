r"""``results.json`` and the τ table / scatter figures shared by every experiment.

Schema:

```text
{"experiment": str, "n_members": int, "gap": str,
 "measures":  {"adaptive": {"tau", "ci95", "p_value", "rho", "n", "by_rho": {...}}, ...},
 "baselines": {"<hyperparameter>": {"tau", "ci95", "p_value"}},
 "members":   [{"id", "gap", "hyper": {...}, "measures": {...}}, ...],
 "settings":  {...}}
```
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from .._deps import pyplot
from .stats import kendall_tau
from .store import atomic_write_text

__all__ = ["summarize", "summarize_members", "write_results", "tau_table", "scatter_figure",
           "tau_rho_figure"]


def _num(v) -> float:
    """Hyperparameters may be categorical (``"sgd"``); rank them by their sorted labels."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def summarize(
    experiment: str,
    members: Sequence[Mapping],
    *,
    gap_name: str,
    primary_rho: Mapping[str, float],
    settings: Mapping,
    n_boot: int = 2000,
    extra: Mapping | None = None,
) -> dict:
    r"""Build the ``results.json`` dict of one experiment.

    Parameters
    ----------
    members : sequence of dict
        ``{"id", "gap", "hyper": {name: value}, "measures": {measure: {str(rho): value}}}``.
    gap_name : str
        What ``gap`` is (e.g. ``"test loss"``).
    primary_rho : dict
        The radius of each measure that goes in the headline ``tau`` (fixed in the
        protocol before any τ is looked at); every other ρ is in ``by_rho``.
    settings : dict
        The protocol, stored verbatim.
    """
    gaps = [float(m["gap"]) for m in members]
    names = sorted({k for m in members for k in m["measures"]})
    measures = {}
    for name in names:
        rhos = sorted({r for m in members for r in m["measures"].get(name, {})}, key=float)
        by_rho = {}
        for r in rhos:
            xs = [m["measures"].get(name, {}).get(r, math.nan) for m in members]
            by_rho[r] = kendall_tau(xs, gaps, n_boot=n_boot)
        if not rhos:
            continue
        rho = primary_rho.get(name, float(rhos[len(rhos) // 2]))
        key = min(rhos, key=lambda r: abs(float(r) - rho))
        measures[name] = {**by_rho[key], "rho": float(key), "by_rho": by_rho}
    baselines = {}
    hyper_names = sorted({k for m in members for k in m.get("hyper", {})})
    for h in hyper_names:
        vals = [m.get("hyper", {}).get(h) for m in members]
        xs = [_num(v) for v in vals]
        if all(math.isnan(x) for x in xs):  # categorical: rank by sorted label
            labels = sorted({str(v) for v in vals})
            xs = [float(labels.index(str(v))) for v in vals]
        baselines[h] = kendall_tau(xs, gaps, n_boot=n_boot)
    out = {"experiment": experiment, "n_members": len(members), "gap": gap_name,
           "measures": measures, "baselines": baselines, "members": list(members),
           "settings": dict(settings)}
    if extra:
        out.update(extra)
    return out


def summarize_members(
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
    `measure_errors`), and their [`summarize`][quotient_manifolds.experiments.report.summarize]
    with the τ against the second gap `(label, field)` under `vs_<field>`."""
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


def write_results(out_dir: Path, res: dict, figs: Sequence[Path]) -> dict:
    """`res` with the names of its figures, written to `out_dir/results.json`."""
    res["figures"] = [p.name for p in figs]
    atomic_write_text(out_dir / "results.json", json.dumps(res, indent=1, default=float))
    return res


def tau_table(results: Mapping) -> str:
    """A plain-text τ table (measures, then hyperparameter baselines)."""
    lines = [f"{results['experiment']}: {results['n_members']} members, gap = {results['gap']}",
             f"{'measure':<34}{'rho':>9}{'tau':>8}  {'95% CI':<17}{'p':>9}"]

    def row(name, d, rho=""):
        ci = d["ci95"]
        lines.append(f"{name:<34}{rho:>9}{d['tau']:>8.3f}  [{ci[0]:+.2f}, {ci[1]:+.2f}]    "
                     f"{d['p_value']:>9.2g}")

    for name, d in results["measures"].items():
        row(name, d, f"{d['rho']:.3g}")
    for name, d in results["baselines"].items():
        row(f"(hyper) {name}", d)
    return "\n".join(lines)


def scatter_figure(
    results: Mapping, path: str | Path, measures: Sequence[str] | None = None
) -> Path:
    """Scatter of each measure (at its headline ρ) against the gap, one panel each (Figs. 3–5)."""
    plt = pyplot("the scatter figures of the experiments")

    names = list(measures or results["measures"])
    gaps = [m["gap"] for m in results["members"]]
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        d = results["measures"][name]
        key = next(r for r in d["by_rho"] if float(r) == d["rho"])
        xs = [m["measures"].get(name, {}).get(key, math.nan) for m in results["members"]]
        ax.scatter(xs, gaps, s=14, alpha=0.8)
        ax.set_xlabel(f"{name} (ρ={d['rho']:.3g})")
        ax.set_title(f"τ = {d['tau']:.2f}")
        if all(x > 0 for x in xs if x == x):
            ax.set_xscale("log")
    axes[0][0].set_ylabel(results["gap"])
    fig.suptitle(results["experiment"])
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def tau_rho_figure(
    results: Mapping, path: str | Path, measures: Sequence[str] | None = None,
    reference: Mapping[str, float] | None = None,
) -> Path:
    r"""τ (with its bootstrap 95 % CI) against ρ, one line per measure.

    With `reference = {measure: ρ*}` the x-axis is ρ/ρ* (measures of different norms on one
    axis); otherwise ρ itself.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in (measures or results["measures"]) if n in results["measures"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for k, name in enumerate(names):
        by = results["measures"][name]["by_rho"]
        rs = sorted(by, key=float)
        scale = float(reference[name]) if reference and name in reference else 1.0
        xs = [float(r) / scale * (1 + 0.03 * (k - len(names) / 2)) for r in rs]
        ts = [by[r]["tau"] for r in rs]
        lo = [by[r]["tau"] - by[r]["ci95"][0] for r in rs]
        hi = [by[r]["ci95"][1] - by[r]["tau"] for r in rs]
        ax.errorbar(xs, ts, yerr=[lo, hi], marker="o", ms=3, capsize=2, lw=1, label=name,
                    ls="--" if "average" in name else "-")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("ρ / ρ* (calibrated radius of the norm)" if reference else "ρ")
    ax.set_ylabel(f"Kendall τ (measure, {results['gap']})")
    ax.set_title(f"{results['experiment']}: τ against ρ (95 % bootstrap CI)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
