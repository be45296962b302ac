"""Batched versus per-head cost of the GL(h) manifold operations at BERT-base shapes.

BERT-base has 12 layers × 12 heads × 2 block types (Q/K and V/O) = 288 GL(64)
blocks.  With the bias row appended both factors have 769 rows (V/O's ``H``
really has 768; 769 + 769 is used for every block so that they stack), so a
model's blocks form one ``(288, 1538, 64)`` tensor.  For both metrics this
script times :meth:`GLQuotient.proju`, :meth:`GLQuotient.egrad2rgrad` and
:meth:`GLQuotient.retr` (second order)

* **batched**: one call on the ``(288, 1538, 64)`` tensor;
* **loop**: 288 calls on ``(1538, 64)`` tensors, one per head, as a naive
  optimizer that iterates over parameters would do;

and reports the ratio ``loop / batched``.  It also reports the *dispatch
overhead* of the loop (the same 288 calls on tiny ``(4 + 4) × 2`` blocks, where
the arithmetic is negligible) and the best ratio batching could reach if it
removed that overhead and nothing else, ``loop / (loop − overhead)``.

Timing: ``torch.set_num_threads`` (1 by default), one warm-up call, then the
median of ``--repeats`` runs (default 2), measured with
:func:`time.perf_counter` (wall) and :func:`time.process_time` (CPU time of
this process, which other load on a shared machine does not inflate).  The
warm-up also checks that the batched and looped results agree (on the first 16
blocks).  Measured figures, the profile and suggested fixes:
``docs/benchmarks.md``.

Usage
-----
Full size (float32; about a minute on an idle core, 1.5 min on a loaded one)::

    .venv/bin/python benchmarks/manifold_ops.py --json runs/manifold_ops.json

Tiny configuration for CI (about 7 s)::

    .venv/bin/python benchmarks/manifold_ops.py --layers 1 --repeats 1

Other options: ``--dtypes float32 float64``, ``--no-validate`` (the
manifold's ``validate=False``), ``--profile`` (a :mod:`torch.profiler` table of
each batched call) and ``--threads N``.

JSON keys (flat): ``{op}_{metric}_{what}`` for float32 and
``{op}_{metric}_float64_{what}`` for float64, with ``what`` one of
``batched_s``, ``loop_s``, ``loop_over_batched`` (wall time), the same with
``_cpu`` (process CPU time: ``batched_cpu_s``, ``loop_cpu_s``,
``loop_over_batched_cpu``), ``overhead_s``, ``overhead_cpu_s``,
``ratio_bound`` and ``max_rel_diff``; ``op`` is ``proju``, ``egrad2rgrad`` or
``retr``; plus ``config_*`` and ``env_*`` entries.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    Timing,
    environment,
    fmt,
    load_average,
    print_table,
    time_call,
    write_json,
)

import quotient_manifolds as qm  # noqa: E402
from quotient_manifolds.geometry import gl  # noqa: E402

OPS = ("proju", "egrad2rgrad", "retr")
METRICS = ("inv", "mix")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
HEADS_PER_LAYER = 12
BLOCK_TYPES = 2  # Q/K and V/O
N_ROWS = 769  # d_model + bias row
H_DIM = 64  # head dimension

Op = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12, help="transformer layers (default 12)")
    p.add_argument("--heads", type=int, default=HEADS_PER_LAYER, help="heads per layer")
    p.add_argument("--repeats", type=int, default=2,
                   help="timed runs per figure, median (default 2: keeps the full size "
                        "under about a minute and a half on a loaded 2-core machine)")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32"])
    p.add_argument("--metrics", nargs="+", choices=METRICS, default=list(METRICS))
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--no-validate", action="store_true",
                   help="build the manifold with validate=False (no finiteness checks)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--profile", action="store_true",
                   help="print a torch.profiler table of each batched call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.layers < 1 or args.heads < 1 or args.repeats < 1:
        p.error("--layers, --heads and --repeats must be positive")
    return args


def make_op(manifold: qm.GLQuotient, op: str) -> Op:
    """The manifold method under test, as ``f(x, v)``."""
    return getattr(manifold, op)


def loop(f: Op, x: torch.Tensor, v: torch.Tensor) -> None:
    """One call per block, results dropped (what the loop timing measures)."""
    for i in range(x.shape[0]):
        f(x[i], v[i])


def max_rel_diff(f: Op, x: torch.Tensor, v: torch.Tensor, blocks: int = 16) -> float:
    """``max |batched − looped| / max |batched|`` over the first ``blocks`` blocks.

    The paths must agree.  Also the warm-up: one batched call and a short loop.
    """
    batched = f(x, v)[:blocks]
    looped = torch.stack([f(x[i], v[i]) for i in range(min(blocks, x.shape[0]))])
    return float((batched - looped).abs().max() / batched.abs().max().clamp_min(1e-30))


def inputs(
    manifold: qm.GLQuotient, blocks: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Point ``x``, Euclidean vector ``e`` (for proju/egrad2rgrad), small tangent step ``u``."""
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, manifold.n + manifold.m, H_DIM)
    x = torch.randn(shape, generator=g, dtype=dtype) / H_DIM**0.5
    e = torch.randn(shape, generator=g, dtype=dtype)
    u = manifold.proju(x, e)
    u = 1e-2 * u / u.flatten(-2).norm(dim=-1).amax()  # a small step, as an optimizer takes
    return x, e, u


def dispatch_overhead(metric: str, op: str, blocks: int, dtype: torch.dtype,
                      validate: bool, repeats: int) -> Timing:
    """Time of ``blocks`` calls on tiny ``(4 + 4) × 2`` blocks: the per-call overhead."""
    tiny = qm.GLQuotient(4, 4, metric=metric, validate=validate)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(blocks, 8, 2, generator=g, dtype=dtype)
    v = tiny.proju(x, torch.randn(blocks, 8, 2, generator=g, dtype=dtype)) * 1e-2
    f = make_op(tiny, op)
    return time_call(lambda: loop(f, x, v), repeats=max(repeats, 3), warmup=1)


def profile_call(f: Op, x: torch.Tensor, v: torch.Tensor, label: str) -> None:
    """Print the operators that dominate one batched call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        f(x, v)
    events = prof.key_averages()
    print(f"\nprofile of the batched call: {label}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=10))
    total = sum(e.self_cpu_time_total for e in events)
    for name in ("aten::isfinite", "aten::matmul", "aten::cat", "aten::linalg_eigh"):
        t = sum(e.cpu_time_total for e in events if e.key == name)
        print(f"  {name} (with children): {t / 1e3:.1f} ms = {100 * t / max(total, 1):.0f}%")


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run the benchmark, print the table, return (and optionally write) the figures."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    blocks = args.layers * args.heads * BLOCK_TYPES
    validate = not args.no_validate
    figures: dict[str, object] = {
        "config_blocks": blocks,
        "config_n": N_ROWS,
        "config_m": N_ROWS,
        "config_h": H_DIM,
        "config_repeats": args.repeats,
        "config_validate": validate,
        "config_dtypes": ",".join(args.dtypes),
        "config_gram_dtype": str(getattr(gl, "GRAM_DTYPE", "n/a")),
        **environment(),
    }
    print(
        f"GLQuotient ops: {blocks} blocks of ({N_ROWS} + {N_ROWS}) x {H_DIM}, "
        f"threads={torch.get_num_threads()}, repeats={args.repeats} (median), "
        f"validate={validate}, Gram dtype {figures['config_gram_dtype']}, "
        f"library {figures['env_git']}"
    )
    t_start = time.perf_counter()
    rows = []
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for metric in args.metrics:
            manifold = qm.GLQuotient(N_ROWS, N_ROWS, metric=metric, validate=validate)
            x, e, u = inputs(manifold, blocks, dtype, args.seed)
            for op in args.ops:
                f = make_op(manifold, op)
                v = u if op == "retr" else e
                diff = max_rel_diff(f, x, v)  # doubles as the warm-up of both paths
                t_b = time_call(partial(f, x, v), repeats=args.repeats, warmup=0)
                t_l = time_call(partial(loop, f, x, v), repeats=args.repeats, warmup=0)
                t_o = dispatch_overhead(metric, op, blocks, dtype, validate, args.repeats)
                bound = t_l.cpu / max(t_l.cpu - t_o.cpu, 1e-12)
                key = f"{op}_{metric}" + ("" if dname == "float32" else f"_{dname}")
                figures.update({
                    f"{key}_batched_s": t_b.wall,
                    f"{key}_loop_s": t_l.wall,
                    f"{key}_loop_over_batched": t_l.wall / t_b.wall,
                    f"{key}_batched_cpu_s": t_b.cpu,
                    f"{key}_loop_cpu_s": t_l.cpu,
                    f"{key}_loop_over_batched_cpu": t_l.cpu / max(t_b.cpu, 1e-12),
                    f"{key}_overhead_s": t_o.wall,
                    f"{key}_overhead_cpu_s": t_o.cpu,
                    f"{key}_ratio_bound": bound,
                    f"{key}_max_rel_diff": diff,
                })
                label = "retr (2nd order)" if op == "retr" else op
                rows.append([label, metric, dname,
                             fmt(1e3 * t_b.wall, ".1f"), fmt(1e3 * t_l.wall, ".1f"),
                             fmt(t_l.wall / t_b.wall, ".2f"),
                             fmt(1e3 * t_b.cpu, ".1f"), fmt(1e3 * t_l.cpu, ".1f"),
                             fmt(t_l.cpu / max(t_b.cpu, 1e-12), ".2f"),
                             fmt(1e3 * t_o.cpu, ".1f"), fmt(bound, ".2f"), fmt(diff, ".1e")])
                if args.profile:
                    profile_call(f, x, v, f"{op} {metric} {dname}")
    figures["total_wall_s"] = time.perf_counter() - t_start
    figures["env_loadavg_end"] = load_average()
    print_table(
        ["op", "metric", "dtype", "batched ms", "loop ms", "loop/batched",
         "batched cpu ms", "loop cpu ms", "loop/batched cpu",
         "overhead cpu ms", "ratio bound", "max rel diff"],
        rows,
    )
    print(
        "\nms: median wall time; cpu ms: median CPU time of this process (robust to other "
        "load).  overhead: the same loop on tiny (4+4)x2 blocks (pure per-call cost); "
        "ratio bound = loop / (loop - overhead) in CPU time, the speed-up batching could "
        "give by removing that overhead alone.  "
        f"Total {figures['total_wall_s']:.1f} s; load average "
        f"{figures['env_loadavg_start']:.2f} -> {figures['env_loadavg_end']:.2f} "
        f"on {figures['env_cpu_count']} CPUs."
    )
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
