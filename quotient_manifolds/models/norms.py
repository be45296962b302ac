r"""Normalisation layers as the fold families see them: which modules are norms, their gain,
and the constant offset $o$ of a gain $\gamma = o + w$ (Gemma's norms: $o = 1$)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from .precision import run_module

__all__ = ["any_norm", "is_norm", "norm_bias", "norm_offset", "norm_weight"]

_NORM_NAME = re.compile(r"(layer|rms).?norm", re.IGNORECASE)


def is_norm(m: nn.Module) -> bool:
    """Whether `m` is a LayerNorm/RMSNorm with a gain: torch's own, or any module named like one
    whose `weight` is a 1-D parameter."""
    if isinstance(m, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
        return getattr(m, "weight", None) is not None
    w = getattr(m, "weight", None)
    return (bool(_NORM_NAME.search(type(m).__name__)) and isinstance(w, nn.Parameter)
            and w.dim() == 1)


def any_norm(modules: Iterable[nn.Module]) -> bool:
    """Whether one of `modules` is a norm (`is_norm`): a fold family of norms may be present."""
    return any(is_norm(m) for m in modules)


def norm_weight(m: nn.Module) -> torch.Tensor:
    """The gain of a module that `is_norm` accepts."""
    w = m.weight
    assert isinstance(w, torch.Tensor)
    return w


def norm_bias(m: nn.Module) -> torch.Tensor | None:
    """The shift $\\beta$ of a norm, if it is a parameter."""
    b = getattr(m, "bias", None)
    return b if isinstance(b, nn.Parameter) else None


def norm_offset(m: nn.Module, args: tuple, kwargs: dict) -> float | None:
    r"""$o$ in $\gamma = o + w$, from two calls of the norm alone at $w = 0$ and $w = 1$ with
    $\beta = 0$: the output is $(o + w)\,\hat x$, so $o = y_0 / (y_1 - y_0)$ (the median over
    the entries where $y_1 - y_0$ is not negligible; `None` if the gain is unused). `args`,
    `kwargs` are the inputs of one call of `m`.
    """
    w, b = norm_weight(m), norm_bias(m)

    def call(wv: torch.Tensor) -> object:
        d = {"weight": wv}
        if b is not None:
            d["bias"] = torch.zeros_like(b)
        return run_module(m, d, args, kwargs)

    y0 = call(torch.zeros_like(w))
    y1 = call(torch.ones_like(w))
    if not (isinstance(y0, torch.Tensor) and isinstance(y1, torch.Tensor)):
        return None
    dy = y1 - y0
    sel = dy.abs() > 1e-6 * float(dy.abs().max() or 1.0)
    if not bool(sel.any()):
        return None
    return float(round(float((y0[sel] / dy[sel]).median()), 6))
