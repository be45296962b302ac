r"""Canonical representatives of the symmetries that are not GL(h) blocks.

Norm gains in pre-norm blocks and bias translations under the softmax are removed by evaluating
every measure at a canonical point of the orbit, computed from the parameters without touching
the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Fold", "find_folds"]


@dataclass(frozen=True)
class Fold:
    """One canonicalisation step (a norm gain folded into its consumers, a bias translation)."""

    kind: str
    params: tuple[str, ...]

    def apply(self, params: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
        """Return `(new params, frozen masks)`; the input is never modified."""
        raise NotImplementedError


def find_folds(model: nn.Module, blocks: Sequence, **kwargs) -> tuple[list[Fold], list]:
    """The folds of `model` and the fallbacks found while looking for them (none yet)."""
    return [], []
