"""Per-iteration time and peak memory of every sharpness measure against a plain forward +
backward of the same batch (the floor), as ratios from one run.

Models: the pretrained all-MiniLM-L6-v2 (batch 32, sequence 32, float32) and a tiny timm ViT.

**Floor.** One plain forward + backward of the batch: `loss_fn(model, batch)` in eval mode and
`torch.autograd.grad(loss, parameters)`; the least any ascent iteration can cost.

**Time.** After a warm-up, each configuration is called with `n_iter = 1` and with
`n_iter = 1 + iters` on one batch, `--repeats` times each, with the floor timed between the
calls; the marginal cost of an iteration, `(T(1 + iters) − T(1)) / iters` with `T` the
minimum over repeats, in process CPU time (and wall time), is divided by the floor (the
minimum of its timings) and by adaptive sharpness (the reference algorithm).

The symmetries of each configuration are discovered once, before its timings.

**Peak memory** (MiniLM only, skipped with `--no-memory`): the floor and every configuration
run in a fresh subprocess; after the model and the batch are loaded and the symmetries
discovered, the allocator's free memory is returned to the system (`malloc_trim`), the
peak-RSS counter is reset (`/proc/self/clear_refs`), the floor or 2 APGD iterations run, and
the increase of the peak RSS (`VmHWM`) over the RSS before the call is the peak memory; it is
reported as a multiple of the floor's and in bytes per parameter of the model. Linux only.

`--quick` (CI): MiniLM at batch 8 × 16, the four headline configurations, memory of the
floor and of the two complete geodesic measures.

    .venv/bin/python benchmarks/sharpness_cost.py [--iters 3] [--repeats 2] [--quick] [--json P]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import subprocess
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from _common import environment, load_average, write_json  # noqa: E402
from model_zoo import (  # noqa: E402
    image_data,
    minilm,
    minilm_data,
    minilm_loss,
    small_timm_vit,
    vit_loss,
)

import quotient_manifolds as qm  # noqa: E402

M = qm.MEASURES
#: tag -> geometry (the solver is APGD)
CONFIGS = {
    "adaptive": M["adaptive"].geometry,
    "adaptive_metric": M["adaptive-metric"].geometry,
    "geodesic_inv_second_order": M["geodesic-inv"].geometry,
    "geodesic_mix_second_order": M["geodesic-mix"].geometry,
    "geodesic_inv_complete": M["geodesic-inv-complete"].geometry,
    "geodesic_mix_complete": M["geodesic-mix-complete"].geometry,
    "geodesic_inv_full": M["geodesic-inv-full"].geometry,
    "geodesic_mix_full": M["geodesic-mix-full"].geometry,
    "geodesic_inv_exact": M["geodesic-inv"].geometry.replace(retraction="exact"),
    "geodesic_mix_exact": M["geodesic-mix"].geometry.replace(retraction="exact"),
    "geodesic_inv_exact_k4": M["geodesic-inv"].geometry.replace(retraction="exact",
                                                                exact_steps=4),
}
RHO = 0.05
#: `--quick`: the configurations timed (and, with the floor, measured for memory)
QUICK = ("adaptive", "adaptive_metric", "geodesic_inv_complete", "geodesic_mix_complete")
QUICK_MEMORY = ("geodesic_inv_complete", "geodesic_mix_complete")


_DISCOVERED: dict[tuple[str, int], qm.Geometry] = {}


def geometry_of(tag: str, model, loss, data) -> qm.Geometry:
    """`CONFIGS[tag]` with the model's symmetries, discovered once per model and
    configuration (discovery is not part of an iteration, and its noise would blur the
    difference of two timed calls)."""
    key = (tag, id(model))
    if key not in _DISCOVERED:
        g = CONFIGS[tag]
        if g.metric is not None:
            g = g.replace(symmetries=qm.symmetries_of(model, loss, data, geometry=g))
        _DISCOVERED[key] = g
    return _DISCOVERED[key]


def call(tag: str, model, loss, data, n_iter: int):
    return qm.geodesic_sharpness(model, loss, data, rho=RHO, n_iter=n_iter,
                                 geometry=geometry_of(tag, model, loss, data))


def floor_call(model, loss, data) -> None:
    """One plain forward + backward of the batch (eval mode), the floor of an iteration."""
    params = list(model.parameters())
    was = model.training
    model.eval()
    try:
        torch.autograd.grad(loss(model, data[0]), params, allow_unused=True)
    finally:
        model.train(was)


def timed(fn) -> tuple[float, float]:
    c, t = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def per_iter(tag, model, loss, data, iters, repeats, floor: list
             ) -> tuple[float, float, float, float]:
    """Marginal (wall, CPU) seconds per APGD iteration and (wall, CPU) setup seconds.

    ``T(n)`` is the min over ``repeats`` of a call with ``n_iter = n`` (after a warm-up);
    per iteration ``(T(1 + iters) − T(1)) / iters``, setup ``T(1)`` minus one iteration.
    The floor is timed after every call and appended to ``floor`` (so that each
    configuration is compared with the floor measured in the same minutes).
    """
    call(tag, model, loss, data, 1)  # warm-up
    best: dict[int, tuple[float, float]] = {}
    for _ in range(repeats):
        for n in (1, 1 + iters):
            w, cp = timed(lambda n=n: call(tag, model, loss, data, n))
            old = best.get(n, (float("inf"), float("inf")))
            best[n] = (min(old[0], w), min(old[1], cp))
            floor.append(timed(lambda: floor_call(model, loss, data)))
    w = (best[1 + iters][0] - best[1][0]) / iters
    c = (best[1 + iters][1] - best[1][1]) / iters
    return w, c, best[1][0] - w, best[1][1] - c


def minilm_setup(quick: bool):
    bs, seq = (8, 16) if quick else (32, 32)
    data = [{k: (v.float() if v.is_floating_point() else v) for k, v in b.items()}
            for b in minilm_data(n_batches=1, bs=bs, seq=seq)]
    return minilm().float().eval(), minilm_loss, data, f"all-MiniLM-L6-v2 (batch {bs}, seq {seq})"


def _status(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _trim() -> None:
    """Return the allocator's free memory to the system (glibc), so that the RSS before a
    call holds no free heap that the call could reuse unseen."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def memory_worker(tag: str, quick: bool, discovery: bool = False) -> None:
    """Subprocess body: print the peak RSS increase of one call (or of the floor) as JSON.

    The symmetries are discovered before the measurement (discovery runs once per model and
    its probes run on a float64 copy of the model), unless `discovery`."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model, loss, data, _ = minilm_setup(quick)
    geometry = None if tag == "floor" else (
        CONFIGS[tag] if discovery else geometry_of(tag, model, loss, data))
    _trim()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    if tag == "floor":
        floor_call(model, loss, data)
    else:
        qm.geodesic_sharpness(model, loss, data, rho=RHO, n_iter=2, geometry=geometry)
    print(json.dumps({"peak_increase": _status("VmHWM") - before, "rss_before": before,
                      "n_params": sum(p.numel() for p in model.parameters())}))


def memory(tag: str, quick: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-worker", tag]
    if quick:
        cmd.append("--quick")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(name, key, model, loss, data, iters, repeats, figures, tags) -> None:
    print(f"\n{name}: s per APGD iteration (marginal, min of {repeats}), ratios to the floor "
          "(one plain forward + backward) and to adaptive, CPU time")
    floor_call(model, loss, data)  # warm-up
    floor: list[tuple[float, float]] = []
    rows = []
    for tag in tags:
        local: list[tuple[float, float]] = []
        rows.append((tag, *per_iter(tag, model, loss, data, iters, repeats, local),
                     min(f[0] for f in local), min(f[1] for f in local)))
        floor += local
    fw, fc = min(f[0] for f in floor), min(f[1] for f in floor)
    figures[f"{key}_floor_s"], figures[f"{key}_floor_cpu_s"] = fw, fc
    print(f"  {'floor (forward + backward)':28s} wall {fw:8.3f}  cpu {fc:8.3f}   (the fastest "
          "of all; each row is divided by the floor timed between its own calls)")
    base_w, base_c = rows[0][1], rows[0][2]
    for tag, w, c, sw, sc, lfw, lfc in rows:
        print(f"  {tag:28s} wall {w:8.3f}  cpu {c:8.3f}   over floor {c / lfc:5.2f}   "
              f"over adaptive {c / base_c:5.2f}   setup cpu {sc:6.2f}   floor cpu {lfc:6.3f}",
              flush=True)
        figures[f"{key}_{tag}_floor_cpu_s"] = lfc
        fw, fc = lfw, lfc
        figures[f"{key}_{tag}_s_per_iter"] = w
        figures[f"{key}_{tag}_cpu_s_per_iter"] = c
        figures[f"{key}_{tag}_setup_s"] = sw
        figures[f"{key}_{tag}_setup_cpu_s"] = sc
        figures[f"{key}_{tag}_cpu_over_floor"] = c / fc
        figures[f"{key}_{tag}_over_floor"] = w / fw
        if tag != "adaptive":
            figures[f"{key}_{tag}_over_adaptive"] = w / base_w
            figures[f"{key}_{tag}_cpu_over_adaptive"] = c / base_c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true",
                    help="batch 8, seq 16 for MiniLM, the headline configurations only")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--no-vit", action="store_true", help="skip the tiny ViT")
    ap.add_argument("--configs", help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--memory-worker", metavar="CONFIG", help=argparse.SUPPRESS)
    ap.add_argument("--json", metavar="PATH", help="write the figures as a flat JSON object")
    a = ap.parse_args()
    if a.memory_worker:
        memory_worker(a.memory_worker, a.quick)
        return
    torch.set_num_threads(a.threads)
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    figures: dict[str, object] = {"iters": a.iters, "repeats": a.repeats, "rho": RHO,
                                  **environment()}
    tags = a.configs.split(",") if a.configs else list(QUICK if a.quick else CONFIGS)
    if not a.no_vit:
        run("tiny timm ViT (batch 3)", "vit", small_timm_vit().float().eval(), vit_loss,
            [(x.float(), y) for x, y in image_data(n_batches=1)], a.iters, a.repeats, figures,
            tags)
    model, loss, data, name = minilm_setup(a.quick)
    run(name, "minilm", model, loss, data, a.iters, a.repeats, figures, tags)
    # headline ratios (MiniLM, CPU time: other processes inflate wall time, not CPU time)
    f = figures
    def get(name: str) -> float:
        return float(f.get(f"minilm_{name}", float("nan")))

    def per(tag: str) -> float:
        return get(f"{tag}_cpu_s_per_iter")

    head = {
        # the complete symmetry group (every recognised symmetry), the measures
        # geodesic-inv-complete and geodesic-mix-complete
        "geodesic_inv_over_floor": get("geodesic_inv_complete_cpu_over_floor"),
        "geodesic_mix_over_floor": get("geodesic_mix_complete_cpu_over_floor"),
        "geodesic_inv_full_over_floor": get("geodesic_inv_full_cpu_over_floor"),
        "geodesic_mix_full_over_floor": get("geodesic_mix_full_cpu_over_floor"),
        "geodesic_inv_paper_over_floor": get("geodesic_inv_second_order_cpu_over_floor"),
        "geodesic_mix_paper_over_floor": get("geodesic_mix_second_order_cpu_over_floor"),
        "adaptive_over_floor": get("adaptive_cpu_over_floor"),
        "adaptive_metric_over_floor": get("adaptive_metric_cpu_over_floor"),
        "geodesic_inv_over_adaptive": get("geodesic_inv_complete_cpu_over_adaptive"),
        "geodesic_mix_over_adaptive": get("geodesic_mix_complete_cpu_over_adaptive"),
        "geodesic_inv_over_adaptive_metric":
            per("geodesic_inv_complete") / per("adaptive_metric"),
        "exact_over_second_order": per("geodesic_inv_exact") / per("geodesic_inv_second_order"),
        "exact_mix_over_second_order":
            per("geodesic_mix_exact") / per("geodesic_mix_second_order"),
        "exact_k4_over_second_order":
            per("geodesic_inv_exact_k4") / per("geodesic_inv_second_order"),
    }
    if not a.no_memory:
        print("\npeak memory of one call (MiniLM, fresh process each, symmetries discovered "
              "before), MB above the loaded model")
        mem: dict[str, int] = {}
        n_params = 0
        mem_tags = [t for t in tags if not a.quick or t in QUICK_MEMORY]
        for tag in ["floor", *mem_tags]:
            m = memory(tag, a.quick)
            mem[tag] = m["peak_increase"]
            n_params = m["n_params"]
            f[f"minilm_{tag}_peak_mb"] = m["peak_increase"] / 2**20
            f[f"minilm_{tag}_rss_before_mb"] = m["rss_before"] / 2**20
            f[f"minilm_{tag}_peak_bytes_per_param"] = m["peak_increase"] / n_params
            ratio = "" if tag == "floor" else (
                f"(over floor {m['peak_increase'] / mem['floor']:5.2f}, over adaptive "
                f"{m['peak_increase'] / mem.get('adaptive', math.nan):5.2f}; ")
            print(f"  {tag:28s} {m['peak_increase'] / 2**20:8.1f} MB "
                  f"{m['peak_increase'] / n_params:5.1f} B/param "
                  f"{ratio or '('}RSS before {m['rss_before'] / 2**20:.0f} MB)", flush=True)
        f["minilm_n_params"] = n_params
        for tag in mem_tags:
            f[f"minilm_{tag}_peak_over_floor"] = mem[tag] / mem["floor"]
            # what the call keeps over the floor's own peak, per parameter of the model
            f[f"minilm_{tag}_state_bytes_per_param"] = (mem[tag] - mem["floor"]) / n_params
        nan = float("nan")

        def mratio(a_: str, b_: str) -> float:
            return mem[a_] / mem[b_] if a_ in mem and b_ in mem else nan

        def bpp(a_: str) -> float:
            return mem[a_] / n_params if a_ in mem else nan

        head["peak_memory_geodesic_inv_over_floor"] = mratio("geodesic_inv_complete", "floor")
        head["peak_memory_geodesic_mix_over_floor"] = mratio("geodesic_mix_complete", "floor")
        head["peak_memory_geodesic_inv_full_over_floor"] = mratio("geodesic_inv_full", "floor")
        head["peak_memory_geodesic_mix_full_over_floor"] = mratio("geodesic_mix_full", "floor")
        head["peak_memory_geodesic_inv_paper_over_floor"] = mratio(
            "geodesic_inv_second_order", "floor")
        head["peak_memory_adaptive_over_floor"] = mratio("adaptive", "floor")
        head["peak_memory_geodesic_inv_over_adaptive"] = mratio("geodesic_inv_complete",
                                                                "adaptive")
        head["peak_memory_geodesic_mix_over_adaptive"] = mratio("geodesic_mix_complete",
                                                                "adaptive")
        head["peak_memory_exact_over_adaptive"] = mratio("geodesic_inv_exact", "adaptive")
        head["peak_memory_exact_k4_over_adaptive"] = mratio("geodesic_inv_exact_k4", "adaptive")
        head["bytes_per_param_floor"] = bpp("floor")
        head["bytes_per_param_geodesic_inv"] = bpp("geodesic_inv_complete")
        head["bytes_per_param_geodesic_mix"] = bpp("geodesic_mix_complete")
        head["bytes_per_param_adaptive"] = bpp("adaptive")
    print()
    for k, v in head.items():
        print(f"{k:40s} {v:6.2f}")
    f.update(head)
    f["total_s"] = time.perf_counter() - t0
    f["env_loadavg_end"] = load_average()
    write_json(a.json, f)


if __name__ == "__main__":
    main()
