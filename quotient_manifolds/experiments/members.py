r"""Seeded building blocks of the trained populations, one definition for all of them.

A population's member is fixed by its hyperparameters and its seed: the hyperparameter draw
of the sampler, the label noise, the member's training subset and the initial head all come
from seeded generators defined here, so that two populations that use the same rule draw the
same values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "adamw_matrix_decay",
    "classification_eval",
    "member_subset",
    "noisy_labels",
    "redraw_linear",
    "sample_hypers",
]


def sample_hypers(n: int, grid: Mapping[str, Sequence[Any]], *, seed: int,
                  lr_range: tuple[float, float] | None = None) -> list[dict]:
    r"""The first `n` draws of a population sampler; draw `i` has seed `i`.

    One `numpy.random.default_rng(seed)` stream: per draw, the learning rate log-uniform in
    `lr_range` (when given), then one level of every axis of `grid`, uniformly, in the
    grid's order (floats stay floats, everything else becomes an int). A draw does not
    depend on `n`.
    """
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        h: dict[str, Any] = {}
        if lr_range is not None:
            h["lr"] = float(10 ** rng.uniform(*np.log10(lr_range)))
        for k, v in grid.items():
            x = v[int(rng.integers(len(v)))]
            h[k] = float(x) if isinstance(x, float) else int(x)
        h["seed"] = i
        out.append(h)
    return out


def noisy_labels(y: torch.Tensor, frac: float, seed: int, n_classes: int) -> torch.Tensor:
    r"""Replace `round(frac·n)` labels (seeded choice) by a uniformly drawn other class.

    The generator is `torch.Generator().manual_seed(10_000 + seed)`; `y` is not modified.
    """
    g = torch.Generator().manual_seed(10_000 + int(seed))
    y = y.clone()
    k = int(round(frac * len(y)))
    idx = torch.randperm(len(y), generator=g)[:k]
    y[idx] = (y[idx] + torch.randint(1, n_classes, (k,), generator=g)) % n_classes
    return y


def member_subset(hyper: Mapping[str, Any], n_pool: int, core: int) -> torch.Tensor:
    """Pool indices of a member's training set: the shared `core` first, then its own
    seeded draw from the rest of the pool, `hyper["train_size"]` indices in all."""
    g = torch.Generator().manual_seed(20_000 + int(hyper["seed"]))
    rest = core + torch.randperm(n_pool - core, generator=g)[: int(hyper["train_size"]) - core]
    return torch.cat([torch.arange(core), rest])


@torch.no_grad()
def redraw_linear(layer: nn.Linear, seed: int) -> None:
    r"""Draw the weight, then the bias, of `layer` uniformly in $\pm 1/\sqrt{d_\text{in}}$.

    The draws come from `torch.Generator().manual_seed(seed)` in float32, so they do not
    depend on the default dtype.
    """
    g = torch.Generator().manual_seed(int(seed))
    bound = 1.0 / math.sqrt(layer.in_features)
    f32 = torch.float32
    layer.weight.copy_(torch.rand(layer.weight.shape, generator=g, dtype=f32) * 2 * bound
                       - bound)
    layer.bias.copy_(torch.rand(layer.bias.shape, generator=g, dtype=f32) * 2 * bound - bound)


def adamw_matrix_decay(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over every parameter of `model`, with weight decay on the matrices and
    embeddings (`ndim >= 2`) only, not on biases and LayerNorm gains."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr)


@torch.no_grad()
def classification_eval(logits_of: Callable[[slice], torch.Tensor], y: torch.Tensor, *,
                        batch: int, label_smoothing: float = 0.0) -> tuple[float, float]:
    """Mean cross-entropy (with `label_smoothing`) and accuracy of `logits_of(rows)`
    against `y`, in chunks of `batch` rows."""
    loss, correct = 0.0, 0
    for i in range(0, len(y), batch):
        logits = logits_of(slice(i, i + batch))
        loss += float(F.cross_entropy(logits, y[i:i + batch], reduction="sum",
                                      label_smoothing=label_smoothing))
        correct += int((logits.argmax(1) == y[i:i + batch]).sum())
    return loss / len(y), correct / len(y)
