r"""Fixed-step integration of the geodesic equation ``γ̈ = −Γ_γ(γ̇, γ̇)``.

Used for the exact retraction of GL(h) blocks, where no closed form is known (the paper
uses the second-order retraction of Eq. 5).  Classic RK4 on the first-order system ``(γ, γ̇)``:
plain tensor operations, so autograd differentiates through it, and the cost is a fixed
``4·steps`` Christoffel evaluations.  The global error is ``O((‖ξ‖/steps)⁴)``;
``docs/benchmarks.md`` records measured errors and the comparison with
``torchdiffeq``'s adaptive solvers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["rk4", "rk4_geodesic"]

Accel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Field = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def rk4(y: Sequence[torch.Tensor], f: Field, steps: int, t: float = 1.0) -> list[torch.Tensor]:
    """Classic RK4 for ``ẏ = f(y)`` on a list of tensors, ``steps`` fixed steps to time ``t``."""
    if steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps}")
    dt = t / steps
    y = list(y)
    for _ in range(steps):
        k1 = f(y)
        k2 = f([torch.add(a, k, alpha=0.5 * dt) for a, k in zip(y, k1, strict=True)])
        k3 = f([torch.add(a, k, alpha=0.5 * dt) for a, k in zip(y, k2, strict=True)])
        k4 = f([torch.add(a, k, alpha=dt) for a, k in zip(y, k3, strict=True)])
        # y + dt/6 (k1 + 2 k2 + 2 k3 + k4), with one pass per term
        y = [torch.add(a, torch.add(p, q, alpha=2).add_(r, alpha=2).add_(s), alpha=dt / 6)
             for a, p, q, r, s in zip(y, k1, k2, k3, k4, strict=True)]
    return y


def rk4_geodesic(
    x: torch.Tensor, u: torch.Tensor, accel: Accel, steps: int, t: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integrate from ``(x, u)`` to time ``t``; return ``(γ(t), γ̇(t))``.

    ``accel(x, v)`` must return ``−Γ_x(v, v)``.
    """
    if steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps}")
    dt = t / steps
    for _ in range(steps):
        k1x, k1v = u, accel(x, u)
        x2, u2 = x + 0.5 * dt * k1x, u + 0.5 * dt * k1v
        k2x, k2v = u2, accel(x2, u2)
        x3, u3 = x + 0.5 * dt * k2x, u + 0.5 * dt * k2v
        k3x, k3v = u3, accel(x3, u3)
        x4, u4 = x + dt * k3x, u + dt * k3v
        k4x, k4v = u4, accel(x4, u4)
        x = x + dt / 6 * (k1x + 2 * k2x + 2 * k3x + k4x)
        u = u + dt / 6 * (k1v + 2 * k2v + 2 * k3v + k4v)
    return x, u
