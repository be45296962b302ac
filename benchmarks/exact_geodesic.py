r"""Accuracy and cost of the exact GL(h) retraction: fixed-step RK4 versus torchdiffeq.

The exact retraction of :class:`quotient_manifolds.GLQuotient`
(``retraction="exact"``) integrates the geodesic equation
``γ̈ = −Γ_γ(γ̇, γ̇)`` from ``(x, u)`` to ``t = 1`` with classic RK4 and a fixed
number of ``steps``, on the ``h×h``-sized system of the span of ``[F, u_F]``
(:func:`quotient_manifolds.geometry.gl.geodesic`).  This script compares, for both metrics,

* ``rk4 (ours)``: ``GLQuotient(..., retraction="exact", steps=k).retr`` for
  ``k ∈ {1, 2, 4, 8, 16, 32}`` (float64), and ``k = 8`` in float32 (the
  precision a model trains in);
* ``rk4 full space``: the previous integrator, RK4 on ``(γ, γ̇)`` in the full
  ``(n + m) × h`` space (:func:`quotient_manifolds.geometry.ode.rk4_geodesic` with
  ``−GLQuotient.christoffel``), ``k = 8``, float64 and float32;
* ``tdq rk4``: :func:`torchdiffeq.odeint`, fixed grid ``step_size = 1/8``
  (torchdiffeq's RK4 is the 3/8-rule variant);
* ``tdq dopri5``: :func:`torchdiffeq.odeint`, adaptive, ``rtol = atol ∈ {1e-6, 1e-9}``;
* ``2nd order``: the default retraction ``x + u − ½Γ_x(u, u)``, for context;

against a reference geodesic from :func:`scipy.integrate.solve_ivp`
(``DOP853``, ``rtol = atol = 1e-12``, float64).  Every integrator uses the
library's own Christoffel form (:meth:`GLQuotient.christoffel`) as right-hand
side, so the figures measure integration error only.  The reference itself is
checked against RK4 with 128 steps (64 with ``--quick``); its metric speed
``⟨γ̇, γ̇⟩_γ`` and its horizontality at ``t = 1`` are reported too (an exact
horizontal geodesic of the Levi-Civita connection conserves both: an
independent check of the Christoffel form).

Sizes: a realistic block (``n = m = 65``, ``h = 16``, a batch of 12 blocks)
and a small one (``n = 7``, ``m = 6``, ``h = 3``).  Tangent vectors: the
horizontal projection of a Gaussian vector, scaled per block to metric norm
``‖u‖_x ∈ {0.01, 0.1, 0.5, 1}``.

Figures per method: the max abs error of the end point over all entries; the
relative error ``max|∇ − ∇_ref| / max|∇_ref|`` of the gradient of
``⟨w, γ(1)⟩`` with respect to ``(x, u)`` at ``‖u‖ = 1`` (reference gradient:
the same many-step RK4, float64); the number of right-hand-side evaluations
(``nfe``); the median wall time, and process CPU time (which other load on a
shared machine does not inflate), of a forward call and of a forward +
backward call at ``‖u‖ = 1`` (fixed-step methods cost the same at every norm;
dopri5 is also timed at ``‖u‖ = 0.1``, in the JSON).  Also the *batch
coupling* of each solver: how much block 0's result changes when it is
integrated alone instead of inside the batch.  Measured figures and the
recommendation drawn from them: ``docs/benchmarks.md``.

Usage
-----
Full run (about 75 s on one core)::

    .venv/bin/python benchmarks/exact_geodesic.py --json runs/exact_geodesic.json

Tiny configuration for CI (about 8 s)::

    .venv/bin/python benchmarks/exact_geodesic.py --quick

JSON keys (flat): ``{size}_{metric}_u{norm}_{method}_{what}`` with ``size``
``realistic`` or ``small``, ``what`` one of ``err``, ``fwd_s``, ``fwdbwd_s``,
``fwd_cpu_s``, ``fwdbwd_cpu_s``, ``nfe``, ``grad_rel_err`` (``u1`` only), e.g.
``realistic_inv_u1_ours_k8_err``; plus ``..._ref_*`` checks,
``..._coupling_*``, ``config_*`` and ``env_*`` entries.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from scipy.integrate import solve_ivp
from torchdiffeq import odeint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    environment,
    fmt,
    load_average,
    print_table,
    time_call,
    write_json,
)

import quotient_manifolds as qm  # noqa: E402
from quotient_manifolds.geometry import gl  # noqa: E402
from quotient_manifolds.geometry.ode import rk4_geodesic  # noqa: E402

Retraction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Size:
    """A block size: ``batch`` blocks of ``(n + m) × h``."""

    name: str
    n: int
    m: int
    h: int
    batch: int


@dataclass(frozen=True)
class Config:
    """What to run (full or ``--quick``)."""

    sizes: tuple[Size, ...]
    norms: tuple[float, ...]
    ours_steps: tuple[int, ...]
    tdq_rk4_steps: tuple[int, ...]
    dopri_tols: tuple[float, ...]
    repeats: int
    ref_check_steps: int  # RK4 steps of the check of the reference and of the gradient reference


FULL = Config(
    sizes=(Size("realistic", 65, 65, 16, 12), Size("small", 7, 6, 3, 1)),
    norms=(0.01, 0.1, 0.5, 1.0),
    ours_steps=(1, 2, 4, 8, 16, 32),
    tdq_rk4_steps=(8,),
    dopri_tols=(1e-6, 1e-9),
    repeats=3,
    ref_check_steps=128,
)
QUICK = Config(
    sizes=(Size("small", 7, 6, 3, 1),),
    norms=(0.1, 1.0),
    ours_steps=(2, 8),
    tdq_rk4_steps=(8,),
    dopri_tols=(1e-6,),
    repeats=1,
    ref_check_steps=64,
)
REF_RTOL = 1e-12
F32_STEPS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny configuration (CI)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs per figure, median (default 3, quick 1)")
    p.add_argument("--metrics", nargs="+", choices=gl.METRICS, default=list(gl.METRICS))
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be positive")
    return args


# -- problem ---------------------------------------------------------------------
def make_problem(
    size: Size, metric: str, seed: int
) -> tuple[qm.GLQuotient, torch.Tensor, torch.Tensor]:
    """Manifold (``validate=False``: a cheap right-hand side), point and unit tangent."""
    M = qm.GLQuotient(size.n, size.m, metric=metric, validate=False)
    g = torch.Generator().manual_seed(seed)
    shape = (size.batch, size.n + size.m, size.h)
    x = torch.randn(shape, generator=g, dtype=torch.float64) / size.h**0.5
    u = M.proju(x, torch.randn(shape, generator=g, dtype=torch.float64))
    u = u / M.inner(x, u, keepdim=True).sqrt()  # metric norm 1 per block
    return M, x, u


class CountedField:
    """Right-hand side ``(x, v) ↦ (v, −Γ_x(v, v))`` for torchdiffeq, counting evaluations."""

    def __init__(self, M: qm.GLQuotient) -> None:
        self.M = M
        self.nfe = 0

    def __call__(
        self, t: torch.Tensor, y: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.nfe += 1
        x, v = y
        return v, -self.M.christoffel(x, v)


def reference(
    M: qm.GLQuotient, x: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(γ(1), γ̇(1), nfev)`` from scipy's DOP853 at ``rtol = atol = 1e-12`` (float64)."""
    shape, N = x.shape, x.numel()

    def rhs(t: float, y: np.ndarray) -> np.ndarray:
        yt = torch.from_numpy(y)
        X, V = yt[:N].view(shape), yt[N:].view(shape)
        return torch.cat([V.reshape(-1), -M.christoffel(X, V).reshape(-1)]).numpy()

    y0 = torch.cat([x.reshape(-1), u.reshape(-1)]).numpy()
    sol = solve_ivp(rhs, (0.0, 1.0), y0, method="DOP853", rtol=REF_RTOL, atol=REF_RTOL)
    if not sol.success:
        raise RuntimeError(f"reference integration failed: {sol.message}")
    yT = torch.from_numpy(sol.y[:, -1].copy())
    return yT[:N].view(shape), yT[N:].view(shape), int(sol.nfev)


# -- methods ---------------------------------------------------------------------
def ours(size: Size, metric: str, steps: int) -> Retraction:
    """The library's exact retraction (default ``validate=True``, as users get it)."""
    M = qm.GLQuotient(size.n, size.m, metric=metric, retraction="exact", steps=steps)
    return M.retr


def full_space(size: Size, metric: str, steps: int) -> Retraction:
    """The previous integrator: RK4 on ``(γ, γ̇)`` in the full ``(n + m) × h`` space."""
    M = qm.GLQuotient(size.n, size.m, metric=metric, validate=False)

    def run(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return rk4_geodesic(x, u, lambda p, v: -M.christoffel(p, v), steps)[0]

    return run


def second_order(size: Size, metric: str) -> Retraction:
    """The library's default retraction ``x + u − ½Γ_x(u, u)``."""
    return qm.GLQuotient(size.n, size.m, metric=metric).retr


def tdq(field: CountedField, method: str, **kw: object) -> Retraction:
    """``torchdiffeq.odeint`` from ``t = 0`` to ``1``, returning ``γ(1)``."""

    def run(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        t = torch.tensor([0.0, 1.0], dtype=x.dtype)
        if method == "rk4":
            sol = odeint(field, (x, u), t, method="rk4", options={"step_size": kw["step_size"]})
        else:
            sol = odeint(field, (x, u), t, method=method, rtol=kw["tol"], atol=kw["tol"])
        return sol[0][-1]

    return run


def methods(size: Size, metric: str, M: qm.GLQuotient, cfg: Config
            ) -> list[tuple[str, str, Retraction, CountedField | None, torch.dtype]]:
    """``(key, label, retraction, field or None, dtype)`` for every compared method."""
    out: list[tuple[str, str, Retraction, CountedField | None, torch.dtype]] = []
    for k in cfg.ours_steps:
        out.append((f"ours_k{k}", f"rk4 (ours) k={k}", ours(size, metric, k), None,
                    torch.float64))
    out.append((f"ours_k{F32_STEPS}_f32", f"rk4 (ours) k={F32_STEPS} float32",
                ours(size, metric, F32_STEPS), None, torch.float32))
    out.append((f"full_k{F32_STEPS}", f"rk4 full space k={F32_STEPS} (previous)",
                full_space(size, metric, F32_STEPS), None, torch.float64))
    out.append((f"full_k{F32_STEPS}_f32", f"rk4 full space k={F32_STEPS} float32 (previous)",
                full_space(size, metric, F32_STEPS), None, torch.float32))
    for k in cfg.tdq_rk4_steps:
        f = CountedField(M)
        out.append((f"tdq_rk4_k{k}", f"tdq rk4 k={k}", tdq(f, "rk4", step_size=1.0 / k), f,
                    torch.float64))
    for tol in cfg.dopri_tols:
        f = CountedField(M)
        out.append((f"tdq_dopri5_tol{tol:.0e}", f"tdq dopri5 tol={tol:.0e}",
                    tdq(f, "dopri5", tol=tol), f, torch.float64))
    out.append(("second_order", "2nd order", second_order(size, metric), None, torch.float64))
    return out


def nfe_of(key: str, field: CountedField | None, retr: Retraction,
           x: torch.Tensor, u: torch.Tensor) -> int:
    """Right-hand-side evaluations of one call."""
    if field is None:
        if key.startswith(("ours_k", "full_k")):
            return 4 * int(key.split("_")[1][1:])
        return 1  # second order: one Christoffel evaluation
    field.nfe = 0
    retr(x, u)
    return field.nfe


def grad(retr: Retraction, x: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Gradient of ``⟨w, γ(1)⟩`` with respect to ``(x, u)``, concatenated (float64)."""
    xg = x.detach().clone().requires_grad_(True)
    ug = u.detach().clone().requires_grad_(True)
    gx, gu = torch.autograd.grad((retr(xg, ug) * w.to(x.dtype)).sum(), (xg, ug))
    return torch.cat([gx.flatten(), gu.flatten()]).double()


def fwd_bwd(retr: Retraction, x: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> None:
    """One forward and backward pass (what the sharpness engine pays per step)."""
    xg = x.detach().clone().requires_grad_(True)
    ug = u.detach().clone().requires_grad_(True)
    (retr(xg, ug) * w).sum().backward()


# -- one (size, metric) ----------------------------------------------------------
def timed_tags(cfg: Config) -> tuple[str, str]:
    """The two norms at which wall time is measured: the one nearest 0.1, and the largest."""
    return (f"u{min(cfg.norms, key=lambda v: abs(v - 0.1)):g}", f"u{max(cfg.norms):g}")


def run_case(size: Size, metric: str, cfg: Config, seed: int,
             figures: dict[str, object]) -> list[list[str]]:
    """All methods and norms for one size and metric; returns the table rows."""
    M, x, u1 = make_problem(size, metric, seed)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1),
                    dtype=torch.float64)
    pre = f"{size.name}_{metric}"
    meths = methods(size, metric, M, cfg)
    res: dict[str, dict[str, float]] = {key: {} for key, *_ in meths}
    t_small, tag_max = timed_tags(cfg)
    for s in cfg.norms:
        u = s * u1
        tag = f"u{s:g}"
        t0 = time.perf_counter()
        y_ref, v_ref, nfev = reference(M, x, u)
        figures[f"{pre}_{tag}_ref_s"] = time.perf_counter() - t0
        figures[f"{pre}_{tag}_ref_nfev"] = nfev
        check = ours(size, metric, cfg.ref_check_steps)(x, u)
        figures[f"{pre}_{tag}_ref_vs_rk4"] = float((check - y_ref).abs().max())
        speed0 = M.inner(x, u)
        figures[f"{pre}_{tag}_ref_speed_drift"] = float(
            ((M.inner(y_ref, v_ref) - speed0).abs() / speed0).max())
        G, H = M.split(y_ref)
        vG, vH = M.split(v_ref)
        figures[f"{pre}_{tag}_ref_horizontal_residual"] = float(
            gl.horizontal_residual(G, H, vG, vH, gl.grams(G, H), metric).abs().max())
        for key, _, retr, field, dtype in meths:
            xs, us, ws = x.to(dtype), u.to(dtype), w.to(dtype)
            err = float((retr(xs, us).double() - y_ref).abs().max())
            nfe = nfe_of(key, field, retr, xs, us)
            res[key][tag] = err
            res[key][f"nfe_{tag}"] = nfe
            figures.update({f"{pre}_{tag}_{key}_err": err, f"{pre}_{tag}_{key}_nfe": nfe})
            # fixed-step cost does not depend on ‖u‖: time those at the largest norm only
            if tag != tag_max and not (tag == t_small and key.startswith("tdq_dopri5")):
                continue
            # the error evaluation above was the warm-up call
            t_f = time_call(lambda r=retr, a=xs, b=us: r(a, b), repeats=cfg.repeats, warmup=0)
            t_fb = time_call(lambda r=retr, a=xs, b=us, c=ws: fwd_bwd(r, a, b, c),
                             repeats=cfg.repeats, warmup=0)
            res[key].update({f"fwd_{tag}": t_f.wall, f"fwdbwd_{tag}": t_fb.wall,
                             f"fwdcpu_{tag}": t_f.cpu, f"fwdbwdcpu_{tag}": t_fb.cpu})
            figures.update({f"{pre}_{tag}_{key}_fwd_s": t_f.wall,
                            f"{pre}_{tag}_{key}_fwdbwd_s": t_fb.wall,
                            f"{pre}_{tag}_{key}_fwd_cpu_s": t_f.cpu,
                            f"{pre}_{tag}_{key}_fwdbwd_cpu_s": t_fb.cpu})
    # gradient accuracy at the largest norm
    s_max = max(cfg.norms)
    u = s_max * u1
    g_ref = grad(ours(size, metric, cfg.ref_check_steps), x, u, w)
    for key, _, retr, _, dtype in meths:
        g = grad(retr, x.to(dtype), u.to(dtype), w)
        rel = float((g - g_ref).abs().max() / g_ref.abs().max())
        res[key]["grad"] = rel
        figures[f"{pre}_{tag_max}_{key}_grad_rel_err"] = rel
    # batch coupling: block 0 alone versus inside the batch
    if size.batch > 1:
        for key, _, retr, _, dtype in meths:
            if key.startswith("tdq_dopri5") or key == f"ours_k{F32_STEPS}":
                xs, us = x.to(dtype), (s_max * u1).to(dtype)
                alone = retr(xs[:1], us[:1])
                figures[f"{pre}_{tag_max}_coupling_{key}"] = float(
                    (alone - retr(xs, us)[:1]).abs().max())
    rows = []
    for key, label, *_ in meths:
        r = res[key]
        rows.append([label] + [fmt(r[f"u{s:g}"], ".1e") for s in cfg.norms]
                    + [fmt(r["grad"], ".1e"), fmt(r[f"nfe_{t_small}"], "d"),
                       fmt(r[f"nfe_{tag_max}"], "d")]
                    + [fmt(1e3 * r[f"{w_}_{tag_max}"], ".1f")
                       for w_ in ("fwd", "fwdbwd", "fwdcpu", "fwdbwdcpu")])
    return rows


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Run every case, print the tables, return (and optionally write) the figures."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = QUICK if args.quick else FULL
    if args.repeats is not None:
        cfg = dataclasses.replace(cfg, repeats=args.repeats)
    figures: dict[str, object] = {
        "config_quick": bool(args.quick),
        "config_repeats": cfg.repeats,
        "config_norms": ",".join(f"{s:g}" for s in cfg.norms),
        "config_ref": f"scipy DOP853 rtol=atol={REF_RTOL:g}",
        **environment(),
    }
    t_start = time.perf_counter()
    s_max = max(cfg.norms)
    t_small, _ = timed_tags(cfg)
    headers = (["method"] + [f"err ‖u‖={s:g}" for s in cfg.norms]
               + [f"grad err ‖u‖={s_max:g}", f"nfe ‖u‖={t_small[1:]}", f"nfe ‖u‖={s_max:g}",
                  f"fwd ms ‖u‖={s_max:g}", f"fwd+bwd ms ‖u‖={s_max:g}",
                  f"fwd cpu ms ‖u‖={s_max:g}", f"fwd+bwd cpu ms ‖u‖={s_max:g}"])
    for size in cfg.sizes:
        for metric in args.metrics:
            rows = run_case(size, metric, cfg, args.seed, figures)
            pre = f"{size.name}_{metric}"
            print_table(headers, rows, title=(
                f"{size.name} block: {size.batch} x ({size.n} + {size.m}) x {size.h}, "
                f"metric={metric} (errors: max abs vs DOP853 reference, float64 unless noted)"))
            checks = [
                f"‖u‖={s:g}: vs rk4({cfg.ref_check_steps}) "
                f"{figures[f'{pre}_u{s:g}_ref_vs_rk4']:.1e}, "
                f"speed drift {figures[f'{pre}_u{s:g}_ref_speed_drift']:.1e}, "
                f"horizontal residual {figures[f'{pre}_u{s:g}_ref_horizontal_residual']:.1e}"
                for s in cfg.norms
            ]
            print("reference checks: " + "; ".join(checks))
            coupling = {k.split("coupling_")[1]: v for k, v in figures.items()
                        if k.startswith(f"{pre}_u{s_max:g}_coupling_")}
            if coupling:
                print("batch coupling |block 0 alone - block 0 in batch|: "
                      + ", ".join(f"{k} {v:.1e}" for k, v in coupling.items()))
    figures["total_wall_s"] = time.perf_counter() - t_start
    figures["env_loadavg_end"] = load_average()
    print(f"\nlibrary {figures['env_git']}, threads={torch.get_num_threads()}, "
          f"repeats={cfg.repeats} (median); "
          f"total {figures['total_wall_s']:.1f} s; load average "
          f"{figures['env_loadavg_start']:.2f} -> {figures['env_loadavg_end']:.2f} "
          f"on {figures['env_cpu_count']} CPUs")
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
