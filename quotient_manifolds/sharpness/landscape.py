r"""Loss slices along geodesics versus straight lines (``qm.landscape``).

For a base point ``x``, a manifold ``M`` and tangent directions ``ξ₁, ξ₂`` (horizontal
for a quotient), compare

$$
t \mapsto L(\exp_x(tξ_{1})) \quad\text{(geodesic)}\qquad\text{and}\qquad
t \mapsto L(x + tξ_{1}) \quad\text{(straight line, same initial velocity)},
$$

and the 2-D analogues ``L(exp_x(sξ₁ + tξ₂))`` and ``L(x + sξ₁ + tξ₂)``.  Both curves
agree to first order at ``t = 0``; they differ by the Christoffel term
``−½ t² Γ_x(ξ, ξ)`` (Eq. 5), which is what separates geodesic from adaptive sharpness.
Points where the geodesic leaves the manifold
([`GeodesicDomainError`][quotient_manifolds.errors.GeodesicDomainError]) are NaN.

Layer: uses `quotient_manifolds.manifolds` only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import geoopt
import torch

from ..errors import GeodesicDomainError

__all__ = ["slice_1d", "slice_2d", "plot_slices"]

Loss = Callable[[torch.Tensor], torch.Tensor]


def _eval(loss: Loss, manifold, x: torch.Tensor, u: torch.Tensor, geodesic: bool) -> float:
    try:
        p = manifold.expmap(x, u) if geodesic else x + u
    except GeodesicDomainError:
        return math.nan
    val = loss(p)
    return float(val.reshape(()).item())


def _eval_many(loss: Loss, manifold, x: torch.Tensor, us: list[torch.Tensor],
               geodesic: bool) -> list[float]:
    """Evaluate a stack of perturbations at once if ``loss`` is batched, else one by one."""
    stack = torch.stack(us)
    try:
        p = manifold.expmap(x, stack) if geodesic else x + stack
        vals = loss(p)
        if vals.numel() == len(us):
            return [float(v) for v in vals.reshape(-1)]
    except GeodesicDomainError:
        pass
    return [_eval(loss, manifold, x, u, geodesic) for u in us]


def slice_1d(
    manifold: geoopt.Manifold, x: torch.Tensor, direction: torch.Tensor, loss: Loss,
    ts: torch.Tensor,
) -> dict:
    r"""``L(exp_x(tξ))`` and ``L(x + tξ)`` for every ``t`` in ``ts``.

    ``loss`` maps a point to a scalar; if it also maps a stack of points ``(T, ...)`` to
    ``(T,)``, all points are evaluated in one call.

    Returns ``{"t": list, "geodesic": list, "straight": list, "base": float}``.
    """
    with torch.no_grad():
        us = [float(t) * direction for t in ts]
        geo = _eval_many(loss, manifold, x, us, True)
        lin = _eval_many(loss, manifold, x, us, False)
        base = float(loss(x).reshape(()).item())
    return {"t": [float(t) for t in ts], "geodesic": geo, "straight": lin, "base": base}


def slice_2d(
    manifold: geoopt.Manifold,
    x: torch.Tensor,
    d1: torch.Tensor,
    d2: torch.Tensor,
    loss: Loss,
    grid: torch.Tensor,
) -> dict:
    r"""``L(exp_x(sξ₁ + tξ₂))`` and ``L(x + sξ₁ + tξ₂)`` on ``grid × grid``.

    Returns ``{"s": list, "geodesic": [[...]], "straight": [[...]]}`` (rows: ``t``).
    """
    k = len(grid)
    us = [float(s) * d1 + float(t) * d2 for t in grid for s in grid]
    with torch.no_grad():
        g = _eval_many(loss, manifold, x, us, True)
        li = _eval_many(loss, manifold, x, us, False)
    geo = [g[i * k:(i + 1) * k] for i in range(k)]
    lin = [li[i * k:(i + 1) * k] for i in range(k)]
    return {"s": [float(s) for s in grid], "geodesic": geo, "straight": lin}


def plot_slices(
    one: Mapping | None,
    two: Mapping | None,
    path: str | os.PathLike,
    *,
    title: str = "",
) -> Path:
    """Plot a 1-D slice (curves) and/or a 2-D slice (two contour panels) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = (1 if one else 0) + (2 if two else 0)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.5), squeeze=False)
    panel_axes = list(axes[0])
    if one:
        ax = panel_axes.pop(0)
        ax.plot(one["t"], one["geodesic"], label="geodesic  L(exp(tξ))")
        ax.plot(one["t"], one["straight"], "--", label="straight  L(w + tξ)")
        ax.set_xlabel("t")
        ax.set_ylabel("loss")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.set_title("1-D slice")
    if two:
        s = np.asarray(two["s"])
        vals = [np.asarray(two[k], dtype=float) for k in ("geodesic", "straight")]
        finite = np.concatenate([v[np.isfinite(v)] for v in vals])
        levels = np.geomspace(max(finite.min(), 1e-12), finite.max(), 15)
        for ax, v, name in zip(panel_axes, vals, ("geodesic", "straight line")):
            v = np.where(np.isfinite(v), np.maximum(v, levels[0]), np.nan)
            cs = ax.contourf(s, s, v, levels=levels, norm=matplotlib.colors.LogNorm())
            ax.set_title(f"2-D slice, {name}")
            ax.set_xlabel("s (ξ₁)")
            ax.set_ylabel("t (ξ₂)")
        fig.colorbar(cs, ax=panel_axes[-1])
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
