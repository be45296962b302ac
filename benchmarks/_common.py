"""Shared helpers of the benchmark scripts: timer, table printer, JSON output.

Not part of the library; imported by the scripts in ``benchmarks/`` (run them
from the repository root, e.g. ``.venv/bin/python benchmarks/manifold_ops.py``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued device work (no-op on CPU) so wall times are honest."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Timing(NamedTuple):
    """Median wall time and median process CPU time of a call, in seconds."""

    wall: float
    cpu: float


def time_call(
    fn: Callable[[], object],
    *,
    repeats: int = 3,
    warmup: int = 1,
    device: torch.device | str | None = None,
) -> Timing:
    """Median times of ``fn()`` over ``repeats`` runs after ``warmup`` runs.

    Wall time from :func:`time.perf_counter`; CPU time (user + system of this
    process, :func:`time.process_time`) alongside it, because on a shared
    machine other processes inflate wall time but not the CPU time of a
    single-threaded run.  The result of every call is dropped before the next
    one starts, so allocations are not kept alive across repeats.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
        sync(device)
    walls, cpus = [], []
    for _ in range(repeats):
        sync(device)
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        sync(device)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return Timing(statistics.median(walls), statistics.median(cpus))


def fmt(value: float | int | str | None, spec: str = ".3g") -> str:
    """Format one table cell; ``None`` and NaN print as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return format(value, spec)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], title: str = "") -> None:
    """Print a GitHub-markdown table (readable in a terminal and pasteable into docs)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    if title:
        print(f"\n{title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.rjust(w) if i else c.ljust(w)
                                for i, (c, w) in enumerate(zip(r, widths, strict=True))) + " |")


def git_state() -> str:
    """``HEAD`` of the checkout, plus ``+dirty`` if tracked library files have changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                "quotient_manifolds"],
                               cwd=root, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty.strip() else "")


def environment() -> dict[str, str | int | float]:
    """Versions, library revision and thread settings, recorded in the JSON output."""
    import geoopt

    return {
        "env_git": git_state(),
        "env_torch": torch.__version__,
        "env_geoopt": geoopt.__version__,
        "env_python": platform.python_version(),
        "env_machine": platform.machine(),
        "env_processor": platform.processor() or "unknown",
        "env_num_threads": torch.get_num_threads(),
        "env_cpu_count": os.cpu_count() or 0,
        "env_loadavg_start": load_average(),
    }


def load_average() -> float:
    """1-minute load average (-1 where unknown): other processes on the machine skew timings."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return -1.0


def write_json(path: str | Path | None, figures: dict[str, object]) -> None:
    """Write a flat JSON object of figures (no-op when ``path`` is ``None``)."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v)
        for k, v in figures.items()
    }
    path.write_text(json.dumps(clean, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {len(clean)} figures to {path}")
