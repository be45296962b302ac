r"""The user's loss as a function of the probed parameters: what a symmetry of the loss (not of
the outputs), such as the softmax shift, must leave unchanged."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..errors import LossEvaluationError, QuotientManifoldError
from ..tree import leading_size, tree_map
from .precision import float64_internals, no_fastpath

__all__ = ["LossOf"]

Params = Mapping[str, torch.Tensor]


class LossOf:
    """The user's loss on one batch as a function of the copy's parameters (float64): its first
    rows, as the trace of the prober, or the whole batch if dim 0 is no batch dimension.

    A failure of the user's `loss_fn` is not a failed probe: it raises
    [`LossEvaluationError`][quotient_manifolds.errors.LossEvaluationError] (the original error
    chained), which discovery passes on.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable, batch: Any, rows_kept: int = 2
                 ) -> None:
        self.module = _LossModule(model, loss_fn)
        whole = tree_map(lambda t: t.to(torch.float64) if t.is_floating_point() else t, batch)
        rows = leading_size(whole)
        base = {n: p.detach() for n, p in model.named_parameters()} | {
            n: b for n, b in model.named_buffers()}
        self.batch = whole
        if rows is not None and rows > rows_kept:  # the first rows, as the trace
            self.batch = tree_map(lambda t: t[:rows_kept] if t.dim() and t.shape[0] == rows
                                  else t, whole)
        try:
            self.reference = self._value(base)
        except Exception:  # noqa: BLE001 -- dim 0 was not the batch: the whole batch
            self.batch = whole
            self.reference = self(base)

    def __call__(self, params: Params) -> float:
        try:
            return self._value(params)
        except QuotientManifoldError:
            raise
        except Exception as e:  # noqa: BLE001 -- whatever the user's code raises is named
            raise LossEvaluationError(
                f"loss_fn(model, batch) raised on the first batch while discovery probed the "
                f"symmetries of the loss (the softmax shift): {type(e).__name__}: {e}") from e

    def _value(self, params: Params) -> float:
        d = {f"model.{n}": t for n, t in params.items()}
        with torch.no_grad(), no_fastpath(), float64_internals():
            out = torch.func.functional_call(self.module, d, (self.batch,))
        return float(out.detach().double().sum()) if isinstance(out, torch.Tensor) else math.nan

    def change(self, params: Params) -> float:
        v = self(params)
        if not (math.isfinite(v) and math.isfinite(self.reference)):
            return math.inf
        return abs(v - self.reference) / max(abs(self.reference), 1e-300)


class _LossModule(nn.Module):
    def __init__(self, model: nn.Module, loss_fn: Callable) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, batch: Any) -> Any:
        return self.loss_fn(self.model, batch)
