r"""Numeric bridges between the symbolic derivations and the torch implementation.

Symbolic proofs are about formulas; these bridges tie them to the code that
actually runs, and reach sizes where expanding rational functions is too slow
(e.g. ``n = 6, m = 5, h = 3``: 33 coordinates).

* [`christoffel_bridge`][quotient_manifolds.symbolic.bridge.christoffel_bridge]: the metric tensor
  is differentiated *symbolically* entry by entry, ``g`` and ``∂g`` are ``lambdify``-ed, and
  $Γ^λ_{μν}ξ^μη^ν = \tfrac12 g^{λσ}(\partial _ν g_{σμ} + \partial _μ g_{σν} - \partial _σ
  g_{μν})ξ^μη^ν$ is contracted in float64; compared with ``GLQuotient.christoffel`` /
  ``DiagonalQuotient.christoffel``.
* [`transcription_bridge`][quotient_manifolds.symbolic.bridge.transcription_bridge]: the library
  kernel evaluated on SymPy inputs (what the symbolic checks prove things about) is ``lambdify``-ed
  and compared with the torch call, so the symbolic proofs are about the code.
* [`projection_bridge`][quotient_manifolds.symbolic.bridge.projection_bridge]: the metric-orthogonal
  projection computed from the lambdified metric and vertical basis,
  ``Π ξ = ξ − V (Vᵀ g V)⁻¹ Vᵀ g ξ``, against ``GLQuotient.proju`` (also for
  ``ε > 0``); for inv the torch ``Λ`` is also compared with
  ``scipy.linalg.solve_sylvester`` on the corrected equation ``AΩ + ΩA = B``.
* [`geodesic_bridge_diagonal`][quotient_manifolds.symbolic.bridge.geodesic_bridge_diagonal]:
  ``DiagonalQuotient.expmap`` against an RK45 integration of the derived geodesic equations, for
  horizontal and non-horizontal velocities.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import sympy as sp
import torch

from ..geometry import adaptive as _ad
from ..geometry import diagonal as _dm
from ..geometry import gl as _gl
from ..manifolds import DiagonalQuotient, GLQuotient
from .checks import CheckResult, Outcome, run_check
from .models import DiagonalModel, GLBlock, adaptive_metric
from .riemann import CoordinateMetric, vertical_basis

# The torch kernels of `geometry`, applied here to SymTensor arguments (duck typing),
# hence typed Any.
gl: Any = _gl
dm: Any = _dm
ad: Any = _ad

__all__ = [
    "NumericMetric",
    "christoffel_bridge",
    "retraction_bridge",
    "transcription_bridge",
    "projection_bridge",
    "geodesic_bridge_diagonal",
    "geodesic_bridge_adaptive",
]

RTOL = 1e-9


class NumericMetric:
    r"""``g(x)``, ``∂g(x)`` and ``Γ_x(ξ, η)`` in float64 from a
    [`CoordinateMetric`][quotient_manifolds.symbolic.riemann.CoordinateMetric].

    Only the distinct nonzero entries of ``g`` are differentiated (memoised),
    and all of them go through one ``lambdify(..., cse=True)``.
    """

    def __init__(self, metric: CoordinateMetric) -> None:
        if metric.params:
            raise ValueError(f"metric has free parameters {metric.params}; substitute numbers")
        self.metric = metric
        coords = metric.coords
        n = len(coords)
        self.n = n
        g = metric.matrix
        uniq: dict[sp.Expr, int] = {}
        g_slots: list[tuple[int, int, int]] = []
        for i in range(n):
            for j in range(i, n):
                e = g[i, j]
                if e != 0:
                    g_slots.append((i, j, uniq.setdefault(e, len(uniq))))
        exprs = list(uniq)
        d_uniq: dict[sp.Expr, int] = {}
        d_slots: list[tuple[int, int, int, int]] = []
        memo: dict[tuple[int, int], sp.Expr] = {}
        for i, j, k in g_slots:
            for c, x in enumerate(coords):
                key = (k, c)
                if key not in memo:
                    memo[key] = sp.diff(exprs[k], x)
                de = memo[key]
                if de != 0:
                    d_slots.append((c, i, j, d_uniq.setdefault(de, len(d_uniq))))
        self._g_slots = np.array(g_slots, dtype=np.int64).reshape(-1, 3)
        self._d_slots = np.array(d_slots, dtype=np.int64).reshape(-1, 4)
        self._n_g = len(exprs)
        self._fn = sp.lambdify([list(coords)], exprs + list(d_uniq), modules="numpy", cse=True)

    def evaluate(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        r"""``(g, dg)`` at ``x`` with $dg[c, i, j] = \partial _c g_{ij}$."""
        vals = np.asarray(self._fn(np.asarray(x, dtype=np.float64)), dtype=np.float64)
        n = self.n
        g = np.zeros((n, n))
        i, j, k = self._g_slots.T
        g[i, j] = vals[k]
        g[j, i] = vals[k]
        dg = np.zeros((n, n, n))
        c, i, j, k = self._d_slots.T
        dg[c, i, j] = vals[self._n_g + k]
        dg[c, j, i] = vals[self._n_g + k]
        return g, dg

    def christoffel(self, x: np.ndarray, xi: np.ndarray, eta: np.ndarray) -> np.ndarray:
        r"""$Γ^λ_{μν} ξ^μ η^ν$, $Γ^λ_{μν} = \tfrac12 g^{λσ}(\partial _ν g_{σμ} + \partial _μ
        g_{σν} - \partial _σ g_{μν})$."""
        g, dg = self.evaluate(x)
        t1 = np.einsum("nsm,m,n->s", dg, xi, eta)
        t2 = np.einsum("msn,m,n->s", dg, xi, eta)
        t3 = np.einsum("smn,m,n->s", dg, xi, eta)
        return 0.5 * np.linalg.solve(g, t1 + t2 - t3)


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def _gl_point(n: int, m: int, h: int, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((n + m, h)) / np.sqrt(h) + 0.5 * np.eye(n + m, h)


def _verdict(errors: dict[str, float], rtol: float = RTOL) -> Outcome:
    worst = max(errors.values())
    detail = ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
    return worst <= rtol, f"max rel err {detail}"


def christoffel_bridge(
    n: int,
    m: int,
    h: int,
    metric: str,
    eps: float = 0.0,
    seed: int = 0,
    points: int = 3,
    candidate: Callable | None = None,
) -> CheckResult:
    r"""Metric-derived Γ (symbolic ``∂g``, numeric contraction) vs ``GLQuotient.christoffel``.

    ``candidate(x, u, v) -> Γ`` (torch, packed ``(n+m, h)`` tensors) defaults
    to ``GLQuotient(n, m, metric, eps).christoffel``.
    """
    block = GLBlock(n, m, h, sp.nsimplify(eps))
    sizes = block.sizes

    def run() -> Outcome:
        num = NumericMetric(block.coordinate_metric(metric))
        fn = candidate or GLQuotient(n, m, metric, eps=eps).christoffel
        rng = np.random.default_rng(seed)
        errs = []
        for _ in range(points):
            x = _gl_point(n, m, h, rng)
            u, v = rng.standard_normal((2, n + m, h))
            ref = num.christoffel(x.ravel(), u.ravel(), v.ravel())
            got = fn(*(torch.from_numpy(a) for a in (x, u, v))).numpy().ravel()
            errs.append(_rel_err(got, ref))
        return _verdict({"Γ(ξ,η)": max(errs)})

    return run_check("christoffel", f"GL {metric} (bridge)", sizes, "numeric", run)


def retraction_bridge(
    n: int,
    m: int,
    h: int,
    metric: str,
    eps: float = 0.0,
    seed: int = 0,
    points: int = 3,
    candidate: Callable | None = None,
) -> CheckResult:
    r"""The engine's second-order retraction against ``x + ξ − ½Γ_x(ξ, ξ)`` with the
    metric-derived Γ, and its gradient against ``I − Γ_x(ξ, ·)``.

    ``candidate(x, u) -> point`` (torch, packed ``(n+m, h)``) defaults to
    ``GLQuotient(n, m, metric, eps).at(x).retract(u, "second_order")``, the fused span-form
    kernel [`second_order`][quotient_manifolds.geometry.gl.second_order] with its hand-written
    backward. The gradient of ``⟨w, R(ξ)⟩`` must equal ``w − Γ_x(ξ, ·)ᵀ w`` (Γ symmetric
    bilinear), assembled column by column from the metric-derived Γ.
    """
    block = GLBlock(n, m, h, sp.nsimplify(eps))
    sizes = block.sizes

    def default(x, u):
        return GLQuotient(n, m, metric, eps=eps).at(x).retract(u, "second_order")

    def run() -> Outcome:
        num = NumericMetric(block.coordinate_metric(metric))
        fn = candidate or default
        rng = np.random.default_rng(seed)
        errs, gerrs = [], []
        N = (n + m) * h
        for _ in range(points):
            x = _gl_point(n, m, h, rng)
            u, w = 0.3 * rng.standard_normal((n + m, h)), rng.standard_normal((n + m, h))
            ref = x.ravel() + u.ravel() - 0.5 * num.christoffel(x.ravel(), u.ravel(), u.ravel())
            ut = torch.from_numpy(u).requires_grad_()
            got = fn(torch.from_numpy(x), ut)
            errs.append(_rel_err(got.detach().numpy().ravel(), ref))
            (g,) = torch.autograd.grad(got, ut, torch.from_numpy(w))
            J = np.eye(N) - np.stack([num.christoffel(x.ravel(), u.ravel(), e)
                                      for e in np.eye(N)], axis=1)
            gerrs.append(_rel_err(g.numpy().ravel(), J.T @ w.ravel()))
        return _verdict({"x + ξ − ½Γ(ξ,ξ)": max(errs), "gradient": max(gerrs)})

    return run_check("retraction", f"GL {metric} second order (bridge)", sizes, "numeric", run)


def transcription_bridge(kind: str, metric: str, seed: int = 0) -> CheckResult:
    r"""The SymPy evaluation of a library kernel equals the torch evaluation.

    ``kind="gl"``: [`christoffel`][quotient_manifolds.geometry.gl.christoffel],
    ``inner`` and ``horizontal_residual`` at ``n = 3, m = 2, h = 2``;
    ``kind="diagonal"``: [`christoffel`][quotient_manifolds.geometry.diagonal.christoffel]
    and ``project`` at ``d = 2``.  This ties the symbolic proofs (which run the
    kernels on [`SymTensor`][quotient_manifolds.symbolic.tensor.SymTensor]) to the
    torch semantics of the same code.
    """
    rng = np.random.default_rng(seed)

    def run_gl() -> Outcome:
        b = GLBlock(3, 2, 2)
        S = b.sym
        (xG, xH), (yG, yH) = b.tangent("xi"), b.tangent("eta")
        gr = b.code_grams()
        cG, cH = gl.christoffel(S(b.G), S(b.H), S(xG), S(xH), S(yG), S(yH), gr, metric)
        inner = gl.inner(S(b.G), S(b.H), S(xG), S(xH), S(yG), S(yH), gr, metric)
        res = gl.horizontal_residual(S(b.G), S(b.H), S(xG), S(xH), gr, metric)
        args = list(b.coords) + b.vec(xG, xH) + b.vec(yG, yH)
        f = sp.lambdify([args], [cG.flat() + cH.flat(), inner.flat(), res.flat()], cse=True)
        x = _gl_point(3, 2, 2, rng)
        u, v = rng.standard_normal((2, 5, 2))
        sym = f(np.concatenate([x.ravel(), u.ravel(), v.ravel()]))
        X, U, V = (torch.from_numpy(a) for a in (x, u, v))
        Gt, Ht = X[:3], X[3:]
        grt = gl.grams(Gt, Ht)
        cG, cH = gl.christoffel(Gt, Ht, U[:3], U[3:], V[:3], V[3:], grt, metric)
        tc = torch.cat([cG.reshape(-1), cH.reshape(-1)])
        ti = gl.inner(Gt, Ht, U[:3], U[3:], V[:3], V[3:], grt, metric).reshape(-1)
        tr = gl.horizontal_residual(Gt, Ht, U[:3], U[3:], grt, metric).reshape(-1)
        return _verdict(
            {
                "christoffel": _rel_err(tc.numpy(), np.array(sym[0], dtype=float)),
                "inner": _rel_err(ti.numpy(), np.array(sym[1], dtype=float)),
                "residual": _rel_err(tr.numpy(), np.array(sym[2], dtype=float)),
            }
        )

    def run_diag() -> Outcome:
        d = DiagonalModel(2)
        S = d.sym
        (xu, xv), (yu, yv) = d.tangent("xi"), d.tangent("eta")
        cu, cv = dm.christoffel(S(d.u), S(d.v), S(xu), S(xv), S(yu), S(yv), metric)
        pu, pv = dm.project(S(d.u), S(d.v), S(xu), S(xv))
        args = list(d.coords) + d.vec(xu, xv) + d.vec(yu, yv)
        f = sp.lambdify([args], [cu.flat() + cv.flat(), pu.flat() + pv.flat()], cse=True)
        x, u, v = rng.standard_normal((3, 2, 2))
        sym = f(np.concatenate([x.ravel(), u.ravel(), v.ravel()]))
        M = DiagonalQuotient(metric)
        X, U, V = (torch.from_numpy(a) for a in (x, u, v))
        return _verdict(
            {
                "christoffel": _rel_err(M.christoffel(X, U, V).numpy().ravel(), np.array(sym[0])),
                "project": _rel_err(M.proju(X, U).numpy().ravel(), np.array(sym[1])),
            }
        )

    sizes = "n=3,m=2,h=2" if kind == "gl" else "d=2"
    name = "GL" if kind == "gl" else "diagonal"
    fn = run_gl if kind == "gl" else run_diag
    return run_check("sympy=torch", f"{name} {metric} kernels", sizes, "numeric", fn)


def projection_bridge(
    n: int, m: int, h: int, metric: str, eps: float = 0.0, seed: int = 0, points: int = 3
) -> CheckResult:
    r"""``GLQuotient.proju`` = the ``g``-orthogonal projection derived from the metric.

    ``Π ξ = ξ − V (Vᵀ g V)⁻¹ Vᵀ g ξ`` with ``g`` the lambdified coordinate metric
    (relaxed by ``eps``) and ``V`` the derived vertical basis.  For inv at
    ``eps = 0`` the torch ``Λ`` is also compared with
    ``scipy.linalg.solve_sylvester(A, A, B)ᵀ`` (the corrected ``AΩ + ΩA = B``).
    """
    from scipy.linalg import solve_sylvester

    block = GLBlock(n, m, h, sp.nsimplify(eps))
    sizes = block.sizes

    def run() -> Outcome:
        cm = block.coordinate_metric(metric)
        V = vertical_basis(block.action, block.coords, block.group_params())
        g_fn = sp.lambdify([list(block.coords)], cm.matrix, cse=True)
        v_fn = sp.lambdify([list(block.coords)], V, cse=True)
        man = GLQuotient(n, m, metric, eps=eps)
        rng = np.random.default_rng(seed)
        errs = {"proju": 0.0}
        for _ in range(points):
            x = _gl_point(n, m, h, rng)
            xi = rng.standard_normal((n + m, h))
            g = np.asarray(g_fn(x.ravel()), dtype=float)
            Vx = np.asarray(v_fn(x.ravel()), dtype=float)
            c = np.linalg.solve(Vx.T @ g @ Vx, Vx.T @ g @ xi.ravel())
            ref = xi.ravel() - Vx @ c
            got = man.proju(torch.from_numpy(x), torch.from_numpy(xi)).numpy().ravel()
            errs["proju"] = max(errs["proju"], _rel_err(got, ref))
            if metric == "inv" and not eps:
                G, H = x[:n], x[n:]
                P, Q = G.T @ G, H.T @ H
                B = P @ H.T @ xi[n:] - xi[:n].T @ G @ Q
                omega = solve_sylvester(P @ Q, P @ Q, B)
                Gt, Ht = torch.from_numpy(G), torch.from_numpy(H)
                lam = gl.horizontal_lambda(
                    Gt,
                    Ht,
                    torch.from_numpy(xi[:n]),
                    torch.from_numpy(xi[n:]),
                    gl.grams(Gt, Ht),
                    "inv",
                ).numpy()
                errs["Λ vs solve_sylvester"] = max(
                    errs.get("Λ vs solve_sylvester", 0.0), _rel_err(lam, omega.T)
                )
        return _verdict(errs)

    return run_check("projection", f"GL {metric} (bridge)", sizes, "numeric", run)


def geodesic_bridge_diagonal(
    metric: str, d: int = 2, seed: int = 0, t_end: float = 1.0
) -> CheckResult:
    r"""``DiagonalQuotient.expmap`` vs RK45 on the derived geodesic equations.

    Velocities: one horizontal (``ξ = (bu, bv)``, Eq. 24) and one generic
    (exercising the library's non-horizontal closed forms: inv
    $u e^{tξ_u/u}$; mix the straight line in ``(|uv|, log|u/v|)``).
    """
    from scipy.integrate import solve_ivp

    model = DiagonalModel(d)

    def run() -> Outcome:
        num = NumericMetric(model.coordinate_metric(metric))
        man = DiagonalQuotient(metric, retraction="exact")
        rng = np.random.default_rng(seed)
        x = rng.uniform(0.5, 2.0, (2, d)) * rng.choice([-1.0, 1.0], (2, d))
        b = rng.uniform(-0.3, 0.3, d)
        vels = {
            "horizontal": np.stack([b * x[0], b * x[1]]),
            "generic": 0.3 * rng.standard_normal((2, d)),
        }
        errs = {}
        for name, xi in vels.items():

            def rhs(_t: float, y: np.ndarray) -> np.ndarray:
                pos, vel = y[: 2 * d], y[2 * d :]
                return np.concatenate([vel, -num.christoffel(pos, vel, vel)])

            sol = solve_ivp(
                rhs,
                (0.0, t_end),
                np.concatenate([x.ravel(), xi.ravel()]),
                method="DOP853",
                rtol=1e-12,
                atol=1e-13,
            )
            ref = sol.y[: 2 * d, -1]
            got = man.expmap(torch.from_numpy(x), torch.from_numpy(xi)).numpy().ravel()
            errs[name] = _rel_err(got, ref)
        return _verdict(errs, rtol=1e-8)

    return run_check("geodesic", f"diagonal {metric} expmap (bridge)", model.sizes, "numeric", run)


def geodesic_bridge_adaptive(eps: float, seed: int = 0) -> CheckResult:
    r"""``adaptive.geodesic`` vs RK45 on the geodesic equation of ``ξ²/(w² + ε)``."""
    from scipy.integrate import solve_ivp

    def run() -> Outcome:
        _, metric = adaptive_metric(sp.nsimplify(eps))
        num = NumericMetric(metric)
        rng = np.random.default_rng(seed)
        w = rng.uniform(0.3, 2.0, 4) * rng.choice([-1.0, 1.0], 4)
        xi = 0.5 * rng.standard_normal(4)
        got = ad.geodesic(torch.from_numpy(w), torch.from_numpy(xi), eps).numpy()
        ref = np.empty_like(w)
        for k in range(4):

            def rhs(_t: float, y: np.ndarray, k: int = k) -> np.ndarray:
                return np.array([y[1], -num.christoffel(y[:1], y[1:], y[1:])[0]])

            sol = solve_ivp(rhs, (0.0, 1.0), [w[k], xi[k]], method="DOP853", rtol=1e-12, atol=1e-13)
            ref[k] = sol.y[0, -1]
        return _verdict({"γ(1)": _rel_err(got, ref)}, rtol=1e-8)

    return run_check("geodesic", "adaptive (bridge)", f"d=1,eps={eps:g}", "numeric", run)
