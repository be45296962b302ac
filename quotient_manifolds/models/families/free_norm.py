r"""Parameter-free norms: a LayerNorm without gain or shift (OLMo's), $y = \hat x$.

Such a norm has no gain to fold, and its output is centred, $\mathbb 1^\top y = 0$: its
readers translate along $\mathbb 1$ without any bias to compensate, $W \mapsto W + u
\mathbb 1^\top$ (the reader centring with $γ = \mathbb 1$, $β = 0$), its writers along
$\mathbb 1$ as for any LayerNorm, and the stream it normalises rotates by $O(d - 1)$ on
$\mathbb 1^\perp$. [`free_norm`][quotient_manifolds.models.families.free_norm.free_norm]
recognises one (a module named like a norm with no parameter of its own); the centring and
rotation families then treat it as a LayerNorm whose gain is already folded.
"""

from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["free_norm", "width"]

_NORM_NAME = re.compile(r"(layer|rms).?norm", re.IGNORECASE)


def free_norm(m: nn.Module) -> bool:
    """Whether `m` is a norm without parameters (a LayerNorm with neither gain nor shift)."""
    if isinstance(m, nn.LayerNorm):
        return m.weight is None and m.bias is None
    return bool(_NORM_NAME.search(type(m).__name__)) and not any(
        True for _ in m.parameters(recurse=False)) and not list(m.children())


def width(out: object) -> int | None:
    """The width of a norm call's output (its last axis), or `None`."""
    return int(out.shape[-1]) if isinstance(out, torch.Tensor) and out.dim() else None
