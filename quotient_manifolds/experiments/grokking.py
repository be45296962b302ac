r"""Population C: one-layer transformers grokking modular addition.

Every member learns $(a + b) \bmod p$ from the
token sequence ``[a, b, =]`` (prediction at the last position) with a one-layer,
LayerNorm-free transformer in the style of Nanda et al. (2023):

* token and learned position embeddings, ``d = 64``;
* attention with 4 heads of ``d_h = 16`` and **no biases**, written with separate
  ``q_proj``/``k_proj``/``v_proj``/``o_proj`` projections, so that
  `discover_blocks` finds the exact per-head GL(16) symmetries
  (one Q/K and one V/O block per head: ``softmax(X W_qᵢ (X W_kᵢ)ᵀ/√d_h) X W_vᵢ W_oᵢ``
  only depends on the products $W_{q,i} W_{k,i}^\top$ and $W_{v,i} W_{o,i}$);
* residual MLP of width ``4d`` with ReLU, untied unembedding;
* full-batch AdamW, learning rate 3e-3, β = (0.9, 0.98), float32.

**Population** (16 members, drawn by `sample_population` with a fixed seed): weight
decay ∈ {0.1, 0.3, 1.0}, train fraction ∈ {0.3, 0.4, 0.5, 0.6}, p ∈ {43, 59}, the step
budget ∈ {800, 1200, 1600} (short budgets leave members mid-transition, so that the test
error is not bimodal) and the seed (initialisation and train/test split).

**Protocol.** Members whose final train accuracy is below 99 % are reported and left out of
τ (a fixed budget plus a filter). The gap is the test error (train error is 0 for
every kept member); τ against the test cross-entropy is reported as a second gap under
``results["vs_test_loss"]``. Sharpness is measured on the full training set (one batch), in
float64, with the suite of `sharpness_suite` at the
radii `RHO` (fixed before any τ was computed).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .._deps import pyplot
from .modules import Attention, seeded
from .sharpness_suite import (
    SUITE,
    SuiteSettings,
    finish_population,
    float32_default,
    measure_population,
)
from .template import Member, PopulationExperiment, at_minimum

__all__ = [
    "NAME",
    "RHO",
    "RHO_GRID",
    "Attention",
    "EXPERIMENT",
    "GrokTransformer",
    "modular_data",
    "sample_population",
    "train_member",
    "run",
]

NAME = "grokking"
REQUIRES = ("safetensors", "matplotlib")
"""Optional packages this experiment needs (checked before it runs)."""
#: radii of the three norms (fixed before any τ was computed; see docs/results/grokking.md)
RHO = {"adaptive": 1.0, "inv": 0.2, "mix": 0.1}
#: multipliers of ρ for the three main measures (robustness of τ to ρ; headline at 1)
RHO_GRID = (1.0,)
N_ITER = 20
N_MEMBERS = 16
SAMPLER_SEED = 20250509
MIN_TRAIN_ACC = 0.99
LR, BETAS = 3e-3, (0.9, 0.98)
EVAL_EVERY = 100
QUICK_BATCH = 128


class GrokTransformer(nn.Module):
    """One-layer, LayerNorm-free transformer for ``(a + b) mod p``."""

    def __init__(self, p: int, d: int = 64, num_heads: int = 4, mlp_mult: int = 4) -> None:
        super().__init__()
        self.p = p
        self.embed = nn.Embedding(p + 1, d)  # token p is "="
        self.pos = nn.Parameter(torch.randn(3, d) / math.sqrt(d))
        nn.init.normal_(self.embed.weight, std=1 / math.sqrt(d))
        self.attn = Attention(d, num_heads, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, mlp_mult * d), nn.ReLU(), nn.Linear(mlp_mult * d, d))
        self.unembed = nn.Linear(d, p, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        x = x + self.attn(x)
        x = x + self.mlp(x)
        return self.unembed(x[:, -1])


def modular_data(p: int, frac: float, seed: int) -> tuple[torch.Tensor, ...]:
    """All ``p²`` pairs ``[a, b, =]`` split at random: ``(x_train, y_train, x_test, y_test)``."""
    a, b = torch.meshgrid(torch.arange(p), torch.arange(p), indexing="ij")
    x = torch.stack([a.flatten(), b.flatten(), torch.full((p * p,), p)], dim=1)
    y = (a.flatten() + b.flatten()) % p
    perm = torch.from_numpy(np.random.default_rng(seed).permutation(p * p))
    n = int(round(frac * p * p))
    return x[perm[:n]], y[perm[:n]], x[perm[n:]], y[perm[n:]]


def sample_population(n: int = N_MEMBERS, seed: int = SAMPLER_SEED) -> list[dict]:
    """The fixed hyperparameter draws (member ``i`` has seed ``i``)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        out.append({
            "weight_decay": float(rng.choice([0.1, 0.3, 1.0])),
            "train_frac": float(rng.choice([0.3, 0.4, 0.5, 0.6])),
            "p": int(rng.choice([43, 59])),
            "steps": int(rng.choice([800, 1200, 1600])),
            "seed": i,
        })
    return out


@torch.no_grad()
def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    logits = model(x)
    return float(F.cross_entropy(logits, y)), float((logits.argmax(-1) == y).float().mean())


def train_member(hyper: dict, *, steps: int | None = None) -> tuple[GrokTransformer, dict]:
    """Train one member with full-batch AdamW; returns the model and its metrics."""
    x, y, xt, yt = modular_data(hyper["p"], hyper["train_frac"], hyper["seed"])
    with float32_default(), seeded(hyper["seed"]):
        model = GrokTransformer(hyper["p"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS,
                            weight_decay=hyper["weight_decay"])
    steps = hyper["steps"] if steps is None else steps
    history = []
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if s % EVAL_EVERY == 0 or s == steps:
            tl, ta = _evaluate(model, x, y)
            vl, va = _evaluate(model, xt, yt)
            history.append([s, tl, ta, vl, va])
    train_loss, train_acc = _evaluate(model, x, y)
    test_loss, test_acc = _evaluate(model, xt, yt)
    meta = {"hyper": hyper, "train_loss": train_loss, "train_acc": train_acc,
            "test_loss": test_loss, "test_acc": test_acc, "test_error": 1 - test_acc,
            "train_error": 1 - train_acc, "steps_run": steps, "history": history,
            "train_time_s": time.perf_counter() - t0,
            "n_params": sum(p.numel() for p in model.parameters())}
    return model, meta


def _loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _curves_figure(records: list[dict], path: Path) -> Path:
    plt = pyplot("the figures of the grokking experiment")

    fig, ax = plt.subplots(1, 1, figsize=(5.2, 3.4))
    for r in records:
        h = np.asarray(r["history"], dtype=float)
        if h.size:
            ax.plot(h[:, 0], h[:, 4], lw=1, alpha=0.8)
    ax.set_xlabel("full-batch step")
    ax.set_ylabel("test accuracy")
    ax.set_title("grokking population: test accuracy during training")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class GrokkingExperiment(PopulationExperiment):
    """The grokking population on the template of
    [`PopulationExperiment`][quotient_manifolds.experiments.template.PopulationExperiment]."""

    name = NAME

    def hypers(self, quick):
        return sample_population(3 if quick else N_MEMBERS)

    def training(self, quick):
        return {"lr": LR, "betas": list(BETAS), "optimizer": "AdamW, full batch", "d": 64,
                "heads": 4, "mlp": "4d ReLU", "layernorm": False, "dtype": "float32",
                "steps_override": 20 if quick else None}

    def train(self, ctx, hyper, quick):
        model, meta = train_member(hyper, steps=self.training(quick)["steps_override"])
        return model.state_dict(), meta

    def keep(self, member, quick):
        return quick or member.meta["train_acc"] >= MIN_TRAIN_ACC

    def measure_protocol(self, quick):
        grid = (1.0,) if quick else RHO_GRID
        return {"rho": RHO, "rho_grid": list(grid), "average_rho": "rho/sqrt(D)",
                "n_iter": 3 if quick else N_ITER,
                "batches": f"first {QUICK_BATCH} training pairs" if quick
                else "full training set, 1 batch",
                "dtype": "float64", "seed": 0,
                "measures": {k: m.spec() for k, m in SUITE.items()}}

    def measure(self, ctx, store, members, mhash, quick, progress):
        prot = self.measure_protocol(quick)

        def batches(m):
            x, y, _, _ = modular_data(m.hyper["p"], m.hyper["train_frac"], m.hyper["seed"])
            if quick:  # smoke test: a small fixed batch
                x, y = x[:QUICK_BATCH], y[:QUICK_BATCH]
            return [(x, y)]

        settings = SuiteSettings(rho=RHO, n_iter=prot["n_iter"], grid=tuple(prot["rho_grid"]))
        measure_population(NAME, store, members, mhash, settings=settings,
                           build=lambda m: GrokTransformer(m.hyper["p"]), batches=batches,
                           loss_fn=_loss, progress=progress)

    @staticmethod
    def _record(m: Member) -> dict:
        meta = m.meta
        return {"id": m.id, "hyper": {k: v for k, v in m.hyper.items() if k != "seed"},
                "seed": m.hyper["seed"], "gap": meta["test_error"],
                "test_loss": meta["test_loss"], "train_loss": meta["train_loss"],
                "train_acc": meta["train_acc"], "test_acc": meta["test_acc"],
                "history": meta["history"]}

    def finish(self, ctx, store, members, dropped, *, mhash, quick, t_start):
        records = [{**self._record(m), "measures": m.measures} for m in members]
        dropped_recs = [{k: self._record(m)[k] for k in ("id", "hyper", "train_acc", "test_acc")}
                        for m in dropped]
        n = len(members) + len(dropped)
        settings = {"population": {"n_members": n, "sampler_seed": SAMPLER_SEED,
                                   "weight_decay": [0.1, 0.3, 1.0],
                                   "train_frac": [0.3, 0.4, 0.5, 0.6],
                                   "p": [43, 59], "steps": [800, 1200, 1600]},
                    "training": self.training(quick),
                    "filter": f"train accuracy >= {MIN_TRAIN_ACC}",
                    "measure_protocol": self.measure_protocol(quick),
                    "measure_protocol_hash": mhash, "quick": quick}
        out_dir = store.dir
        curves = records + [{"history": m.meta["history"]} for m in dropped]
        figs_extra = [_curves_figure(curves, out_dir / "curves.png")]
        ids = [m.id for m in [*members, *dropped]]
        res = finish_population(
            NAME, out_dir, records, gap_name="test error", rho=RHO, settings=settings,
            second_gap=("test loss (cross-entropy)", "test_loss"),
            extra={"dropped": dropped_recs, "n_dropped": len(dropped_recs),
                   "at_minimum": at_minimum(records + dropped_recs, {
                       m.id: m.meta["train_acc"] for m in [*members, *dropped]}),
                   "train_time_s_total": sum(store.load_meta(i)["train_time_s"] for i in ids)},
            n_boot=200 if quick else 2000)
        res["figures"] = res["figures"] + [p.name for p in figs_extra]
        store.write_json("results.json", res)
        return res


EXPERIMENT = GrokkingExperiment()


def run(out: str | os.PathLike, *, quick: bool = False, progress: bool = True) -> dict:
    """Train (or load) the population, measure it, write ``out/grokking/results.json``.

    Parameters
    ----------
    out : path
        Output folder; results go to ``out/grokking/``.
    quick : bool
        Smoke version: 3 members, 20 training steps, 3 sharpness iterations on the first
        128 training pairs.
    progress : bool
        tqdm bars on stderr.

    Returns
    -------
    dict
        The ``results.json`` content (schema in `quotient_manifolds.experiments.report`).
    """
    return EXPERIMENT.run(out, quick=quick, progress=progress)
