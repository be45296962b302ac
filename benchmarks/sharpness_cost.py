"""Per-iteration wall time of geodesic vs adaptive sharpness, as ratios from one run.

Models: the pretrained all-MiniLM-L6-v2 (batch 32, sequence 32, float32) and a tiny
timm ViT.  Each configuration runs ``--iters`` APGD iterations on one batch after a
warm-up; the time per gradient evaluation is divided by that of adaptive sharpness.

    .venv/bin/python benchmarks/sharpness_cost.py [--iters 5] [--threads 2] [--quick] [--json P]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch  # noqa: E402
from model_zoo import (  # noqa: E402
    image_data,
    minilm,
    minilm_data,
    minilm_loss,
    small_timm_vit,
    vit_loss,
)

import quotient_manifolds as qm  # noqa: E402

CONFIGS = [
    ("adaptive", {}),
    ("geodesic inv second_order", dict(metric="inv", retraction="second_order")),
    ("geodesic mix second_order", dict(metric="mix", retraction="second_order")),
    ("geodesic inv exact", dict(metric="inv", retraction="exact")),
    ("geodesic mix exact", dict(metric="mix", retraction="exact")),
]


def per_iter(fn, model, loss, data, iters, **kw):
    fn(model, loss, data, rho=0.05, n_iter=1, progress=False, **kw)  # warm-up
    t = time.perf_counter()
    r = fn(model, loss, data, rho=0.05, n_iter=iters, progress=False, **kw)
    return (time.perf_counter() - t) / r.n_evals


def run(name, key, model, loss, data, iters, figures):
    base = None
    print(f"\n{name}")
    for label, kw in CONFIGS:
        fn = qm.adaptive_sharpness if label == "adaptive" else qm.geodesic_sharpness
        s = per_iter(fn, model, loss, data, iters, **kw)
        base = base or s
        print(f"  {label:28s} {1e3 * s:9.1f} ms/iter   ratio {s / base:5.2f}")
        tag = label.replace("geodesic ", "geodesic_").replace(" ", "_")
        figures[f"{key}_{tag}_s_per_iter"] = s
        if label != "adaptive":
            figures[f"{key}_{tag}_over_adaptive"] = s / base


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="batch 8, seq 16 for MiniLM")
    ap.add_argument("--json", metavar="PATH", help="write the figures as a flat JSON object")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    warnings.simplefilter("ignore")
    figures: dict[str, float] = {"iters": a.iters, "threads": a.threads}
    run("tiny timm ViT (batch 3)", "vit", small_timm_vit().float().eval(), vit_loss,
        [(x.float(), y) for x, y in image_data(n_batches=1)], a.iters, figures)
    bs, seq = (8, 16) if a.quick else (32, 32)
    data = [{k: (v.float() if v.is_floating_point() else v) for k, v in b.items()}
            for b in minilm_data(n_batches=1, bs=bs, seq=seq)]
    run(f"all-MiniLM-L6-v2 (batch {bs}, seq {seq})", "minilm", minilm().float().eval(),
        minilm_loss, data, a.iters, figures)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
