"""Generate the figures of docs/concepts.md with the library (about 15 s on one thread).

    python docs/make_figures.py            # writes docs/img/*.png

* ``orbits.png``: a one-coordinate diagonal net ``β = u v`` with loss ``(uv − 1)²``. Left: the
  orbits of the group ``(αu, v/α)`` (level sets of β), the vertical and horizontal directions at
  two points of one orbit, their Euclidean balls and their geodesic (horizontal) balls. Right:
  sharpness of the same function measured at every point of the orbit, in a Euclidean ball and
  in a geodesic ball (``quotient_manifolds.DiagonalQuotient``, exact geodesics).
* ``gl_invariance.png``: a small attention classifier reparametrised by ``A = a·G̃`` per head
  (``quotient_manifolds.reparametrize``); geodesic (inv, mix) and adaptive sharpness
  relative to ``a = 1``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import quotient_manifolds as qm  # noqa: E402

OUT = Path(__file__).resolve().parent / "img"


def loss(beta: torch.Tensor) -> torch.Tensor:
    return (beta - 1.0) ** 2


def diagonal_figure(path: Path, rho: float = 0.3) -> dict:
    M = qm.DiagonalQuotient(metric="inv", retraction="exact")
    base = M.pack_point(torch.tensor([1.6]), torch.tensor([0.5]))  # β = 0.8
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4.4))
    # orbits = level sets of β, and the loss
    g = torch.linspace(0.05, 3.0, 300, dtype=torch.float64)
    U, V = torch.meshgrid(g, g, indexing="xy")
    ax.contourf(U, V, loss(U * V), levels=20, cmap="Blues", alpha=0.5)
    for c in (0.2, 0.5, 0.8, 1.0, 1.5, 2.5):
        ax.plot(g, c / g, color="0.5", lw=0.8)
    theta = torch.linspace(0, 2 * math.pi, 200, dtype=torch.float64)
    for alpha, color in ((1.0, "C3"), (0.4, "C2")):
        x = M.act(base, torch.tensor([alpha], dtype=torch.float64))
        u, v = float(x[0, 0]), float(x[1, 0])
        vert = M.vertical(x, torch.tensor([1.0], dtype=torch.float64))
        hor = M.proju(x, torch.tensor([[1.0], [1.0]], dtype=torch.float64))
        for vec, style in ((vert, ":"), (hor, "-")):
            vec = vec / M.norm(x, vec) * 2 * rho
            ax.annotate("", xy=(u + float(vec[0, 0]), v + float(vec[1, 0])), xytext=(u, v),
                        arrowprops=dict(arrowstyle="->", color="k", ls=style, lw=1.2))
        ax.plot(u + rho * torch.cos(theta), v + rho * torch.sin(theta), color=color, lw=1,
                ls="--")
        h = hor / M.norm(x, hor)
        ts = torch.linspace(-rho, rho, 50, dtype=torch.float64)
        seg = torch.stack([M.expmap(x, t * h) for t in ts])
        ax.plot(seg[:, 0, 0], seg[:, 1, 0], color=color, lw=3, alpha=0.8)
        ax.plot([u], [v], "o", color=color, label=f"α = {alpha}: (αu, v/α)")
    ax.set_xlim(0, 3)
    ax.set_ylim(0, 3)
    ax.set_aspect("equal")
    ax.set_xlabel("u")
    ax.set_ylabel("v")
    ax.set_title("orbits uv = c, vertical (dotted) and horizontal (solid)\n"
                 "Euclidean ball (dashed), geodesic ball (thick)", fontsize=9)
    ax.legend(loc="upper right", fontsize=8)

    # sharpness along the orbit: the same function, measured at (αu, v/α)
    alphas = torch.logspace(-1, 1, 41, dtype=torch.float64)
    l0 = float(loss(M.invariant(base)).sum())
    euc, geo = [], []
    for alpha in alphas:
        x = M.act(base, alpha.reshape(1))
        u, v = x[0, 0], x[1, 0]
        euc.append(float(loss((u + rho * torch.cos(theta)) * (v + rho * torch.sin(theta))).max())
                   - l0)
        hor = M.proju(x, torch.tensor([[1.0], [1.0]], dtype=torch.float64))
        h = hor / M.norm(x, hor)
        ts = torch.linspace(-rho, rho, 201, dtype=torch.float64)
        geo.append(max(float(loss(M.invariant(M.expmap(x, t * h))).sum()) for t in ts) - l0)
    ax2.plot(alphas, euc, label="Euclidean ball ‖ξ‖₂ ≤ ρ")
    ax2.plot(alphas, geo, label="geodesic ball (inv metric)")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("position α on the orbit (same function)")
    ax2.set_ylabel(f"max loss increase, ρ = {rho}")
    ax2.set_title("worst-case sharpness along one orbit", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"euclidean_range": (min(euc), max(euc)), "geodesic_range": (min(geo), max(geo))}


class _Classifier(nn.Module):
    def __init__(self, d: int = 8, heads: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


def _ce(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def gl_figure(path: Path, rho: float = 0.1, n_iter: int = 10) -> dict:
    torch.manual_seed(0)
    model = _Classifier().double()
    data = [(torch.randn(16, 5, 8, dtype=torch.float64), torch.randint(0, 3, (16,)))]
    scales = [0.01, 0.1, 1.0, 10.0, 100.0]
    measures = {
        "geodesic (inv)": lambda m: qm.geodesic_sharpness(m, _ce, data, rho=rho, metric="inv",
                                                          n_iter=n_iter, progress=False).value,
        "geodesic (mix)": lambda m: qm.geodesic_sharpness(m, _ce, data, rho=rho, metric="mix",
                                                          n_iter=n_iter, progress=False).value,
        "adaptive (ℓ2)": lambda m: qm.adaptive_sharpness(m, _ce, data, rho=rho, n_iter=n_iter,
                                                        progress=False).value,
    }
    ref = {k: f(model) for k, f in measures.items()}
    rows = {k: [f(qm.reparametrize(model, a, seed=0)) / ref[k] for a in scales]
            for k, f in measures.items()}
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    for (k, ys), mk, ls in zip(rows.items(), "osD", ("-", "--", "-")):
        ax.plot(scales, ys, marker=mk, ls=ls, label=k, ms=8 if mk == "o" else 5)
    ax.set_xscale("log")
    ax.axhline(1.0, color="0.6", lw=0.6)
    ax.set_xlabel("a in A = a·G̃ (random GL(4) element per head)")
    ax.set_ylabel("sharpness / sharpness at the original weights")
    ax.set_title("same function, reparametrised attention", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {k: dict(zip(scales, ys)) for k, ys in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    d = diagonal_figure(args.out / "orbits.png")
    print(f"orbits.png: Euclidean sharpness along the orbit {d['euclidean_range'][0]:.3g} .. "
          f"{d['euclidean_range'][1]:.3g}; geodesic {d['geodesic_range'][0]:.6g} .. "
          f"{d['geodesic_range'][1]:.6g}")
    r = gl_figure(args.out / "gl_invariance.png")
    for k, v in r.items():
        print(f"gl_invariance.png: {k}: ratio " + ", ".join(f"a={a}: {x:.6g}" for a, x in v.items())
              + f"; max |ratio - 1| = {max(abs(x - 1) for x in v.values()):.1e}")


if __name__ == "__main__":
    main()
