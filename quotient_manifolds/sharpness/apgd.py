r"""Auto-PGD for the inner maximisation (spec §8), on any feasible set.

The reference settings of Andriushchenko et al. (2023) (spec §8.3): ``N = 20``
iterations, zero initialisation, step ``η = 2ρ``, momentum ``α = 0.75`` in the
reference form ``δ_{k+1} = δ_k + α(z_{k+1} − δ_k)``, the checkpoint schedule
``W`` and step halving with a restart from the best iterate when

* Condition 1: fewer than ``0.75 (k − k_prev)`` improvements of the best loss
  since the last checkpoint, or
* Condition 2: the step size was not halved at the last checkpoint and the
  best loss did not change since then.

The best iterate is the ξ that actually produced the best loss (spec §8.2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["checkpoints", "AscentProblem", "APGDResult", "apgd"]

Tangent = list[torch.Tensor]


def checkpoints(n_iter: int) -> list[int]:
    r"""The APGD checkpoints ``W`` for ``n_iter`` iterations (spec §8.3).

    ``p₀ = 0``, ``p₁ = 0.22``, ``p_{j+1} = p_j + max(p_j − p_{j−1} − 0.03, 0.06)``,
    ``w_j = ⌈p_j N⌉``; ``w₀`` dropped; stop once ``w_j ≥ N`` (included) or on a repeat.
    ``checkpoints(20) == [5, 9, 12, 15, 16, 18, 19, 20]``.
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


class AscentProblem(Protocol):
    """What APGD needs from a feasible set and an objective."""

    def zeros(self) -> Tangent: ...

    def loss_and_grad(self, xi: Sequence[torch.Tensor]) -> tuple[float, Tangent]: ...

    def direction(self, xi: Sequence[torch.Tensor], grad: Sequence[torch.Tensor]) -> Tangent: ...

    def project(self, xi: Sequence[torch.Tensor]) -> Tangent: ...


@dataclass
class APGDResult:
    """Best loss, the perturbation that produced it, and the trace."""

    best_loss: float
    best_xi: Tangent
    losses: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)


def _axpy(a: float, x: Sequence[torch.Tensor], y: Sequence[torch.Tensor]) -> Tangent:
    return [yi + a * xi for xi, yi in zip(x, y, strict=True)]


def apgd(
    problem: AscentProblem,
    rho: float,
    base_loss: float,
    *,
    n_iter: int = 20,
    init: Sequence[torch.Tensor] | None = None,
    step_mult: float = 1.0,
    momentum: float = 0.75,
    momentum_form: str = "reference",
    on_step: Callable[[int, float], None] | None = None,
) -> APGDResult:
    r"""Maximise ``problem``'s loss over its feasible set by Auto-PGD (spec §8.1, §8.3).

    Parameters
    ----------
    problem : AscentProblem
        ``loss_and_grad(ξ)``, ``direction(ξ, g)`` (normalised ascent direction),
        ``project(ξ)`` (``P_S``) and ``zeros()``.
    rho : float
        Radius; the initial step is ``η = 2ρ · step_mult``.
    base_loss : float
        Loss at ``ξ = 0``; the best loss starts there (Alg. 1 line 5).
    n_iter : int
        Gradient evaluations.
    init : tangent list, optional
        Initial perturbation (default zero).
    momentum : float
        ``α``.
    momentum_form : {"reference", "apgd"}
        ``ξ + α(z − ξ)`` (reference code) or Croce & Hein's
        ``P_S(ξ + α(z − ξ) + (1 − α)(ξ − ξ_prev))`` (Alg. 1 line 15).
    """
    if momentum_form not in ("reference", "apgd"):
        raise ValueError(f"momentum_form must be 'reference' or 'apgd', got {momentum_form!r}")
    W = set(checkpoints(n_iter))
    zero = problem.zeros()
    xi = list(init) if init is not None else zero
    xi_prev = xi
    eta = 2.0 * rho * step_mult
    res = APGDResult(base_loss, zero)
    n_improve, k_last, eta_last, best_last = 0, 0, eta, base_loss
    for k in range(n_iter):
        loss, grad = problem.loss_and_grad(xi)
        res.losses.append(loss)
        res.steps.append(eta)
        if on_step is not None:
            on_step(k, loss)
        if loss > res.best_loss:
            res.best_loss, res.best_xi = loss, [t.detach() for t in xi]
            n_improve += 1
        z = problem.project(_axpy(eta, problem.direction(xi, grad), xi))
        if k == 0:
            new = z
        elif momentum_form == "reference":
            new = [x + momentum * (zi - x) for x, zi in zip(xi, z, strict=True)]
        else:
            new = problem.project([
                x + momentum * (zi - x) + (1 - momentum) * (x - xp)
                for x, zi, xp in zip(xi, z, xi_prev, strict=True)
            ])
        xi_prev, xi = xi, [t.detach() for t in new]
        if k in W:
            cond1 = n_improve < 0.75 * (k - k_last)
            cond2 = eta == eta_last and res.best_loss == best_last
            eta_last, best_last = eta, res.best_loss
            if cond1 or cond2:
                eta *= 0.5
                xi = xi_prev = list(res.best_xi)
            n_improve, k_last = 0, k
    return res
