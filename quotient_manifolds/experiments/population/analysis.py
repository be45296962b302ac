r"""Rank correlation of a population's sharpness with its generalisation gap.

[`correlate`][quotient_manifolds.experiments.population.analysis.correlate] reads a results
file and a gaps file (a CSV with the columns `checkpoint` and `gap`; `checkpoint` is the path
as given to the run, an absolute path, a path relative to the CSV's folder, or the file stem:
the folder name, for a checkpoint folder) and computes the Kendall τ-b of each measure (and
radius) against the gap, with a percentile-bootstrap 95 % interval and the p-value of τ = 0
([`kendall_tau`][quotient_manifolds.experiments.stats.kendall_tau]), written to
`correlation.json`, with one scatter PNG per measure (`scatter_<measure>.png`).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

from ..._deps import require
from ...errors import PopulationInputError
from ...sharpness.measures import MEASURES
from ..stats import check_n_boot, kendall_tau
from ..store import atomic_write_text
from .inputs import check_out_folder
from .results_file import read_jsonl

__all__ = ["correlate", "format_table", "read_gaps"]


def read_gaps(path: str | os.PathLike) -> dict[str, float]:
    """`{checkpoint: gap}` from a CSV file with the header columns `checkpoint` and `gap`."""
    p = Path(path)
    if not p.is_file():
        raise PopulationInputError(f"gaps file {path} does not exist; check the path")
    fix = "the file needs a header line 'checkpoint,gap' and one row per checkpoint"
    with p.open(newline="") as f:
        try:
            rows = list(csv.reader(f))
        except csv.Error as e:
            raise PopulationInputError(f"gaps file {path} is not valid CSV ({e}); {fix}") from None
    rows = [r for r in rows if any(c.strip() for c in r)]
    if not rows:
        raise PopulationInputError(f"gaps file {path} is empty; {fix}")
    header = [c.strip().lower() for c in rows[0]]
    if "checkpoint" not in header or "gap" not in header:
        raise PopulationInputError(
            f"gaps file {path} has columns {', '.join(header)}; {fix}"
        )
    ci, gi = header.index("checkpoint"), header.index("gap")
    gaps: dict[str, float] = {}
    for n, row in enumerate(rows[1:], 2):
        if len(row) <= max(ci, gi):
            raise PopulationInputError(f"gaps file {path} line {n} has {len(row)} column(s); {fix}")
        name, val = row[ci].strip(), row[gi].strip()
        try:
            gap = float(val)
        except ValueError:
            raise PopulationInputError(
                f"gaps file {path} line {n}: gap {val!r} is not a number; {fix}"
            ) from None
        if not name:
            raise PopulationInputError(f"gaps file {path} line {n}: empty checkpoint; {fix}")
        if name in gaps:
            raise PopulationInputError(
                f"gaps file {path} line {n}: checkpoint {name!r} appears twice; keep one row"
            )
        gaps[name] = gap
    if not gaps:
        raise PopulationInputError(f"gaps file {path} has a header but no rows; {fix}")
    return gaps


def _match_gap(rec: Mapping, gaps: Mapping[str, float], gaps_dir: Path) -> float | None:
    for k in (rec.get("checkpoint"), rec.get("path")):
        if isinstance(k, str) and k in gaps:
            return gaps[k]
    given = os.path.normpath(str(rec.get("checkpoint")))
    for k, v in gaps.items():  # "runs/m0/" for "runs/m0", paths relative to the CSV, stems
        if (os.path.normpath(k) == given or k.rstrip("/") == rec.get("stem")
                or str((gaps_dir / k).resolve()) == rec.get("path")):
            return v
    return None


def correlate(
    results: str | os.PathLike,
    gaps: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    plots: bool = True,
) -> dict:
    """Kendall τ (bootstrap CI) of every measure and radius in `results` against the gaps.

    Writes `out/correlation.json` and, with `plots`, `out/scatter_<measure>.png`; returns
    the dict of `correlation.json`: `{"rows": [{"measure", "rho", "tau", "ci95", "p_value",
    "n", "n_dropped"}], "members": [...], "dropped": [{"checkpoint", "reason"}],
    "unmatched": [...], "figures": [...]}`. A member whose gap is NaN or Inf is left out and
    listed in `dropped`; `n_members` counts the members used.

    Raises
    ------
    InvalidArgumentError
        `n_boot` is not an integer from 1.
    PopulationInputError
        A missing or malformed results or gaps file, an `out` folder that cannot be written
        (checked first), or fewer than 3 members with a gap.
    """
    n_boot = check_n_boot(n_boot)  # before any file is read
    rp = Path(results)
    if not rp.is_file():
        raise PopulationInputError(f"results file {results} does not exist; write it with "
                                   "evaluate_population first")
    # the output folder is checked before any work (created only when writing)
    outdir = check_out_folder(Path(out) if out is not None else rp.parent)
    recs = read_jsonl(rp)
    gap_of = read_gaps(gaps)
    recs = [r for r in recs if {"measure", "rho", "value", "checkpoint"} <= r.keys()]
    if not recs:
        raise PopulationInputError(f"results file {results} has no sharpness line; run "
                                   "evaluate_population first")
    stems: dict[str | None, set] = {}
    for r in recs:
        stems.setdefault(r.get("stem"), set()).add(r.get("path"))
    gaps_dir = Path(gaps).resolve().parent
    members: dict[str, dict] = {}
    unmatched = []
    for r in recs:
        g = _match_gap(r, gap_of, gaps_dir)
        if g is None:
            if r["checkpoint"] not in unmatched:
                unmatched.append(r["checkpoint"])
            continue
        if r.get("stem") in gap_of and len(stems[r.get("stem")]) > 1 and not (
                r["checkpoint"] in gap_of or r.get("path") in gap_of):
            raise PopulationInputError(
                f"gaps file {gaps}: stem {r['stem']!r} names several checkpoints; use their "
                "paths in the checkpoint column"
            )
        m = members.setdefault(r["path"], {"id": r["checkpoint"], "gap": g, "measures": {}})
        m["measures"].setdefault(r["measure"], {})[repr(float(r["rho"]))] = float(r["value"])
    # a NaN or Inf gap says nothing about a rank: the member is left out, and reported
    mlist = [m for m in members.values() if math.isfinite(m["gap"])]
    dropped = [{"checkpoint": m["id"], "reason": f"gap {_non_finite(m['gap'])}"}
               for m in members.values() if not math.isfinite(m["gap"])]
    if len(mlist) < 3:
        why = f" ({_dropped_text(dropped)})" if dropped else ""
        raise PopulationInputError(
            f"only {len(mlist)} checkpoint(s) of {results} have a gap in {gaps}{why}; τ needs "
            "at least 3 finite gaps: check the checkpoint column (path as given, absolute "
            "path, or stem) and the gap column"
        )
    order = list(MEASURES)
    names = sorted({k for m in mlist for k in m["measures"]},
                   key=lambda n: order.index(n) if n in order else len(order))
    rows = []
    for name in names:
        rhos = sorted({r for m in mlist for r in m["measures"].get(name, {})}, key=float)
        for rho in rhos:
            xs = [m["measures"].get(name, {}).get(rho, math.nan) for m in mlist]
            t = kendall_tau(xs, [m["gap"] for m in mlist], n_boot=n_boot, seed=seed)
            rows.append({"measure": name, "rho": float(rho), **t})
    outdir.mkdir(parents=True, exist_ok=True)
    figures = []
    if plots:
        figures = [str(_scatter(mlist, name, rows, outdir / f"scatter_{name}.png"))
                   for name in names]
    blob = {"results": str(rp), "gaps": str(gaps), "n_members": len(mlist), "rows": rows,
            "members": mlist, "dropped": dropped, "unmatched": unmatched, "figures": figures,
            "n_boot": n_boot}
    atomic_write_text(outdir / "correlation.json", json.dumps(blob, indent=1))
    return blob


def _non_finite(x: float) -> str:
    return "NaN" if math.isnan(x) else ("Inf" if x > 0 else "-Inf")


def _dropped_text(dropped: list[dict]) -> str:
    """`"2 dropped: gap NaN (m3, m4), gap Inf (m5)"`: the members left out, by reason."""
    by: dict[str, list[str]] = {}
    for d in dropped:
        by.setdefault(d["reason"], []).append(d["checkpoint"])
    parts = [f"{why} ({', '.join(ids[:3])}{f' +{len(ids) - 3} more' if len(ids) > 3 else ''})"
             for why, ids in by.items()]
    return f"{len(dropped)} dropped: {', '.join(parts)}"


def _scatter(members: list[dict], name: str, rows: list[dict], path: Path) -> Path:
    matplotlib = require("matplotlib", "the scatter plots of correlate (or pass plots=False)")
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot", "the scatter plots of correlate (or pass plots=False)")

    mine = [r for r in rows if r["measure"] == name]
    fig, axes = plt.subplots(1, len(mine), figsize=(3.8 * len(mine), 3.3), squeeze=False)
    gaps = [m["gap"] for m in members]
    for ax, row in zip(axes[0], mine):
        key = repr(float(row["rho"]))
        xs = [m["measures"].get(name, {}).get(key, math.nan) for m in members]
        ax.scatter(xs, gaps, s=16, alpha=0.8)
        lo, hi = row["ci95"]
        ax.set_title(f"τ = {row['tau']:.2f} [{lo:.2f}, {hi:.2f}], n = {row['n']}", fontsize=9)
        ax.set_xlabel(f"{name} sharpness (ρ = {row['rho']:.3g})")
        if all(x > 0 for x in xs if x == x):
            ax.set_xscale("log")
    axes[0][0].set_ylabel("gap")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_table(blob: Mapping) -> str:
    """The τ table of
    [`correlate`][quotient_manifolds.experiments.population.analysis.correlate] as text."""
    dropped = blob.get("dropped") or []
    head = f"{blob['n_members']} checkpoints with a gap"
    lines = [head + (f", {_dropped_text(dropped)}" if dropped else ""),
             f"{'measure':<14}{'rho':>8}{'n':>5}{'tau':>8}   {'95% CI':<16}{'p':>9}"]
    short = []
    for r in blob["rows"]:
        lo, hi = r["ci95"]
        lines.append(f"{r['measure']:<14}{r['rho']:>8.3g}{r['n']:>5}{r['tau']:>8.3f}   "
                     f"[{lo:+.2f}, {hi:+.2f}]  {r['p_value']:>9.2g}")
        if r.get("n_dropped"):
            short.append(f"{r['measure']} at rho {r['rho']:.3g}: {r['n_dropped']} dropped "
                         "(no finite sharpness)")
    lines.extend(short)
    if blob["unmatched"]:
        few = ", ".join(blob["unmatched"][:3])
        more = f" (+{len(blob['unmatched']) - 3} more)" if len(blob["unmatched"]) > 3 else ""
        lines.append(f"no gap for {len(blob['unmatched'])} checkpoint(s): {few}{more}")
    return "\n".join(lines)
