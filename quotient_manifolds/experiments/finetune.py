r"""Training to a stated convergence rule, shared by the fine-tuned populations.

The fine-tuned populations (`minilm-finetune`, `vit-finetune`) train every member until its
training loss has plateaued on its own (possibly noisy) labels, by one rule fixed in code
before any sharpness was measured:

* the member trains at least its sampled number of epochs $E$;
* from epoch $E - k$ on, the full training set is evaluated after every epoch (eval mode,
  the member's own fitted labels, the member's own training objective, i.e. cross-entropy
  with its label smoothing): loss $L_e$ and accuracy $a_e$;
* the member is **converged** at the first epoch $e \ge E$ with
  $a_e \ge$ `min_acc` and
  $$
  L_{e-k} - L_e \le \text{abs\_tol} + \text{rel\_tol}\, L_{e-k},
  $$
  i.e. the loss fell by less than a small absolute amount plus a fraction of itself over the
  last $k$ epochs (a plateau), with (almost) every training label fitted;
* training continues epoch by epoch until the rule is met, up to `max_epochs`; a member that
  never meets it is kept on disk with `converged = false` and is reported, never silently
  used.

Every member's record holds the evidence: the evaluated epochs with their $(L_e, a_e)$, the
epoch at which the rule was met, and the rule itself.

The learning rate follows a linear warm-up over the first `warmup` fraction of the scheduled
$E$ epochs, then a linear decay to `final_lr_frac` of the peak at epoch $E$, and stays there
during any extension epochs. The fine-tuned populations use `final_lr_frac = 1` (warm-up,
then constant): a decayed rate would make the plateau test pass because the steps shrink,
and would make the extension epochs of a slow member crawl.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

__all__ = ["PlateauRule", "lr_factor", "train_to_convergence"]


@dataclass(frozen=True)
class PlateauRule:
    """The convergence rule (see the module docstring).

    Attributes
    ----------
    min_acc : float
        Smallest training accuracy on the member's own labels.
    k : int
        Window of the plateau test, in epochs.
    abs_tol, rel_tol : float
        Largest allowed loss decrease over the window: `abs_tol + rel_tol * L[e-k]`.
    max_epochs : int
        Cap; a member not converged by then is reported as not converged.
    """

    min_acc: float = 0.99
    k: int = 2
    abs_tol: float = 0.002
    rel_tol: float = 0.1
    max_epochs: int = 40

    def met(self, history: list[dict], epochs: int) -> bool:
        """Whether the last entry of `history` (`{"epoch", "loss", "acc"}`) meets the rule."""
        if not history:
            return False
        last = history[-1]
        if last["epoch"] < epochs or last["acc"] < self.min_acc:
            return False
        prev = [h for h in history if h["epoch"] == last["epoch"] - self.k]
        if not prev:
            return False
        lk = prev[0]["loss"]
        return lk - last["loss"] <= self.abs_tol + self.rel_tol * lk

    def to_dict(self) -> dict:
        """The rule as a JSON-serialisable dict (part of the training protocol)."""
        return asdict(self)


def lr_factor(step: int, scheduled_steps: int, *, warmup: float = 0.1,
              final_lr_frac: float = 0.1) -> float:
    """Multiplier of the peak learning rate at optimiser step `step` (0-based)."""
    w = max(1, int(round(warmup * scheduled_steps)))
    if step < w:
        return (step + 1) / w
    if step >= scheduled_steps:
        return final_lr_frac
    frac = (step - w) / max(1, scheduled_steps - w)
    return 1.0 - (1.0 - final_lr_frac) * frac


def train_to_convergence(
    *,
    n: int,
    batch: int,
    epochs: int,
    rule: PlateauRule,
    step: Callable[[torch.Tensor, float, int], None],
    evaluate: Callable[[], tuple[float, float]],
    generator: torch.Generator,
    warmup: float = 0.1,
    final_lr_frac: float = 1.0,
    log: Callable[[str], None] | None = None,
) -> dict:
    r"""Run epochs of shuffled mini-batches until `rule` is met (or its cap).

    Parameters
    ----------
    n : int
        Training-set size; batches are index tensors into `range(n)`.
    batch : int
        Mini-batch size (the last batch of an epoch may be smaller).
    epochs : int
        The scheduled number of epochs $E$ (the rule is tested from epoch $E$ on).
    rule : PlateauRule
        The convergence rule.
    step : callable
        `step(idx, lr_factor, epoch)`: one optimiser step on the examples `idx` (`epoch`
        counts from 1; epochs after $E$ are extension epochs).
    evaluate : callable
        `evaluate() -> (loss, acc)` on the full training set (own labels, own objective).
    generator : torch.Generator
        Shuffles the epochs.
    log : callable, optional
        Receives one line per evaluated epoch.

    Returns
    -------
    dict
        `{"history": [{"epoch", "loss", "acc"}], "converged": bool, "epochs_run": int,
        "converged_epoch": int | None, "steps": int, "train_s": float}`.
    """
    if epochs < rule.k + 1:
        raise ValueError(f"epochs={epochs} must exceed the plateau window k={rule.k}")
    per_epoch = math.ceil(n / batch)
    scheduled = epochs * per_epoch
    history: list[dict] = []
    t0, done, converged = time.perf_counter(), 0, False
    e = 0
    for e in range(1, rule.max_epochs + 1):
        perm = torch.randperm(n, generator=generator)
        for i in range(0, n, batch):
            step(perm[i:i + batch], lr_factor(done, scheduled, warmup=warmup,
                                              final_lr_frac=final_lr_frac), e)
            done += 1
        if e >= epochs - rule.k:
            loss, acc = evaluate()
            history.append({"epoch": e, "loss": float(loss), "acc": float(acc)})
            if log is not None:
                log(f"epoch {e}: train loss {loss:.4f} acc {acc:.4f}")
            if rule.met(history, epochs):
                converged = True
                break
    return {"history": history, "converged": converged, "epochs_run": e,
            "converged_epoch": e if converged else None, "steps": done,
            "train_s": time.perf_counter() - t0}
