r"""Auto-PGD for the inner maximisation, on any feasible set and for a batch of problems.

The reference settings of Andriushchenko et al. (2023): $N = 20$ iterations, zero
initialisation, step $\eta = 2\rho$, momentum $\alpha = 0.75$ in the reference form
$\xi_{k+1} = \xi_k + \alpha(z_{k+1} - \xi_k)$, the checkpoint schedule $W$ and step halving with
a restart from the best iterate when

* Condition 1: fewer than $0.75 (k - k_{prev})$ improvements of the best loss since the last
  checkpoint, or
* Condition 2: the step size was not halved at the last checkpoint and the best loss did not
  change since then.

The best iterate is the ξ that actually produced the best loss (the paper's Alg. 1 pairs it with
the next one). Every scalar of the state (step size, best loss, improvement counter) has one
entry per problem: a `(B,)` batch of independent problems (a population of diagonal networks)
runs in one loop with one objective call per iteration, and a single model is `problems = ()`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .._args import check_int, check_real
from ..models.config import check_choice
from .feasible import FeasibleSet

__all__ = ["MOMENTUM_FORMS", "checkpoints", "APGDResult", "apgd", "Objective", "Layout",
           "select_rows"]

MOMENTUM_FORMS = ("reference", "apgd")
"""The momentum forms of `apgd`: the reference code's and Croce & Hein's."""

Objective = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""`objective(xi) -> (loss, grad)`: the loss `(*problems)` at the perturbation `xi`
`(*problems, D)` and its gradient with respect to `xi`."""


class Layout(Protocol):
    """The packing of ξ of an objective, when it may change between calls (e.g. to the entries
    whose gradient has ever been non-zero).

    After a call that changed it, `version` differs, the returned gradient is in the new
    packing, `feasible` is the set in the new packing and `convert` maps a vector of the
    packing of the previous call to the new one. The entries a new packing drops must be 0 in
    every iterate (the layout's promise; [`apgd`][quotient_manifolds.sharpness.apgd.apgd]
    does not check it).
    """

    version: int
    feasible: FeasibleSet

    def convert(self, v: torch.Tensor) -> torch.Tensor: ...


def checkpoints(n_iter: int) -> list[int]:
    r"""The APGD checkpoints $W$ for `n_iter` iterations.

    $p_0 = 0$, $p_1 = 0.22$, $p_{j+1} = p_j + \max(p_j - p_{j-1} - 0.03, 0.06)$,
    $w_j = \lceil p_j N\rceil$; $w_0$ dropped; stop once $w_j \ge N$ (included) or on a repeat.
    `checkpoints(20) == [5, 9, 12, 15, 16, 18, 19, 20]`.
    """
    p = [0.0, 0.22]
    out: list[int] = []
    while True:
        w = math.ceil(p[-1] * n_iter)
        if out and w == out[-1]:
            break
        out.append(w)
        if w >= n_iter:
            break
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
    return out


@dataclass
class APGDResult:
    """Best loss and the perturbation that produced it (per problem), and the trace."""

    best_loss: torch.Tensor
    best_xi: torch.Tensor
    losses: list[torch.Tensor] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)


class _Buffers:
    """The iterate buffers of one call, reused from step to step: a fresh 10⁷-entry tensor
    costs more in page faults (on CPU) than the arithmetic written into it.

    Only tensors that `apgd` allocated itself are ever written to (never `init` or the
    objective's gradient)."""

    def __init__(self, *owned: torch.Tensor) -> None:
        self.owned = list(owned)

    def owns(self, t: torch.Tensor) -> bool:
        return any(b is t for b in self.owned)

    def take(self, like: torch.Tensor, busy: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """An owned buffer shaped like `like` that shares no memory with the tensors in `busy`
        (a new one if every owned buffer is busy)."""
        ptrs = {t.data_ptr() for t in busy}
        for b in self.owned:
            if b.data_ptr() not in ptrs and b.shape == like.shape and b.dtype == like.dtype:
                return b
        b = torch.empty_like(like)
        self.owned.append(b)
        return b


def select_rows(cond: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a` where `cond` (one flag per problem), else `b`; no copy for a single problem."""
    if cond.dim() == 0:
        return a if bool(cond) else b
    return torch.where(cond.unsqueeze(-1), a, b)


def _convert(layout: Layout, vs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The vectors `vs` in the layout's new packing; aliases stay aliases. (A function of its
    own: a loop variable of `apgd` would keep the last old vector alive for the whole call.)"""
    conv: dict[int, torch.Tensor] = {}
    for v in vs:
        if id(v) not in conv:
            conv[id(v)] = layout.convert(v)
    return [conv[id(v)] for v in vs]


def apgd(
    objective: Objective,
    feasible: FeasibleSet,
    base_loss: torch.Tensor | float,
    *,
    n_iter: int = 20,
    init: torch.Tensor | None = None,
    step_mult: float = 1.0,
    momentum: float = 0.75,
    momentum_form: str = "reference",
    on_step: Callable[[int, torch.Tensor], None] | None = None,
    layout: Layout | None = None,
) -> APGDResult:
    r"""Maximise `objective` over `feasible` by Auto-PGD.

    Parameters
    ----------
    objective : callable
        `objective(xi) -> (loss, grad)`, shapes `(*problems)` and `(*problems, D)`. The
        gradient is not used after the step it was computed for, so the objective may return
        the same buffer every time.
    feasible : FeasibleSet
        The set: `direction(ξ, g)` (normalised ascent direction), `step(ξ, d, η)`
        ($P_S(\xi + \eta d)$), `project` and `zeros()`; its radius $\rho$ sets the step.
    base_loss : Tensor or float
        Loss at $\xi = 0$, per problem; the best loss starts there (Alg. 1 line 5).
    n_iter : int
        Gradient evaluations, an integer ≥ 1.
    init : Tensor, optional
        Initial perturbation (default zero), projected onto the set.
    step_mult : float
        The initial step is $\eta = 2\rho \cdot$ `step_mult`, a finite number > 0.
    momentum : float
        $\alpha$, a finite number in $[0, 1]$.
    momentum_form : {"reference", "apgd"}
        $\xi + \alpha(z - \xi)$ (reference code) or Croce & Hein's
        $P_S(\xi + \alpha(z - \xi) + (1 - \alpha)(\xi - \xi_{prev}))$ (Alg. 1 line 15).
    on_step : callable, optional
        Called with `(k, loss)` after each objective evaluation.
    layout : Layout, optional
        The objective's packing of ξ, when it may change between calls (usually the objective
        itself): after a call that changed it, the iterates are converted to the new packing
        and the set is `layout.feasible`. The result's `best_xi` is in the last packing.
    """
    check_choice("momentum_form", momentum_form, MOMENTUM_FORMS)
    n_iter = check_int("n_iter", n_iter, example=20)
    momentum = check_real("momentum", momentum, minimum=0.0, maximum=1.0, example=0.75)
    step_mult = check_real("step_mult", step_mult, minimum=0.0, open_min=True, example=1.0)
    W = set(checkpoints(n_iter))
    zero = feasible.zeros()
    problems = feasible.problems
    xi = zero if init is None else feasible.project(init.to(zero.dtype))
    bufs = _Buffers(zero)
    xi_prev = xi
    dev = zero.device
    best = torch.as_tensor(base_loss, dtype=torch.float64, device=dev).expand(problems).clone()
    eta = torch.full(problems, 2.0 * feasible.rho * step_mult, dtype=torch.float64, device=dev)
    res = APGDResult(best, zero)
    del zero  # held by the iterates only: a new packing (layout) frees it
    n_improve = torch.zeros(problems, dtype=torch.float64, device=dev)
    k_last, eta_last, best_last = 0, eta.clone(), best.clone()
    version = None if layout is None else layout.version
    for k in range(n_iter):
        loss, grad = objective(xi)
        if layout is not None and layout.version != version:  # a new packing of ξ
            version, feasible = layout.version, layout.feasible
            xi, xi_prev, res.best_xi = _convert(layout, (xi, xi_prev, res.best_xi))
            bufs = _Buffers(*{id(t): t for t in (xi, xi_prev, res.best_xi)}.values())
        loss = loss.detach().to(torch.float64).to(dev)
        res.losses.append(loss)
        res.steps.append(eta)
        if on_step is not None:
            on_step(k, loss)
        better = loss > res.best_loss
        res.best_loss = torch.where(better, loss, res.best_loss)
        res.best_xi = select_rows(better, xi, res.best_xi)
        n_improve = n_improve + better.to(torch.float64)
        # the gradient is not needed after this: direction and step may reuse its memory
        d = feasible.direction(xi, grad, inplace=True)
        z = feasible.step(xi, d, eta.to(xi.dtype), inplace=True)
        if k == 0:  # z may live in the gradient's memory
            new = bufs.take(z, (xi, res.best_xi, z)).copy_(z)
        elif momentum_form == "reference":
            # ξ + α(z − ξ), over ξ itself when ξ is our buffer and not the best iterate (ξ is
            # not needed after this step), else into another buffer of ours
            free = bufs.owns(xi) and xi.data_ptr() != res.best_xi.data_ptr()
            out = xi if free else bufs.take(z, (xi, res.best_xi, z))
            new = torch.lerp(xi, z, momentum, out=out)
        else:
            new = feasible.project(torch.lerp(xi, z, momentum) + (1 - momentum) * (xi - xi_prev))
        xi_prev, xi = xi, new.detach()
        if k in W:
            cond1 = n_improve < 0.75 * (k - k_last)
            cond2 = (eta == eta_last) & (res.best_loss == best_last)
            eta_last, best_last = eta, res.best_loss
            fire = cond1 | cond2
            eta = torch.where(fire, 0.5 * eta, eta)
            xi = select_rows(fire, res.best_xi, xi)
            xi_prev = select_rows(fire, res.best_xi, xi_prev)
            n_improve = torch.zeros_like(n_improve)
            k_last = k
    return res
