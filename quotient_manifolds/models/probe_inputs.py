"""Random inputs and weights of the block probes: a module's hidden-state inputs redrawn as
Gaussians, its weights redrawn at the scale of a fresh initialisation, and an input for a module
that the traced forward pass did not reach."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .inputs import float_dtype, model_device, torch_inputs

__all__ = ["randomise_inputs", "redraw_weights", "synthesise_inputs"]

Params = Mapping[str, torch.Tensor]

_HIDDEN_NAMES = frozenset({
    "hidden_states", "hidden_state", "encoder_hidden_states", "key_value_states", "x",
    "query", "key", "value", "input", "inputs", "src", "tgt", "memory",
})

def _is_mask_like(t: torch.Tensor) -> bool:
    return bool((~torch.isfinite(t)).any()) or float(t.min()) < -1e4


def randomise_inputs(args: tuple, kwargs: dict, scale: float, gen: torch.Generator
               ) -> tuple[tuple, dict]:
    """The hidden-state inputs of a module call redrawn as Gaussians of the same RMS times
    `scale` (masks, ids and caches kept; a key/value cache is dropped)."""
    def draw(t: torch.Tensor) -> torch.Tensor:
        rms = float(t.pow(2).mean().sqrt()) if t.numel() else 1.0
        rms = rms if rms > 0 and math.isfinite(rms) else 1.0
        r = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t)
        return r * (rms * scale)

    new_args = tuple(
        draw(a) if (i < 3 and isinstance(a, torch.Tensor) and a.is_floating_point()
                    and a.dim() >= 2 and not _is_mask_like(a)) else a
        for i, a in enumerate(args))
    new_kwargs: dict[str, Any] = {}
    for k, v in kwargs.items():
        if k in _HIDDEN_NAMES and isinstance(v, torch.Tensor) and v.is_floating_point():
            new_kwargs[k] = draw(v)
        elif type(v).__name__.endswith("Cache"):
            new_kwargs[k] = None  # never update a key/value cache while probing
        else:
            new_kwargs[k] = v
    return new_args, new_kwargs


def redraw_weights(params: Params, names: Iterable[str], gen: torch.Generator) -> dict:
    out = dict(params)
    for n in names:
        t = params[n]
        sigma = 1.0 / math.sqrt(min(t.shape)) if t.dim() >= 2 else 1.0
        out[n] = (torch.randn(t.shape, generator=gen, dtype=torch.float64) * sigma).to(t)
    return out


def synthesise_inputs(module: nn.Module, d_in: int | None, gen: torch.Generator
                ) -> tuple[tuple, dict] | None:
    """A random input of a module that the traced forward did not reach."""
    dtype, device = float_dtype(module), model_device(module)
    out = torch_inputs(module, gen, device, dtype)
    if out is not None:
        return out
    d = d_in or getattr(module, "in_features", None)
    if d is None:
        return None
    return (torch.randn(2, 7, int(d), generator=gen, dtype=dtype).to(device),), {}
