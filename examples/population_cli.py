"""A population of checkpoints through ``quotient-manifolds sharpness`` and ``correlate``.

Trains small attention classifiers on a synthetic task with different learning rates and
training lengths, saves each as a safetensors checkpoint, writes their generalisation gaps
(test loss − train loss) to ``gaps.csv``, then runs the command line exactly as a user would::

    quotient-manifolds sharpness --model examples/population_cli.py:make_model \\
        --data examples/population_cli.py:make_batches --out DIR/results.jsonl DIR/*.safetensors
    quotient-manifolds correlate DIR/results.jsonl DIR/gaps.csv --out DIR

and prints the τ table; the scatter plots are ``DIR/scatter_<measure>.png``. Run::

    python examples/population_cli.py [--small] [--out DIR]

The factories below are what ``--model`` and ``--data`` point at: this file is loaded by path,
and only the functions are used (``main`` runs under ``__main__`` only).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

D, SEQ, CLASSES, N_TRAIN, N_TEST = 8, 5, 3, 48, 512


class Classifier(nn.Module):
    """One ``nn.MultiheadAttention`` layer (2 heads) and a linear read-out of the mean token."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


def make_model() -> nn.Module:
    """``--model``: the architecture every checkpoint belongs to."""
    return Classifier()


def _task(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(D, CLASSES, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, SEQ, D, generator=g)
    y = ((x.max(1).values - x.min(1).values) @ teacher).argmax(-1)  # needs the whole sequence
    return x, y


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``--data``: the training set in 2 fixed batches (sharpness is measured there)."""
    x, y = _task(N_TRAIN, seed=0)
    return [(x[:24], y[:24]), (x[24:], y[24:])]


def train(lr: float, steps: int, seed: int) -> tuple[dict, float]:
    """Full-batch Adam on the training set; returns the weights and test − train loss."""
    torch.manual_seed(seed)
    model = make_model()
    x, y = _task(N_TRAIN, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    with torch.no_grad():
        xt, yt = _task(N_TEST, seed=1)
        gap = float(nn.functional.cross_entropy(model(xt), yt)
                    - nn.functional.cross_entropy(model(x), y))
    return model.state_dict(), gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="6 members, 3 APGD steps (CI)")
    parser.add_argument("--out", type=Path, default=Path("runs/population_cli"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    from safetensors.torch import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    grid = list(itertools.product([3e-3, 1e-2, 3e-2], [100, 400]))
    if not args.small:
        grid = list(itertools.product([1e-3, 3e-3, 1e-2, 3e-2], [100, 400, 1600]))
    t0 = time.perf_counter()
    ckpts, rows = [], []
    for i, (lr, steps) in enumerate(grid):
        path = args.out / f"member{i:02d}.safetensors"
        state, gap = train(lr, steps, seed=i)
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
        ckpts.append(str(path))
        rows.append((path.stem, gap))
        print(f"member{i:02d}: lr={lr:g} steps={steps}: gap {gap:+.4f}")
    with (args.out / "gaps.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["checkpoint", "gap"])
        w.writerows(rows)
    print(f"trained {len(grid)} members in {time.perf_counter() - t0:.1f} s")

    here = Path(__file__).resolve()
    cli = [sys.executable, "-m", "quotient_manifolds"]
    results = args.out / "results.jsonl"
    sharp = [*cli, "sharpness", "--model", f"{here}:make_model", "--data",
             f"{here}:make_batches", "--measures", "adaptive,geodesic-inv,geodesic-mix",
             "--rho", "0.1", "--n-iter", "3" if args.small else "20", "--threads", "1",
             "--out", str(results), *ckpts]
    print("$", " ".join(sharp[2:4]), "...")
    subprocess.run(sharp, check=True)
    corr = [*cli, "correlate", str(results), str(args.out / "gaps.csv"), "--out", str(args.out)]
    print("$", " ".join(corr[2:]))
    subprocess.run(corr, check=True)


if __name__ == "__main__":
    main()
