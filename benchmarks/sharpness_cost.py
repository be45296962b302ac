"""Per-iteration time and peak memory of geodesic vs adaptive sharpness, as ratios from one run.

Models: the pretrained all-MiniLM-L6-v2 (batch 32, sequence 32, float32) and a tiny timm
ViT.  After a warm-up, each configuration is called with ``n_iter = 1`` and with
``n_iter = 1 + iters`` on one batch, ``--repeats`` times each; the marginal cost of an APGD
iteration, ``(T(1 + iters) − T(1)) / iters`` with ``T`` the minimum over repeats, in wall
time and in process CPU time, is divided by that of adaptive sharpness (the reference algorithm,
ℓ2 ball, Euclidean projection by bisection).  ``adaptive metric`` is adaptive sharpness with
the metric (radial) projection: forward + backward + elementwise work only, the floor any
sharpness measure pays per iteration.

Peak memory (MiniLM only, skipped with ``--no-memory``): every configuration runs in a fresh
subprocess; after the model and the batch are loaded, the peak-RSS counter of the process is
reset (``/proc/self/clear_refs``), 2 APGD iterations run, and the increase of the peak RSS
(``VmHWM``) over the RSS before the call is the call's peak memory.  Linux only.

    .venv/bin/python benchmarks/sharpness_cost.py [--iters 3] [--repeats 2] [--quick] [--json P]
"""

from __future__ import annotations

import argparse
import json
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

CONFIGS = {
    "adaptive": ("adaptive", {}),
    "adaptive_metric": ("adaptive", dict(projection="metric")),
    "geodesic_inv_second_order": ("geodesic", dict(metric="inv", retraction="second_order")),
    "geodesic_mix_second_order": ("geodesic", dict(metric="mix", retraction="second_order")),
    "geodesic_inv_exact": ("geodesic", dict(metric="inv", retraction="exact")),
    "geodesic_mix_exact": ("geodesic", dict(metric="mix", retraction="exact")),
    "geodesic_inv_exact_k4": ("geodesic", dict(metric="inv", retraction="exact",
                                               exact_steps=4)),
}
RHO = 0.05


def call(tag: str, model, loss, data, n_iter: int):
    kind, kw = CONFIGS[tag]
    fn = qm.adaptive_sharpness if kind == "adaptive" else qm.geodesic_sharpness
    return fn(model, loss, data, rho=RHO, n_iter=n_iter, progress=False, **kw)


def per_iter(tag, model, loss, data, iters, repeats) -> tuple[float, float, float, float]:
    """Marginal (wall, CPU) seconds per APGD iteration and (wall, CPU) setup seconds.

    ``T(n)`` is the min over ``repeats`` of a call with ``n_iter = n`` (after a warm-up);
    per iteration ``(T(1 + iters) − T(1)) / iters``, setup ``T(1)`` minus one iteration.
    """
    call(tag, model, loss, data, 1)  # warm-up
    best: dict[int, tuple[float, float]] = {}
    for _ in range(repeats):
        for n in (1, 1 + iters):
            c, t = time.process_time(), time.perf_counter()
            call(tag, model, loss, data, n)
            w, cp = time.perf_counter() - t, time.process_time() - c
            old = best.get(n, (float("inf"), float("inf")))
            best[n] = (min(old[0], w), min(old[1], cp))
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


def memory_worker(tag: str, quick: bool) -> None:
    """Subprocess body: print the peak RSS increase of one sharpness call as JSON."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model, loss, data, _ = minilm_setup(quick)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    call(tag, model, loss, data, 2)
    print(json.dumps({"peak_increase": _status("VmHWM") - before, "rss_before": before}))


def memory(tag: str, quick: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-worker", tag]
    if quick:
        cmd.append("--quick")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(name, key, model, loss, data, iters, repeats, figures, tags) -> None:
    print(f"\n{name}: s per APGD iteration (marginal, min of {repeats}), ratio to adaptive")
    base_w = base_c = None
    for tag in tags:
        w, c, sw, sc = per_iter(tag, model, loss, data, iters, repeats)
        base_w, base_c = base_w or w, base_c or c
        print(f"  {tag:28s} wall {w:8.3f}  cpu {c:8.3f}   ratio wall {w / base_w:5.2f} "
              f"cpu {c / base_c:5.2f}   setup cpu {sc:6.2f}", flush=True)
        figures[f"{key}_{tag}_s_per_iter"] = w
        figures[f"{key}_{tag}_cpu_s_per_iter"] = c
        figures[f"{key}_{tag}_setup_s"] = sw
        figures[f"{key}_{tag}_setup_cpu_s"] = sc
        if tag != "adaptive":
            figures[f"{key}_{tag}_over_adaptive"] = w / base_w
            figures[f"{key}_{tag}_cpu_over_adaptive"] = c / base_c


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="batch 8, seq 16 for MiniLM")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--no-vit", action="store_true", help="skip the tiny ViT")
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
    tags = list(CONFIGS)
    if not a.no_vit:
        run("tiny timm ViT (batch 3)", "vit", small_timm_vit().float().eval(), vit_loss,
            [(x.float(), y) for x, y in image_data(n_batches=1)], a.iters, a.repeats, figures,
            tags)
    model, loss, data, name = minilm_setup(a.quick)
    run(name, "minilm", model, loss, data, a.iters, a.repeats, figures, tags)
    # headline ratios (MiniLM, CPU time: other processes inflate wall time, not CPU time)
    f = figures
    head = {
        "geodesic_inv_over_adaptive": f["minilm_geodesic_inv_second_order_cpu_over_adaptive"],
        "geodesic_mix_over_adaptive": f["minilm_geodesic_mix_second_order_cpu_over_adaptive"],
        "geodesic_inv_over_adaptive_metric":
            f["minilm_geodesic_inv_second_order_cpu_s_per_iter"]
            / f["minilm_adaptive_metric_cpu_s_per_iter"],
        "exact_over_second_order": f["minilm_geodesic_inv_exact_cpu_s_per_iter"]
            / f["minilm_geodesic_inv_second_order_cpu_s_per_iter"],
        "exact_mix_over_second_order": f["minilm_geodesic_mix_exact_cpu_s_per_iter"]
            / f["minilm_geodesic_mix_second_order_cpu_s_per_iter"],
        "exact_k4_over_second_order": f["minilm_geodesic_inv_exact_k4_cpu_s_per_iter"]
            / f["minilm_geodesic_inv_second_order_cpu_s_per_iter"],
    }
    if not a.no_memory:
        print("\npeak memory of one call (MiniLM, fresh process each), MB above the loaded model")
        mem = {}
        for tag in tags:
            m = memory(tag, a.quick)
            mem[tag] = m["peak_increase"]
            f[f"minilm_{tag}_peak_mb"] = m["peak_increase"] / 2**20
            f[f"minilm_{tag}_rss_before_mb"] = m["rss_before"] / 2**20
            print(f"  {tag:28s} {m['peak_increase'] / 2**20:8.1f} MB "
                  f"(ratio {m['peak_increase'] / mem['adaptive']:5.2f}; "
                  f"RSS before {m['rss_before'] / 2**20:.0f} MB)", flush=True)
        head["peak_memory_geodesic_over_adaptive"] = (
            mem["geodesic_inv_second_order"] / mem["adaptive"])
        head["peak_memory_geodesic_mix_over_adaptive"] = (
            mem["geodesic_mix_second_order"] / mem["adaptive"])
        head["peak_memory_exact_over_adaptive"] = mem["geodesic_inv_exact"] / mem["adaptive"]
        head["peak_memory_exact_k4_over_adaptive"] = (
            mem["geodesic_inv_exact_k4"] / mem["adaptive"])
    print()
    for k, v in head.items():
        print(f"{k:40s} {v:6.2f}")
    f.update(head)
    f["total_s"] = time.perf_counter() - t0
    f["env_loadavg_end"] = load_average()
    write_json(a.json, f)


if __name__ == "__main__":
    main()
