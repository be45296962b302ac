r"""Population B: tiny vision transformers on the sklearn digits.

The data is ``sklearn.datasets.load_digits()`` (1797
images of 8×8 pixels, shipped inside scikit-learn), scaled to [0, 1]. A fixed permutation
(seed 0) splits it into a training pool of 1000 images and a test set of the other 797,
shared by every member; a member trains on the first ``train_size`` images of the pool.

**Model** (18.2k weights): 2×2 patches → 16 tokens + a CLS token, ``d = 32``, learned
position embeddings, 2 pre-LayerNorm blocks with 4 heads of ``d_h = 8`` and a GELU MLP of
width ``2d``, final LayerNorm and a linear head on the CLS token. The attention uses separate
``q_proj``/``k_proj``/``v_proj``/``o_proj`` projections (with biases), so that
`discover_blocks` finds 4 Q/K and 4 V/O GL(8) blocks per layer (the
bias rows of q/k/v are appended to the factors, App. A; the pre-attention LayerNorm acts
on the input and does not break the symmetry).

**Population** (30 members, drawn by `sample_population` with a fixed seed): AdamW
learning rate log-uniform in [3e-4, 3e-3], weight decay ∈ {0, 0.05, 0.3}, epochs ∈ {20, 40,
80}, label smoothing ∈ {0, 0.1}, augmentation by random shifts of up to one pixel (on or
off), label noise ∈ {0, 0.1, 0.2} (a fraction of the training labels replaced by a different
random class, fixed per member), train size ∈ {300, 600, 1000} and the seed. Batch 64, float32.

**Gap** = test error − train error, the train error measured (without augmentation) on the
noisy labels the member was fitted to. **Sharpness** is measured on the same 256 training
images for every member (the first 256 of the pool, which every train set contains), as two
batches of 128, with each member's own fitted labels and the plain cross-entropy (no label
smoothing), in float64, with the suite of `sharpness_suite`
at the radii `RHO` (fixed before any τ was computed).
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .._deps import require
from . import members
from .modules import Attention, seeded
from .sharpness_suite import (
    SUITE,
    SuiteSettings,
    finish_population,
    float32_default,
    measure_population,
)
from .template import PopulationExperiment, at_minimum

__all__ = [
    "NAME",
    "RHO",
    "RHO_GRID",
    "Attention",
    "EXPERIMENT",
    "TinyViT",
    "digits_split",
    "noisy_labels",
    "sample_population",
    "sharpness_batches",
    "train_member",
    "run",
]

NAME = "vit-digits"
REQUIRES = ("safetensors", "matplotlib", "sklearn")
"""Optional packages this experiment needs (checked before it runs)."""
#: radii of the three norms (fixed before any τ was computed; see docs/results/vit-digits.md)
RHO = {"adaptive": 0.2, "inv": 0.05, "mix": 0.02}
#: multipliers of ρ for the three main measures (robustness of τ to ρ; headline at 1)
RHO_GRID = (1.0,)
N_ITER = 20
N_MEMBERS = 30
SAMPLER_SEED = 20250510
SPLIT_SEED = 0
N_POOL = 1000
N_SHARP, SHARP_BATCH = 256, 128
BATCH = 64
QUICK_BATCH = 64


class _Block(nn.Module):
    def __init__(self, d: int, num_heads: int, mlp_mult: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, num_heads)
        self.mlp = nn.Sequential(nn.Linear(d, mlp_mult * d), nn.GELU(),
                                 nn.Linear(mlp_mult * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyViT(nn.Module):
    """Pre-LN ViT for 8×8 images: 2×2 patches, CLS token, ``depth`` blocks."""

    def __init__(self, d: int = 32, depth: int = 2, num_heads: int = 4, mlp_mult: int = 2,
                 patch: int = 2, n_classes: int = 10) -> None:
        super().__init__()
        self.patch = patch
        n_tok = (8 // patch) ** 2
        self.patch_embed = nn.Linear(patch * patch, d)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, n_tok + 1, d) * 0.02)
        self.blocks = nn.ModuleList(_Block(d, num_heads, mlp_mult) for _ in range(depth))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, n_classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        b, q = img.shape[0], self.patch
        x = img.reshape(b, 8 // q, q, 8 // q, q).permute(0, 1, 3, 2, 4).reshape(b, -1, q * q)
        x = torch.cat([self.cls.expand(b, -1, -1), self.patch_embed(x)], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x[:, 0]))


def digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_pool, y_pool, x_test, y_test)``: 1000 / 797 images of shape 8×8 in [0, 1]."""
    load_digits = require("sklearn.datasets", "the digits data of the vit-digits experiment"
                          ).load_digits

    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.from_numpy(np.random.default_rng(SPLIT_SEED).permutation(len(y)))
    return x[perm[:N_POOL]], y[perm[:N_POOL]], x[perm[N_POOL:]], y[perm[N_POOL:]]


def sample_population(n: int = N_MEMBERS, seed: int = SAMPLER_SEED) -> list[dict]:
    """The fixed hyperparameter draws (member ``i`` has seed ``i``)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        out.append({
            "lr": float(10 ** rng.uniform(math.log10(3e-4), math.log10(3e-3))),
            "weight_decay": float(rng.choice([0.0, 0.05, 0.3])),
            "epochs": int(rng.choice([20, 40, 80])),
            "label_smoothing": float(rng.choice([0.0, 0.1])),
            "augment": int(rng.integers(0, 2)),
            "label_noise": float(rng.choice([0.0, 0.1, 0.2])),
            "train_size": int(rng.choice([300, 600, 1000])),
            "seed": i,
        })
    return out


def noisy_labels(y: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    """Replace a fraction ``frac`` of the labels by a different class chosen at random
    ([`members.noisy_labels`][quotient_manifolds.experiments.members.noisy_labels], 10
    classes)."""
    return members.noisy_labels(y, frac, seed, 10)


def _shift(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Shift every image by (dy, dx) ∈ {−1, 0, 1}² with zero padding."""
    pad = F.pad(x, (1, 1, 1, 1))
    s = torch.randint(0, 3, (x.shape[0], 2), generator=g)
    rows = (s[:, 0, None] + torch.arange(8))[:, :, None]
    cols = (s[:, 1, None] + torch.arange(8))[:, None, :]
    return pad[torch.arange(x.shape[0])[:, None, None], rows, cols]


@torch.no_grad()
def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    logits = model(x)
    return float(F.cross_entropy(logits, y)), float((logits.argmax(-1) == y).float().mean())


def train_member(hyper: dict, *, steps: int | None = None) -> tuple[TinyViT, dict]:
    """Train one member (AdamW, batch 64); ``steps`` caps the number of steps (quick mode)."""
    xp, yp, xt, yt = digits_split()
    n = hyper["train_size"]
    x, y = xp[:n], noisy_labels(yp[:n], hyper["label_noise"], hyper["seed"])
    with float32_default(), seeded(hyper["seed"]):
        model = TinyViT()
    opt = torch.optim.AdamW(model.parameters(), lr=hyper["lr"],
                            weight_decay=hyper["weight_decay"])
    g = torch.Generator().manual_seed(hyper["seed"])
    t0, done = time.perf_counter(), 0
    model.train()
    for _ in range(hyper["epochs"]):
        perm = torch.randperm(n, generator=g)
        for i in range(0, n, BATCH):
            idx = perm[i:i + BATCH]
            xb = _shift(x[idx], g) if hyper["augment"] else x[idx]
            loss = F.cross_entropy(model(xb), y[idx], label_smoothing=hyper["label_smoothing"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            if steps is not None and done >= steps:
                break
        if steps is not None and done >= steps:
            break
    model.eval()
    train_loss, train_acc = _evaluate(model, x, y)
    clean_loss, clean_acc = _evaluate(model, x, yp[:n])
    test_loss, test_acc = _evaluate(model, xt, yt)
    meta = {"hyper": hyper, "train_loss": train_loss, "train_acc": train_acc,
            "train_acc_clean_labels": clean_acc, "test_loss": test_loss, "test_acc": test_acc,
            "gap": (1 - test_acc) - (1 - train_acc), "loss_gap": test_loss - train_loss,
            "steps_run": done, "train_time_s": time.perf_counter() - t0,
            "n_params": sum(p.numel() for p in model.parameters())}
    return model, meta


def _loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def sharpness_batches(
    hyper: dict, *, quick: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed measurement batches: pool images 0–255 with the member's fitted labels.

    ``quick``: only images 0–63, one batch (smoke test).
    """
    xp, yp, _, _ = digits_split()
    y = noisy_labels(yp[:hyper["train_size"]], hyper["label_noise"], hyper["seed"])[:N_SHARP]
    if quick:
        return [(xp[:QUICK_BATCH], y[:QUICK_BATCH])]
    return [(xp[i:i + SHARP_BATCH], y[i:i + SHARP_BATCH]) for i in range(0, N_SHARP, SHARP_BATCH)]


class VitDigitsExperiment(PopulationExperiment):
    """The tiny-ViT digits population on the template of
    [`PopulationExperiment`][quotient_manifolds.experiments.template.PopulationExperiment]."""

    name = NAME

    def hypers(self, quick):
        return sample_population(3 if quick else N_MEMBERS)

    def training(self, quick):
        return {"optimizer": "AdamW", "batch": BATCH, "d": 32, "depth": 2, "heads": 4,
                "mlp": "2d GELU", "patch": 2, "dtype": "float32", "split_seed": SPLIT_SEED,
                "n_pool": N_POOL, "steps_cap": 15 if quick else None}

    def train(self, ctx, hyper, quick):
        model, meta = train_member(hyper, steps=self.training(quick)["steps_cap"])
        return model.state_dict(), meta

    def measure_protocol(self, quick):
        grid = (1.0,) if quick else RHO_GRID
        return {"rho": RHO, "rho_grid": list(grid), "average_rho": "rho/sqrt(D)",
                "n_iter": 3 if quick else N_ITER, "dtype": "float64", "seed": 0,
                "batches": f"pool images 0..{QUICK_BATCH - 1}, 1 batch" if quick else
                f"pool images 0..{N_SHARP - 1}, {SHARP_BATCH} per batch, "
                "member's fitted labels, plain cross-entropy",
                "measures": {k: m.spec() for k, m in SUITE.items()}}

    def measure(self, ctx, store, members, mhash, quick, progress):
        prot = self.measure_protocol(quick)
        settings = SuiteSettings(rho=RHO, n_iter=prot["n_iter"], grid=tuple(prot["rho_grid"]))
        measure_population(NAME, store, members, mhash, settings=settings,
                           build=lambda m: TinyViT().eval(),
                           batches=lambda m: sharpness_batches(m.hyper, quick=quick),
                           loss_fn=_loss, progress=progress)

    def finish(self, ctx, store, members, dropped, *, mhash, quick, t_start):
        records = []
        for m in members:
            meta = m.meta
            records.append({
                "id": m.id, "hyper": {k: v for k, v in m.hyper.items() if k != "seed"},
                "seed": m.hyper["seed"], "gap": meta["gap"], "loss_gap": meta["loss_gap"],
                **{k: meta[k] for k in ("train_loss", "train_acc", "train_acc_clean_labels",
                                        "test_loss", "test_acc")},
                "measures": m.measures})
        settings = {"population": {"n_members": len(members), "sampler_seed": SAMPLER_SEED,
                                   "lr": "log-uniform [3e-4, 3e-3]",
                                   "weight_decay": [0.0, 0.05, 0.3], "epochs": [20, 40, 80],
                                   "label_smoothing": [0.0, 0.1], "augment": "shift <= 1 px",
                                   "label_noise": [0.0, 0.1, 0.2],
                                   "train_size": [300, 600, 1000]},
                    "training": self.training(quick),
                    "measure_protocol": self.measure_protocol(quick),
                    "measure_protocol_hash": mhash, "quick": quick}
        return finish_population(
            NAME, store.dir, records, gap_name="test error - train error", rho=RHO,
            settings=settings, second_gap=("test loss - train loss", "loss_gap"),
            extra={"train_time_s_total": sum(m.meta["train_time_s"] for m in members),
                   "at_minimum": at_minimum(records, {m.id: m.meta["train_acc"]
                                                      for m in members})},
            n_boot=200 if quick else 2000)


EXPERIMENT = VitDigitsExperiment()


def run(out: str | os.PathLike, *, quick: bool = False, progress: bool = True) -> dict:
    """Train (or load) the population, measure it, write ``out/vit-digits/results.json``.

    Parameters
    ----------
    out : path
        Output folder; results go to ``out/vit-digits/``.
    quick : bool
        Smoke version: 3 members, 15 training steps, 3 sharpness iterations on one batch
        of 64 images.
    progress : bool
        tqdm bars on stderr.

    Returns
    -------
    dict
        The ``results.json`` content (schema in `quotient_manifolds.experiments.report`).
    """
    return EXPERIMENT.run(out, quick=quick, progress=progress)
