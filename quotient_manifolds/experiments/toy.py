r"""The scalar toy of Fig. 1 (App. D: Eq. 18 and the closed forms of Eqs. 19–22).

Model ``x ↦ θ₂θ₁x`` (written ``G H x``, App. D) on one data point ``(x, y) = (1, 1)`` with
the square loss ``L = (GHx − y)²``.  The symmetry ``(G, H) ↦ (G/α, αH)`` moves a point
along its orbit, the hyperbola ``GH = c``; since ``L`` depends on ``GH`` only, the loss
level sets *are* orbits.

Measured along the orbit ``GH = c = 0.5`` (``(G, H) = (√c/α, α√c)``,
$α \in [10^{-1.5}, 10^{1.5}]$):

* the Euclidean gradient norm ``2|r x|√(G² + H²)`` (``r = GHx − y``): not invariant;
* the Riemannian gradient norm of the inv metric (Eq. 18), from
  [`DiagonalQuotient`][quotient_manifolds.manifolds.DiagonalQuotient] with ``d = 1``:
  ``‖grad L‖ = 2√2 |r x| |GH|``, constant on the orbit;
* worst-case sharpness at ρ = 0.1: Euclidean (``‖δ‖ ≤ ρ``, dense polar grid), adaptive
  (Eq. 1) and exact geodesic inv (Eq. 4), the last checked against the closed form of
  Eq. 19/20: $\max_{|b| \le ρ/√2} y_{0}^{2}(e^{4b} - 1) - 2yy_{0}(e^{2b} - 1)$.

There is no population, hence no τ: ``measures`` and ``baselines`` are empty and the
findings are under ``"toy"`` in ``results.json``.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import numpy as np
import torch

from .._deps import pyplot
from ..manifolds import DiagonalQuotient
from ..sharpness.diagonal import DiagonalGeometry, diagonal_sharpness
from .report import summarize
from .store import PopulationStore

__all__ = ["SETTINGS", "euclidean_sharpness", "gradient_norms", "run"]

NAME = "toy"
REQUIRES = ("matplotlib",)
"""Optional packages this experiment needs (checked before it runs)."""
SETTINGS: dict[str, Any] = {
    "x": 1.0, "y": 1.0, "orbit_c": 0.5, "alpha_range": [10 ** -1.5, 10 ** 1.5],
    "n_alpha": 61, "rho": 0.1, "loss": "(G H x - y)^2",
}
QUICK: dict[str, Any] = {"n_alpha": 9}


def _loss(G, H, x, y):
    return (G * H * x - y) ** 2


def gradient_norms(G: torch.Tensor, H: torch.Tensor, x: float, y: float) -> dict:
    """Euclidean and inv-Riemannian gradient norms at the points ``(G_k, H_k)``."""
    M = DiagonalQuotient("inv", "exact")
    p = M.pack_point(G[:, None], H[:, None]).requires_grad_(True)
    L = _loss(p[..., 0, 0], p[..., 1, 0], x, y).sum()
    (eg,) = torch.autograd.grad(L, p)
    p = p.detach()
    rg = M.egrad2rgrad(p, eg)
    return {"euclidean": eg.flatten(1).norm(dim=1), "riemannian": M.norm(p, rg)}


def euclidean_sharpness(G: torch.Tensor, H: torch.Tensor, x: float, y: float, rho: float,
                        n_angle: int = 2048, n_radius: int = 64) -> torch.Tensor:
    r"""$\max_{\|δ\| \le ρ} L(θ + δ) - L(θ)$ by a dense polar grid (2-D, so exact to the grid)."""
    ang = torch.linspace(0, 2 * math.pi, n_angle, dtype=torch.float64)
    rad = torch.linspace(0, rho, n_radius, dtype=torch.float64)
    dG = (rad[:, None] * torch.cos(ang)[None]).reshape(-1)
    dH = (rad[:, None] * torch.sin(ang)[None]).reshape(-1)
    L0 = _loss(G, H, x, y)
    L1 = _loss(G[:, None] + dG, H[:, None] + dH, x, y)
    return (L1 - L0[:, None]).max(dim=1).values


def closed_form_geodesic(G, H, x, y, rho):
    """Eq. 19/20 with the √2 of ``‖ξ‖_inv = √2|b|`` kept: ``|b| ≤ ρ/√2``."""
    y0 = G * H * x
    bmax = rho / math.sqrt(2)
    vals = [y0 ** 2 * (math.exp(4 * b) - 1) - 2 * y * y0 * (math.exp(2 * b) - 1)
            for b in (bmax, -bmax)]
    return torch.maximum(*vals)


def _figure(res: dict, G0: float, H0: float, c: float, x: float, y: float, path) -> None:
    plt = pyplot("the figures of the toy experiment")

    t = res["toy"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ax = axes[0]
    g = np.linspace(-2.5, 2.5, 401)
    GG, HH = np.meshgrid(g, g)
    L = (GG * HH * x - y) ** 2
    cs = ax.contourf(GG, HH, np.log10(L + 1e-3), levels=20, cmap="viridis")
    fig.colorbar(cs, ax=ax, label="log10(loss + 1e-3)")
    for cc in (-1.0, 0.25, c, 1.0, 2.0):
        for sgn in (1, -1):
            gg = np.linspace(0.05, 2.5, 200) * sgn
            ax.plot(gg, cc / gg, color="w" if cc != c else "r", lw=0.8 if cc != c else 1.6,
                    ls="--" if cc != c else "-")
    ax.plot([G0], [H0], "ro")
    ax.set_xlim(-2.5, 2.5)
    ax.set_ylim(-2.5, 2.5)
    ax.set_xlabel("θ₁ = G")
    ax.set_ylabel("θ₂ = H")
    ax.set_title("loss level sets = orbits GH = c (red: c = 0.5)")
    a = np.asarray(t["alpha"])
    ax = axes[1]
    ax.loglog(a, t["euclidean_grad_norm"], label="Euclidean ‖∇L‖")
    ax.loglog(a, t["riemannian_grad_norm"], label="Riemannian ‖grad L‖ (inv)")
    ax.set_xlabel("α (point (√c/α, α√c) on the orbit)")
    ax.set_title("gradient norm along the orbit")
    ax.legend(fontsize=8)
    ax = axes[2]
    for k, lab in (("euclidean", "Euclidean"), ("adaptive", "adaptive"),
                   ("geodesic_inv", "geodesic inv (exact)")):
        ax.loglog(a, t["sharpness"][k], label=lab)
    ax.set_xlabel("α")
    ax.set_title(f"worst-case sharpness along the orbit, ρ = {t['rho']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out: str | os.PathLike, *, quick: bool = False, progress: bool = True) -> dict:
    """Measure the toy along one orbit; write ``out/toy/`` results.json, toy.png, landscape.png."""
    from tqdm.auto import tqdm

    from ..sharpness.landscape import plot_slices, slice_1d, slice_2d

    t0 = time.perf_counter()
    s = {**SETTINGS, **(QUICK if quick else {})}
    store = PopulationStore(out, NAME)
    x, y, c, rho = s["x"], s["y"], s["orbit_c"], s["rho"]
    lo, hi = s["alpha_range"]
    alpha = torch.logspace(math.log10(lo), math.log10(hi), s["n_alpha"], dtype=torch.float64)
    G, H = math.sqrt(c) / alpha, alpha * math.sqrt(c)
    steps = tqdm(total=4, desc="toy", disable=not progress, leave=False)
    gn = gradient_norms(G, H, x, y)
    steps.update()
    X1, y1 = torch.tensor([[x]], dtype=torch.float64), torch.tensor([y], dtype=torch.float64)
    sharp = {
        "euclidean": euclidean_sharpness(G, H, x, y, rho),
        "adaptive": diagonal_sharpness(G[:, None], H[:, None], X1, y1, rho=rho,
                                       measure="adaptive", reduction="sum"),
        "geodesic_inv": diagonal_sharpness(G[:, None], H[:, None], X1, y1, rho=rho,
                                           geometry=DiagonalGeometry(metric="inv"),
                                           reduction="sum"),
    }
    steps.update()
    closed = closed_form_geodesic(G, H, x, y, rho)
    steps.update()

    def rel_var(v):
        v = torch.as_tensor(v)
        return float((v.max() - v.min()) / v.abs().mean())

    eu, ri = gn["euclidean"], gn["riemannian"]
    r0 = c * x - y
    toy = {
        "alpha": alpha.tolist(), "rho": rho,
        "euclidean_grad_norm": eu.tolist(), "riemannian_grad_norm": ri.tolist(),
        "riemannian_grad_norm_expected": 2 * math.sqrt(2) * abs(r0 * x) * abs(c),
        "riemannian_max_rel_variation": rel_var(ri),
        "euclidean_range": [float(eu.min()), float(eu.max())],
        "euclidean_max_over_min": float(eu.max() / eu.min()),
        "sharpness": {k: v.tolist() for k, v in sharp.items()},
        "sharpness_max_rel_variation": {k: rel_var(v) for k, v in sharp.items()},
        "geodesic_closed_form": closed.tolist(),
        "geodesic_vs_closed_form_max_rel_err": float(
            ((sharp["geodesic_inv"] - closed).abs() / closed.abs()).max()),
    }
    # landscape: horizontal direction vs vertical (orbit) direction at the middle point
    M = DiagonalQuotient("inv", "exact")
    k = len(alpha) // 2
    p0 = M.pack_point(G[k:k + 1], H[k:k + 1])
    hor = M.pack_point(G[k:k + 1], H[k:k + 1])  # b = 1: (G, H) is horizontal
    ver = M.vertical(p0, torch.ones(1, dtype=torch.float64))

    def loss(p):
        return _loss(p[..., 0, 0], p[..., 1, 0], x, y)

    ts = torch.linspace(-1.0, 1.0, 81 if not quick else 11, dtype=torch.float64)
    one = slice_1d(M, p0, 0.5 * hor, loss, ts)
    two = slice_2d(M, p0, 0.5 * hor, 0.5 * ver, loss,
                   torch.linspace(-1.0, 1.0, 41 if not quick else 9, dtype=torch.float64))
    plot_slices(one, two, store.dir / "landscape.png",
                title="scalar toy: ξ₁ horizontal, ξ₂ vertical (along the orbit)")
    steps.update()
    steps.close()
    res = summarize(NAME, [], gap_name="n/a (no population)", primary_rho={},
                    settings={**s, "quick": quick}, n_boot=0, extra={"toy": toy})
    _figure(res, float(G[k]), float(H[k]), c, x, y, store.dir / "toy.png")
    res["timing_s"] = {"total": time.perf_counter() - t0}
    store.write_json("results.json", res)
    return res
