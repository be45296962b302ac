r"""Diagonal linear networks (paper §5.1, Fig. 3; App. D, E).

Protocol, fixed here before any τ was computed:

* **Data** (the ``n=80-d=200`` configuration of the reference code, tml-epfl): ``X`` and a
  1000-point test set with rows ``N(0, I_200)`` (``numpy.random.RandomState(0)``), a 90 %
  sparse ground truth (``θ* ~ N(0, I)``, entries 20… set to 0, then ``|θ*|/‖θ*‖``: non-negative,
  unit norm), noiseless targets ``y = Xθ*``.
* **Population**: 50 members, ``α`` log-uniform in ``[0.01, 1]``,
  then with probability ½ full-batch GD with step log-uniform in ``[0.03, 2]``, else SGD
  with batch 1 and step log-uniform in ``[0.01, 0.3]``.  Initialisation ``u₀ = α·1``,
  ``v₀ = 0`` (the "const" init of the reference code).  Trained in float64 on
  ``L = ‖Xβ − y‖²/(2n)`` until ``L < 10⁻⁵`` (checked every 100 steps), at most
  ``10⁵`` steps; members that do not get there (or diverge) are dropped and counted.
* **Gap** = test loss ``‖X_test β − y_test‖²/(2·1000)`` (train loss is ≈ 0).
* **Measures** on the whole training set (one batch), same loss convention, by
  `quotient_manifolds.sharpness.diagonal.diagonal_sharpness`: worst case by
  batched Auto-PGD (`APGD(n_iter=100, restarts=3)`: 100 iterations, zero start + 3 random
  starts); average case over 100 Gaussian draws (`Average(n=100)`); the random starts and
  draws of a member come from its own generator (seeded with its training seed), so its
  values do not depend on which members are measured together (a resumed run gives the same
  numbers).  ρ grid ``{0.01, 0.03, 0.1, 0.3, 1}`` for
  every measure, headline ρ = 0.1 for every measure.

The β ≈ 0 guard.  The quotient needs ``u_i, v_i ≠ 0``.  With ``v₀ = 0``, ``v_i`` moves off
zero at the first step (its gradient ``−g_i u_i`` is non-zero almost surely) and
``u_i² − v_i²`` stays close to ``α²`` (exactly under gradient flow), so ``u_i`` never
reaches 0.  We therefore keep the reference initialisation (changing it would change
the population being reproduced) and *mask* any coordinate with ``u_i v_i = 0`` exactly
(its ``b_i`` is held at 0); the number of masked coordinates and the smallest ``|β_i|``
are recorded in ``results.json``.  Tiny-but-non-zero ``β_i`` need no guard: the inv ball
does not depend on β, and the mix geodesic ``β(1 + 2b)`` keeps the sign of ``β_i``
through the domain constraint ``b_i ≥ −½ + 10⁻⁶``.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._deps import pyplot
from ..sharpness.diagonal import DiagonalGeometry, diagonal_loss, diagonal_sharpness
from ..sharpness.solvers import APGD, Average
from .report import scatter_figure, summarize
from .store import PopulationStore, protocol_hash

__all__ = ["DATA", "MEASURES", "POPULATION", "PRIMARY_RHO", "RHO_GRID", "make_data",
           "measure_options", "sample_population", "train_population", "run"]

NAME = "diagonal"
REQUIRES = ("safetensors", "matplotlib")
"""Optional packages this experiment needs (checked before it runs)."""
DATA: dict[str, Any] = {"n": 80, "d": 200, "r": 20, "n_test": 1000, "seed": 0}
POPULATION: dict[str, Any] = {
    "n_members": 50, "seed": 1, "alpha": [0.01, 1.0], "p_sgd": 0.5,
    "lr_gd": [0.03, 2.0], "lr_sgd": [0.01, 0.3], "init": "u0=alpha, v0=0",
    "tol": 1e-5, "max_steps": 100_000, "check_every": 100, "loss": "||X beta - y||^2/(2n)",
    "dtype": "float64",
}
RHO_GRID = [0.01, 0.03, 0.1, 0.3, 1.0]
PRIMARY_RHO = 0.1
WORST: dict[str, Any] = {"kind": "worst", "n_iter": 100, "n_restarts": 3}
AVERAGE: dict[str, Any] = {"kind": "average", "n_samples": 100}
#: name -> the settings of a measure (the protocol, recorded in results.json and hashed into
#: the cache key): `measure`, the `DiagonalGeometry` attributes, and the solver's, `kind`
#: "worst" (`APGD(n_iter, restarts=n_restarts)`) or "average" (`Average(n=n_samples)`);
#: `measure_options` turns them into the arguments of diagonal_sharpness.
#: Radius conventions of mix (App. E): "metric" is ‖ξ‖_mix = √2‖β⊙b‖ ≤ ρ, App. E's mix
#: convention ‖2 D_β b‖ up to √2 in ρ; "coefficient" is ‖b‖ ≤ ρ, App. E's *inv* convention
#: applied to mix. "unconstrained": the metric ball without the domain 1 + 2b > 0 (β(1 + 2b)
#: continued past it), solved exactly as a trust-region problem.
MEASURES: dict[str, dict] = {
    "adaptive": {"measure": "adaptive", **WORST},
    "geodesic_inv": {"metric": "inv", "retraction": "exact", "ball": "metric", **WORST},
    "geodesic_mix": {"metric": "mix", "retraction": "exact", "ball": "metric", **WORST},
    "geodesic_mix_unconstrained": {"metric": "mix", "retraction": "exact", "ball": "metric",
                                   "domain": False, **WORST},
    "geodesic_mix_coefficient": {"metric": "mix", "retraction": "exact", "ball": "coefficient",
                                 **WORST},
    # the practical retraction of Eq. 5 (what the transformer engine uses)
    "geodesic_inv_second_order": {"metric": "inv", "retraction": "second_order",
                                  "ball": "metric", **WORST},
    "geodesic_mix_second_order": {"metric": "mix", "retraction": "second_order",
                                  "ball": "metric", **WORST},
    # App. G ablations: (a) the adaptive norm instead of the Riemannian (metric) norm,
    # (b) the second-order term dropped (w + ξ). For inv the adaptive norm of a horizontal
    # vector is its metric norm, so (a) is not repeated for inv.
    "ablation_inv_first_order": {"metric": "inv", "retraction": "first_order",
                                 "ball": "metric", **WORST},
    "ablation_mix_first_order": {"metric": "mix", "retraction": "first_order",
                                 "ball": "metric", **WORST},
    "ablation_mix_adaptive_norm": {"metric": "mix", "retraction": "exact", "ball": "adaptive",
                                   **WORST},
    # average case (not in the paper)
    "adaptive_avg": {"measure": "adaptive", **AVERAGE},
    "geodesic_inv_avg": {"metric": "inv", "retraction": "exact", "ball": "metric", **AVERAGE},
    "geodesic_mix_avg": {"metric": "mix", "retraction": "exact", "ball": "metric", **AVERAGE},
    "geodesic_mix_unconstrained_avg": {"metric": "mix", "retraction": "exact",
                                       "ball": "metric", "domain": False, **AVERAGE},
    "geodesic_mix_coefficient_avg": {"metric": "mix", "retraction": "exact",
                                     "ball": "coefficient", **AVERAGE},
}
QUICK: dict[str, Any] = {"n_members": 8, "max_steps": 4_000, "rho_grid": [0.03, 0.1], "n_iter": 10,
         "n_restarts": 1, "n_samples": 10, "n_boot": 200}


def measure_options(spec: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `diagonal_sharpness` (besides `rho` and `seed`) of one entry of
    `MEASURES`: `measure`, `geometry` (a `DiagonalGeometry`) and `solver`."""
    geo = {k: spec[k] for k in ("metric", "retraction", "ball", "domain") if k in spec}
    solver: APGD | Average = (APGD(n_iter=spec["n_iter"], restarts=spec["n_restarts"])
                              if spec["kind"] == "worst" else Average(n=spec["n_samples"]))
    return {"measure": spec.get("measure", "geodesic"), "geometry": DiagonalGeometry(**geo),
            "solver": solver}


def make_data(
    n: int = 80, d: int = 200, r: int = 20, n_test: int = 1000, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """``X, y, X_test, y_test, θ*`` of the data set above, as float64 tensors."""
    rs = np.random.RandomState(seed)
    X = rs.multivariate_normal(np.zeros(d), np.eye(d), n)
    X_test = rs.multivariate_normal(np.zeros(d), np.eye(d), n_test)
    theta = rs.randn(d)
    theta[r:] = 0.0
    theta = np.abs(theta) / np.linalg.norm(theta)
    t = [torch.tensor(a, dtype=torch.float64) for a in (X, X @ theta, X_test, X_test @ theta,
                                                          theta)]
    return tuple(t)


def sample_population(n_members: int = 50, seed: int = 1) -> list[dict]:
    """The hyperparameters of every member (member ``i`` does not depend on ``n_members``)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(max(n_members, POPULATION["n_members"])):
        alpha = float(10 ** rng.uniform(-2, 0))
        sgd = bool(rng.uniform() < POPULATION["p_sgd"])
        lo, hi = POPULATION["lr_sgd"] if sgd else POPULATION["lr_gd"]
        lr = float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        out.append({"id": f"m{i:03d}", "alpha": alpha, "optimizer": "sgd" if sgd else "gd",
                    "lr": lr, "seed": 1000 + i})
    return out[:n_members]


def train_population(configs: list[dict], X: torch.Tensor, y: torch.Tensor, *,
                     tol: float = 1e-5, max_steps: int = 100_000, check_every: int = 100,
                     progress: bool = False) -> list[dict]:
    r"""Train all ``configs`` at once (GD and batch-1 SGD rows side by side).

    GD: ``g = Xᵀ(Xβ − y)/n``; SGD: ``g = (x_iᵀβ − y_i) x_i`` for one sample drawn by the
    member's own generator; then ``u ← u − η g ⊙ v``, ``v ← v − η g ⊙ u``.  A member stops
    once ``L < tol`` (checked every ``check_every`` steps) or when it diverges.
    """
    from tqdm.auto import tqdm

    dt = torch.float64
    B, (n, d) = len(configs), X.shape
    U = torch.tensor([[c["alpha"]] * d for c in configs], dtype=dt)
    V = torch.zeros(B, d, dtype=dt)
    lr = torch.tensor([c["lr"] for c in configs], dtype=dt)[:, None]
    sgd = torch.tensor([c["optimizer"] == "sgd" for c in configs])[:, None]
    gens = [torch.Generator().manual_seed(c["seed"]) for c in configs]
    active = torch.ones(B, dtype=torch.bool)
    steps = torch.zeros(B, dtype=torch.long)
    status = ["max_steps"] * B
    rows = torch.arange(B)
    bar = tqdm(total=max_steps, desc="diagonal: training", disable=not progress, leave=False)
    step = 0
    while step < max_steps and bool(active.any()):
        act = rows[active]  # only the rows still training (each member's own generator)
        idx = torch.stack([torch.randint(0, n, (check_every,), generator=gens[i])
                           for i in act.tolist()], 1)
        u, v, eta, is_sgd = U[act], V[act], lr[act], sgd[act]
        for j in range(check_every):
            beta = u * v
            g_gd = (beta @ X.T - y) @ X / n
            xi = X[idx[j]]
            g_sgd = ((beta * xi).sum(-1) - y[idx[j]])[:, None] * xi
            g = torch.where(is_sgd, g_sgd, g_gd)
            u, v = u - eta * g * v, v - eta * g * u
        U[act], V[act] = u, v
        step += check_every
        steps = torch.where(active, steps + check_every, steps)
        loss = diagonal_loss(U * V, X, y)
        for i in rows[active].tolist():
            if not math.isfinite(loss[i].item()) or loss[i].item() > 1e6:
                status[i], active[i] = "diverged", False
            elif loss[i].item() < tol:
                status[i], active[i] = "converged", False
        bar.update(check_every)
        bar.set_postfix(active=int(active.sum()))
    bar.close()
    loss = diagonal_loss(U * V, X, y)
    return [{"u": U[i].clone(), "v": V[i].clone(), "status": status[i],
             "steps": int(steps[i]), "train_loss": float(loss[i])} for i in range(B)]


def _landscape_figure(u, v, X, y, path: Path, n1: int = 81, n2: int = 41) -> dict:
    from ..manifolds import DiagonalQuotient
    from ..sharpness.landscape import plot_slices, slice_1d, slice_2d

    M = DiagonalQuotient("inv", "exact")
    x = M.pack_point(u, v)
    gen = torch.Generator().manual_seed(0)
    b1, b2 = torch.randn(2, u.shape[-1], generator=gen, dtype=torch.float64)
    b1 = b1 / b1.norm()
    b2 = b2 - (b2 @ b1) * b1
    b2 = b2 / b2.norm()
    d1, d2 = M.pack_point(b1 * u, b1 * v), M.pack_point(b2 * u, b2 * v)
    def loss(p):
        return diagonal_loss(M.invariant(p), X, y)

    ts = torch.linspace(-1.0, 1.0, n1, dtype=torch.float64)
    one = slice_1d(M, x, d1, loss, ts)
    two = slice_2d(M, x, d1, d2, loss, torch.linspace(-1.0, 1.0, n2, dtype=torch.float64))
    plot_slices(one, two, path, title="diagonal net (inv metric): geodesic vs straight line")
    return {"direction": "random horizontal b, ||b|| = 1 (inv norm sqrt(2))",
            "t_range": [-1.0, 1.0]}


def _convention_figure(results: dict, path: Path) -> None:
    plt = pyplot("the figures of the diagonal experiment")

    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    for name in ("adaptive", "geodesic_inv", "geodesic_mix", "geodesic_mix_unconstrained",
                 "geodesic_mix_coefficient"):
        if name not in results["measures"]:
            continue
        by = results["measures"][name]["by_rho"]
        rs = sorted(by, key=float)
        ax.plot([float(r) for r in rs], [by[r]["tau"] for r in rs], marker="o", label=name)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("ρ")
    ax.set_ylabel("Kendall τ (sharpness, test loss)")
    ax.set_title("diagonal nets: τ against ρ")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out: str | os.PathLike, *, quick: bool = False, progress: bool = True) -> dict:
    """Train (or load) the population, measure it, write ``out/diagonal/results.json`` + PNGs."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    q = QUICK if quick else {}
    n_members = q.get("n_members", POPULATION["n_members"])
    max_steps = q.get("max_steps", POPULATION["max_steps"])
    rho_grid = q.get("rho_grid", RHO_GRID)
    store = PopulationStore(out, NAME)
    X, y, Xt, yt, _ = make_data(**DATA)
    configs = sample_population(n_members, POPULATION["seed"])
    train_protocol = protocol_hash({"data": DATA, "population": POPULATION,
                                    "max_steps": max_steps})

    # -- train what is not cached ------------------------------------------------------
    todo = [c for c in configs
            if not (store.has_member(c["id"])
                    and store.load_meta(c["id"]).get("protocol") == train_protocol)]
    t_train = time.perf_counter()
    if todo:
        trained = train_population(todo, X, y, tol=POPULATION["tol"], max_steps=max_steps,
                                   check_every=POPULATION["check_every"], progress=progress)
        for c, tr in zip(todo, trained):
            beta = tr["u"] * tr["v"]
            test = float(diagonal_loss(beta, Xt, yt))
            store.save_member(c["id"], {"u": tr["u"], "v": tr["v"]}, {
                "hyper": {k: c[k] for k in ("alpha", "optimizer", "lr")}, "seed": c["seed"],
                "status": tr["status"], "steps": tr["steps"], "train_loss": tr["train_loss"],
                "test_loss": test, "protocol": train_protocol})
    t_train = time.perf_counter() - t_train

    # -- load, keep the converged ones --------------------------------------------------
    ids, us, vs, metas = [], [], [], []
    dropped = {}
    for c in configs:
        state, meta = store.load_member(c["id"])
        if meta["status"] != "converged":
            dropped[c["id"]] = meta["status"]
            continue
        ids.append(c["id"])
        us.append(state["u"])
        vs.append(state["v"])
        metas.append(meta)
    U, V = torch.stack(us), torch.stack(vs)
    seeds = [m["seed"] for m in metas]  # random starts / samples of a member: its own stream

    # -- measures (cached per member under the measure protocol) -----------------------
    kw_over = {k: q[k] for k in ("n_iter", "n_restarts", "n_samples") if k in q}
    specs = {}
    for name, kw in MEASURES.items():
        kw = dict(kw)
        for k, val in kw_over.items():
            if k in kw:
                kw[k] = val
        specs[name] = kw
    mprot = protocol_hash({"measures": specs, "rho": rho_grid, "train": train_protocol,
                           "loss": "half_mean", "seed": "per member: its training seed"})
    cached = {i: store.load_measures(i, mprot) for i in ids}
    values = {i: dict(cached[i]) for i in ids}
    t_meas = time.perf_counter()
    jobs = [(name, r) for name in specs for r in rho_grid]
    for name, r in tqdm(jobs, desc="diagonal: sharpness", disable=not progress, leave=False):
        need = [j for j, i in enumerate(ids) if str(r) not in values[i].get(name, {})]
        if not need:
            continue
        s = diagonal_sharpness(U[need], V[need], X, y, rho=r, **measure_options(specs[name]),
                               seed=[seeds[j] for j in need])
        for j, val in zip(need, s.tolist()):
            values[ids[j]].setdefault(name, {})[str(r)] = val
    for i in ids:
        if values[i] != cached[i]:
            store.save_measures(i, mprot, values[i])
    t_meas = time.perf_counter() - t_meas

    beta = U * V
    members = [{"id": i, "gap": m["test_loss"], "hyper": m["hyper"], "measures": values[i],
                "train_loss": m["train_loss"], "steps": m["steps"]}
               for i, m, in zip(ids, metas)]
    settings = {"data": DATA, "population": {**POPULATION, "n_members": n_members,
                                             "max_steps": max_steps},
                "rho_grid": rho_grid, "primary_rho": PRIMARY_RHO, "measures": specs,
                "sharpness_loss": "||X beta - y||^2/(2n) on the 80 training points, one batch",
                "quick": quick}
    extra = {
        "n_dropped": len(dropped), "dropped": dropped,
        "guard": {"masked_coordinates": int(((U == 0) | (V == 0)).sum()),
                  "min_abs_beta": float(beta.abs().min()),
                  "n_abs_beta_below_1e-8": int((beta.abs() < 1e-8).sum())},
        "timing_s": {"train": t_train, "measures": t_meas},
    }
    res = summarize(NAME, members, gap_name="test loss",
                    primary_rho=dict.fromkeys(specs, PRIMARY_RHO), settings=settings,
                    n_boot=q.get("n_boot", 2000), extra=extra)
    # figures
    scatter_figure(res, store.dir / "scatter.png",
                   ["adaptive", "geodesic_inv", "geodesic_mix", "geodesic_mix_unconstrained",
                    "geodesic_mix_coefficient"])
    _convention_figure(res, store.dir / "tau_vs_rho.png")
    best = int(torch.argmin(torch.tensor([m["gap"] for m in members])))
    res["landscape"] = {"member": ids[best],
                        **_landscape_figure(U[best], V[best], X, y, store.dir / "landscape.png",
                                            *((21, 11) if quick else (81, 41)))}
    res["timing_s"]["total"] = time.perf_counter() - t0
    store.write_json("results.json", res)
    return res

