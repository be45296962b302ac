r"""Symbolic checks of the subgroup quotients (rotary commutant) and their projection.

The library's subgroup kernels ([`geometry.subgroup`][quotient_manifolds.geometry.subgroup]) are
evaluated on SymPy tensors: ``RotaryCommutant.project`` (the Frobenius projection onto
$\mathfrak k$), ``vertical_dual`` / ``horizontal_residual`` and ``dual_operator``.  Everything
they are compared with is derived here from the definitions alone:

* the rotations of the embedding, $R(\theta)$ with one $(\cos\theta_p, \sin\theta_p)$ per pair
  as free symbols $(c_p, s_p)$ (so an identity in them holds for every angle), and an exact
  rational rotation $R_1$ (Pythagorean $c, s$, distinct angles);
* the commutant of $R_1$, an exact nullspace;
* the vertical space of the subgroup action $(G A^{-1}, H A^\top)$,
  $A = I + \sum_a \omega_a N_a$, by differentiating the action;
* the metric (inv or mix, Eq. 9/10) in coordinates.

The projection solver of the library (a Schur complement in generalised eigenbases) is
numeric; what is proven symbolically is the equation it solves, through a *solver* argument
``solve(R, grams, metric, sub) -> X`` that maps the vertical dual $R = D(\xi)$ to
$X \in \mathfrak k$: the documented equation solved exactly (`documented_x`), or a
deliberately wrong shortcut (`gl_lambda_then_project`) that the checks must refute.  The
numeric bridge (`subgroup_projection_bridge`) ties the torch solver to the projection
derived from the metric.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import sympy as sp
import torch

from ..geometry import gl
from ..geometry import subgroup as sg
from .algebra import ZeroTest, prove_zero
from .checks import CheckResult, Outcome, _combine, run_check
from .models import GLBlock, symmetric_symbols
from .riemann import horizontal_conditions, vertical_basis
from .tensor import SymTensor

# The torch kernels of `geometry.gl`, applied here to SymTensor arguments (duck typing),
# hence typed Any as in `checks` and `models`; `gl` itself still names the types.
_glk: Any = gl

__all__ = [
    "Solver",
    "symbolic_rotation",
    "rational_rotation",
    "commutant_basis",
    "subalgebra_basis",
    "subalgebra_label",
    "documented_x",
    "gl_lambda_then_project",
    "check_rotary_commutant",
    "check_vertical_subgroup",
    "check_projection_subgroup",
    "subgroup_projection_bridge",
]

Solver = Callable[..., SymTensor]


def subalgebra_label(sub: sg.Subalgebra) -> str:
    """Short label of a subalgebra for the result table, e.g. ``h=64,rotate_half,r=16``."""
    if isinstance(sub, sg.RotaryCommutant):
        h, pairs = sub.h, sub.pairs
        r = 2 * len(pairs)
        for name in ("rotate_half", "interleaved"):
            if getattr(sg.RotaryCommutant, name)(h, r) == sub:
                return f"h={h},{name}" + (f",r={r}" if r < h else "")
        return f"h={h},pairs={list(pairs)}"
    return f"h={sub.h},{type(sub).__name__}"


def _M(X) -> sp.Matrix:
    return X.to_matrix() if isinstance(X, SymTensor) else sp.Matrix(X)


def _frob(A: sp.Matrix, B: sp.Matrix) -> sp.Expr:
    return sum((a * b for a, b in zip(A, B)), sp.S.Zero)


def sym_project(sub: sg.Subalgebra, X: sp.Matrix, project: Callable | None = None) -> sp.Matrix:
    """The library's ``sub.project`` (or a candidate ``project``) run on a SymPy matrix."""
    fn: Callable[..., Any] = project or sub.project  # run on a SymTensor (duck typing)
    return _M(fn(SymTensor(X)))


# -- rotations and the commutant ---------------------------------------------------------------
def symbolic_rotation(sub: sg.RotaryCommutant) -> tuple[sp.Matrix, list[sp.Symbol]]:
    r"""$R$ with free symbols $(c_p, s_p)$ for $(\cos\theta_p, \sin\theta_p)$ on pair $p$."""
    R = sp.eye(sub.h)
    syms = []
    for p, (i, j) in enumerate(sub.pairs):
        c, s = sp.symbols(f"c_{p} s_{p}")
        syms += [c, s]
        R[i, i] = R[j, j] = c
        R[j, i], R[i, j] = s, -s
    return R, syms


def rational_rotation(sub: sg.RotaryCommutant) -> sp.Matrix:
    r"""An exact rotation with distinct angles: $c = (1 - t^2)/(1 + t^2)$,
    $s = 2t/(1 + t^2)$ with $t_p = 1/(p + 2)$ (angles $2\arctan t_p$, distinct in
    $(0, \pi)$)."""
    R, syms = symbolic_rotation(sub)
    vals = {}
    for p in range(len(sub.pairs)):
        t = sp.Rational(1, p + 2)
        vals[syms[2 * p]] = (1 - t**2) / (1 + t**2)
        vals[syms[2 * p + 1]] = 2 * t / (1 + t**2)
    return R.xreplace(vals)


def _unknown(h: int, name: str) -> sp.Matrix:
    return sp.Matrix(h, h, lambda a, b: sp.Symbol(f"{name}_{a}{b}"))


def _vec_basis(vectors, h: int) -> list[sp.Matrix]:
    return [sp.Matrix(h, h, list(v)) for v in vectors]


def commutant_basis(sub: sg.RotaryCommutant) -> list[sp.Matrix]:
    """Exact basis of $\\{X : X R_1 = R_1 X\\}$ for the rational rotation $R_1$."""
    h = sub.h
    R1 = rational_rotation(sub)
    X = _unknown(h, "x")
    eqs = sp.Matrix(list(X * R1 - R1 * X)).jacobian(list(X))
    return _vec_basis(eqs.nullspace(), h)


def subalgebra_basis(sub: sg.Subalgebra) -> list[sp.Matrix]:
    """Exact basis of the range of the library's ``sub.project`` (its column space)."""
    h = sub.h
    cols = []
    for a in range(h):
        for b in range(h):
            E = sp.zeros(h, h)
            E[a, b] = 1
            cols.append(list(sym_project(sub, E)))
    return _vec_basis(sp.Matrix(cols).T.columnspace(), h)


# -- solvers: R = D(ξ) ↦ X ∈ k ------------------------------------------------------------------
def _solve_linear(eqs: list[sp.Expr], unknowns: list[sp.Symbol]) -> list[sp.Expr]:
    """Solve the affine system ``eqs = 0`` exactly by Cramer's rule, ``adj(J)/det(J)`` built on
    placeholders and substituted (no polynomial GCDs, which are very slow here)."""
    J = sp.Matrix(eqs).jacobian(unknowns)
    b = -sp.Matrix(eqs).xreplace({x: 0 for x in unknowns})
    return list(GLBlock.inverse(J) * b)


def documented_x(R: SymTensor | sp.Matrix, gr: gl.Grams, metric: str,
                 sub: sg.Subalgebra) -> SymTensor:
    r"""The documented equation, solved exactly: $X = \sum_a x_a N_a \in \mathfrak k$ with
    $\langle N_a, R + L(X)\rangle_F = 0$ for a basis $N_a$ of $\mathfrak k$, i.e.
    $\pi_{\mathfrak k}(R + L(X)) = 0$, $L$ = the library's
    [dual_operator][quotient_manifolds.geometry.subgroup.dual_operator]."""
    R = _M(R)
    N = subalgebra_basis(sub)
    xs = [sp.Symbol(f"x_{a}") for a in range(len(N))]
    X = sum((x * Na for x, Na in zip(xs, N)), sp.zeros(sub.h, sub.h))
    LX = _M(sg.dual_operator(SymTensor(X), gr, metric))
    sol = _solve_linear([_frob(Na, R + LX) for Na in N], xs)
    return SymTensor(X.xreplace(dict(zip(xs, sol))))


def gl_lambda_then_project(R: SymTensor | sp.Matrix, gr: gl.Grams, metric: str,
                           sub: sg.Subalgebra) -> SymTensor:
    r"""**Wrong on purpose**: the full-GL(h) solution $\Lambda$ of $R + L(\Lambda) = 0$ (what
    the GL projection uses), then projected onto $\mathfrak k$.  Tempting, since the GL
    solver already exists, but $\pi_{\mathfrak k}$ does not commute with $L^{-1}$."""
    R = _M(R)
    h = sub.h
    lam = _unknown(h, "l")
    L = _M(sg.dual_operator(SymTensor(lam), gr, metric))
    sol = _solve_linear(list(R + L), list(lam))
    return SymTensor(sym_project(sub, sp.Matrix(h, h, sol)))


# -- 1. the rotary commutant -------------------------------------------------------------------
def _expect_refuted(test: ZeroTest) -> ZeroTest:
    """A test that must find a counterexample (e.g. a generic matrix must not commute)."""
    if test.verdict == "refuted":
        return ZeroTest("proven", "counterexample found, as required", test.detail)
    return ZeroTest("refuted", test.method, "expected a counterexample, found none")


def check_rotary_commutant(
    sub: sg.RotaryCommutant, project: Callable | None = None
) -> CheckResult:
    r"""The library's $\mathfrak k$ is exactly the set of matrices commuting with every
    rotation of the embedding, and the library's projection is the orthogonal one onto it.

    Proves: $\pi(Y) R(\theta) = R(\theta) \pi(Y)$ for generic $Y$ and symbolic
    $(c_p, s_p)$ (every angle); $\pi$ is the identity on the exact commutant of one rational
    rotation $R_1$ with distinct angles, whose dimension is ``sub.dim()`` (so the commutant of
    the whole family is exactly $\mathfrak k$); $\pi$ is idempotent and Frobenius-self-adjoint;
    $\mathfrak k$ is closed under transpose, products and inverses, and $A^{-1} R A = R$ for
    generic $A \in \mathfrak k$ (the Q/K logits $x^\top G R H^\top y$ are invariant under
    $(G A^{-1}, H A^\top)$); a generic $Y \in \mathfrak{gl}(h)$ does not commute (refuted).
    ``project`` (a function of a SymPy tensor) replaces ``sub.project`` to test a candidate.
    """
    h = sub.h

    def run() -> Outcome:
        pj = lambda X: sym_project(sub, X, project)  # noqa: E731
        R, _ = symbolic_rotation(sub)
        Y, Z = _unknown(h, "y"), _unknown(h, "z")
        PY, PZ = pj(Y), pj(Z)
        commutes = prove_zero(list(PY * R - R * PY))
        N = commutant_basis(sub)
        dim_ok = len(N) == sub.dim()
        identity = prove_zero([e for Na in N for e in pj(Na) - Na])
        idem = prove_zero(list(pj(PY) - PY))
        adjoint = prove_zero([_frob(PY, Z) - _frob(Y, PZ)])
        transpose = prove_zero(list(pj(PY.T) - PY.T))
        product = prove_zero(list(pj(PY * PZ) - PY * PZ))
        inv = GLBlock.inverse(PY)
        inverse = prove_zero(list(inv * R - R * inv))
        logits = prove_zero(list(inv * R * PY - R))
        generic = _expect_refuted(prove_zero(list(Y * R - R * Y)))
        parts = [
            ("π(Y) commutes with R(θ)", commutes),
            ("π = id on the commutant of R₁", identity),
            ("π idempotent", idem),
            ("π self-adjoint", adjoint),
            ("closed under transpose", transpose),
            ("closed under products", product),
            ("closed under inverse", inverse),
            ("A⁻¹ R A = R (logits invariant)", logits),
            ("generic gl(h) does not commute", generic),
        ]
        ok, detail = _combine(parts)
        if not dim_ok:
            return False, f"commutant of R₁ has dim {len(N)}, library says {sub.dim()}"
        return ok, detail

    return run_check("rotary commutant", "RoPE", subalgebra_label(sub), "symbolic", run)


# -- 2. vertical space and horizontal condition ----------------------------------------------
def _action(block: GLBlock, N: list[sp.Matrix]):
    """``ψ(I + Σ ω_a N_a, x)`` on coordinate vectors, and the parameters ``ω``."""
    omega = tuple(sp.Symbol(f"omega_{a}") for a in range(len(N)))

    def action(x, om):
        A = sp.eye(block.h) + sum((w * Na for w, Na in zip(om, N)), sp.zeros(block.h, block.h))
        XG, XH = block.unvec(x)
        return block.vec(XG * A.inv(), XH * A.T)  # A is sparse: Gaussian elimination is cheap

    return action, omega


def _derived_vertical(block: GLBlock, N: list[sp.Matrix]) -> tuple[sp.Matrix, ZeroTest]:
    """The derived vertical basis ``∂_ω ψ(I + Σ ω_a N_a, x)`` at ``ω = 0`` and the proof that
    its columns are the library's ``vertical(G, H, −N_a)``."""
    action, omega = _action(block, N)
    V = vertical_basis(action, block.coords, omega)
    S = block.sym
    lib = [block.vec(*(_M(t) for t in _glk.vertical(S(block.G), S(block.H), SymTensor(-Na))))
           for Na in N]
    return V, prove_zero([V[i, a] - lib[a][i] for a in range(len(N)) for i in range(V.rows)])


def _weighted(block: GLBlock, metric: str, eps: sp.Expr):
    """Metric weights and the library's Gram tuple: inv with free symmetric ``W_P, W_Q`` for
    ``P⁻¹, Q⁻¹`` (so identities hold for every value, including the true one), mix with the
    concrete ``Q, P``."""
    h = block.h
    P, Q = block.grams()
    if metric == "inv":
        WP, WQ = symmetric_symbols("wp", h), symmetric_symbols("wq", h)
        gr = _glk.Grams(SymTensor(P), SymTensor(Q), SymTensor(WP), SymTensor(WQ), None, None, eps)
        return (WP, WQ), gr
    gr = _glk.Grams(SymTensor(P), SymTensor(Q), None, None, None, None, eps)
    return (Q, P), gr


def _weighted_metric(block: GLBlock, weights) -> Callable:
    WG, WH = weights

    def g(x, y) -> sp.Expr:
        (xG, xH), (yG, yH) = block.unvec(x), block.unvec(y)
        return (WG * xG.T * yG).trace() + (WH * xH.T * yH).trace()

    return g


def check_vertical_subgroup(
    n: int,
    m: int,
    sub: sg.RotaryCommutant,
    metric: str,
    residual: Callable = sg.horizontal_residual,
    eps: sp.Expr = sp.S.Zero,
) -> CheckResult:
    r"""The library's horizontal residual $\pi_{\mathfrak k} D(\xi)$ vanishes exactly on the
    metric-orthogonal complement of the derived vertical space of the subgroup action.

    The action is $(G A^{-1}, H A^\top)$ with $A = I + \sum_a \omega_a N_a$, $N_a$ the exact
    commutant of the rational rotation; the vertical basis is its derivative at $\omega = 0$.
    Proves that $\langle \xi, (G Y, -H Y^\top)\rangle = \langle D(\xi), Y\rangle_F$ for every
    $Y \in \mathfrak{gl}(h)$ (metric with free symmetric weights for inv), that the derived
    vertical space is $\{(G X, -H X^\top) : X \in \mathfrak k\}$, and that the derived
    horizontal conditions and the coordinates of the library residual have the same row space.
    """
    h = sub.h
    block = GLBlock(n, m, h, eps)

    def run() -> Outcome:
        S = block.sym
        N = commutant_basis(sub)
        V, spans = _derived_vertical(block, N)
        weights, gr = _weighted(block, metric, eps)
        g = _weighted_metric(block, weights)
        xi = block.tangent("xi")
        flat = block.vec(*xi)
        Y = _unknown(h, "y")
        vY = [_M(t) for t in _glk.vertical(S(block.G), S(block.H), SymTensor(Y))]
        D = _M(sg.vertical_dual(S(block.G), S(block.H), S(xi[0]), S(xi[1]), gr, metric))
        dual = prove_zero([g(flat, block.vec(*vY)) - _frob(D, Y)])
        Rlib = _M(residual(S(block.G), S(block.H), S(xi[0]), S(xi[1]), gr, metric, sub))
        in_k = prove_zero(list(sym_project(sub, Rlib) - Rlib))
        # V_a = ∂_ω ψ = (−G N_a, H N_aᵀ): g(V_a, ξ) = −⟨N_a, residual⟩ for every a
        conds = [g(list(V[:, a]), flat) + _frob(Na, Rlib) for a, Na in enumerate(N)]
        ok, detail = _combine([
            ("derived vertical = (GX, −HXᵀ), X ∈ k", spans),
            ("⟨ξ, V(Y)⟩ = ⟨D(ξ), Y⟩_F", dual),
            ("residual ∈ k", in_k),
            ("g(V_a, ξ) = −⟨N_a, residual⟩", prove_zero(conds)),
        ])
        return ok, detail

    return run_check("vertical+horizontal", f"subgroup {metric}", f"n={n},m={m},"
                     + subalgebra_label(sub), "symbolic", run)


# -- 3. the projection -------------------------------------------------------------------------
def _direct_projection(block: GLBlock, sub, metric: str, solve: Solver) -> Outcome:
    """Concrete ``G, H`` and the coordinate metric of Eq. 9/10: Π(ξ) = ξ + V(X),
    X = solve(D(ξ)); idempotency from ``solve`` reading only ``π(R)`` at the same point."""
    S = block.sym
    gr = block.code_grams()
    N = commutant_basis(sub)
    V, spans = _derived_vertical(block, N)
    g = block.coordinate_metric(metric)
    xi = block.tangent("xi")
    D = sg.vertical_dual(S(block.G), S(block.H), S(xi[0]), S(xi[1]), gr, metric)
    X = _M(solve(D, gr, metric, sub))
    vG, vH = _glk.vertical(S(block.G), S(block.H), SymTensor(X))
    pi = block.vec(xi[0] + _M(vG), xi[1] + _M(vH))
    Y = _unknown(block.h, "y")
    X0 = _M(solve(SymTensor(Y - sym_project(sub, Y)), gr, metric, sub))
    return _combine([
        ("derived vertical = V(k)", spans),
        ("X ∈ k (Π(ξ) − ξ vertical)", prove_zero(list(sym_project(sub, X) - X))),
        ("g-orthogonal to derived vertical", prove_zero(horizontal_conditions(g, V, pi))),
        ("solve reads π(R) only (idempotent)", prove_zero(list(X0))),
    ])


def _in_k(N: list[sp.Matrix], name: str) -> sp.Matrix:
    """A generic element ``Σ_a name_a N_a`` of k."""
    h = N[0].shape[0]
    return sum((sp.Symbol(f"{name}_{a}") * Na for a, Na in enumerate(N)), sp.zeros(h, h))


def _equation_projection(block: GLBlock, sub, metric: str, solve: Solver | None) -> Outcome:
    r"""The documented equation is the metric-orthogonal projection (free-symbol identities).

    With concrete ``G, H``, generic $\xi$, generic $X, Y \in \mathfrak k$ and metric weights
    (inv: free symmetric $W_P, W_Q$ for $P^{-1}, Q^{-1}$, so the identities hold at every
    point; mix: the concrete $Q, P$):

    1. the derived vertical space of the action is $V(\mathfrak k)$;
    2. $\langle\xi, V(Y)\rangle = \langle D(\xi), Y\rangle_F$ for every
       $Y \in \mathfrak{gl}(h)$ (library ``vertical_dual``) and $D(V(Y)) = L(Y)$ (library
       ``dual_operator``);
    3. $\pi$ is idempotent and Frobenius-self-adjoint (library ``project``);
    4. $\langle \xi + V(X), V(Y)\rangle = \langle \pi(D(\xi) + L(X)), Y\rangle_F$: so
       $\Pi\xi = \xi + V(X)$ is orthogonal to every vertical vector iff $X$ solves the
       documented equation $\pi(D(\xi) + L(X)) = 0$, and $\Pi\xi - \xi$ is vertical;
    5. $\langle Y, L(Y)\rangle_F = \|V(Y)\|^2$: the system is symmetric positive definite for
       full-rank factors, so it has exactly one solution, $X = 0$ when $\xi$ is already
       horizontal ($\Pi$ is idempotent).

    With a ``solve``, also (free symmetric Gram fields, generic $R$): ``solve(R)`` lies in
    $\mathfrak k$, solves $\pi(R + L(X)) = 0$, and ``solve(Y − π(Y)) = 0``.
    """
    h, eps = block.h, block.eps
    S = block.sym
    N = commutant_basis(sub)
    _, spans = _derived_vertical(block, N)
    weights, gr = _weighted(block, metric, eps)
    g = _weighted_metric(block, weights)
    xi = block.tangent("xi")

    def V(M: sp.Matrix) -> list[sp.Expr]:
        return block.vec(*(_M(t) for t in _glk.vertical(S(block.G), S(block.H), SymTensor(M))))

    def L(M: sp.Matrix, grams=gr) -> sp.Matrix:
        return _M(sg.dual_operator(SymTensor(M), grams, metric))

    def D(u: list[sp.Expr]) -> sp.Matrix:
        uG, uH = block.unvec(u)
        return _M(sg.vertical_dual(S(block.G), S(block.H), S(uG), S(uH), gr, metric))

    flat = block.vec(*xi)
    Yg = _unknown(h, "y")
    dual = prove_zero([g(flat, V(Yg)) - _frob(D(flat), Yg)])
    op = prove_zero(list(D(V(Yg)) - L(Yg)))
    Z = _unknown(h, "z")
    PY, PZ = sym_project(sub, Yg), sym_project(sub, Z)
    proj = prove_zero(list(sym_project(sub, PY) - PY) + [_frob(PY, Z) - _frob(Yg, PZ)])
    X, Y = _in_k(N, "x"), _in_k(N, "y")
    moved = [a + b for a, b in zip(flat, V(X))]
    orth = prove_zero([g(moved, V(Y)) - _frob(sym_project(sub, D(flat) + L(X)), Y)])
    spd = prove_zero([_frob(Y, L(Y)) - g(V(Y), V(Y))])
    parts = [
        ("derived vertical = V(k)", spans),
        ("⟨ξ, V(Y)⟩ = ⟨D(ξ), Y⟩_F", dual),
        ("D(V(Y)) = L(Y)", op),
        ("π idempotent, self-adjoint", proj),
        ("⟨ξ + V(X), V(Y)⟩ = ⟨π(D(ξ) + L(X)), Y⟩", orth),
        ("⟨Y, L(Y)⟩ = ‖V(Y)‖² (unique solution)", spd),
    ]
    if solve is not None:
        Pa, Qa = symmetric_symbols("p", h), symmetric_symbols("q", h)
        if metric == "inv":
            gra = _glk.Grams(SymTensor(Pa), SymTensor(Qa), SymTensor(symmetric_symbols("wp", h)),
                           SymTensor(symmetric_symbols("wq", h)), None, None, eps)
        else:
            gra = _glk.Grams(SymTensor(Pa), SymTensor(Qa), None, None, None, None, eps)
        R = _unknown(h, "r")
        Xs = _M(solve(SymTensor(R), gra, metric, sub))
        X0 = _M(solve(SymTensor(Yg - PY), gra, metric, sub))
        parts += [
            ("solve(R) ∈ k", prove_zero(list(sym_project(sub, Xs) - Xs))),
            ("π(R + L(solve(R))) = 0", prove_zero(list(sym_project(sub, R + L(Xs, gra))))),
            ("solve(Y − π(Y)) = 0", prove_zero(list(X0))),
        ]
    return _combine(parts)


def check_projection_subgroup(
    n: int,
    m: int,
    sub: sg.RotaryCommutant,
    metric: str,
    solve: Solver | None = documented_x,
    mode: str = "equation",
    eps: sp.Expr = sp.S.Zero,
) -> CheckResult:
    r"""$\Pi(\xi) = (\xi_G + G X, \xi_H - H X^\top)$ with $X \in \mathfrak k$ solving
    $\pi_{\mathfrak k}(D(\xi) + L(X)) = 0$ is the metric-orthogonal projection onto the
    horizontal space of the subgroup quotient.

    ``mode="equation"``: the identities of `_equation_projection` (any size; with a
    ``solve``, that solver is also proven to solve the equation, which is only feasible for
    small $\dim\mathfrak k$; ``solve=None`` proves the equation alone).  ``mode="direct"``:
    concrete $G, H$ and the coordinate metric of Eq. 9/10, $X$ = ``solve``$(D(\xi))$; proves
    $X \in \mathfrak k$, $g(V_a, \Pi\xi) = 0$ for every derived vertical $V_a$, and that
    ``solve`` reads only $\pi_{\mathfrak k} R$ (slow: minutes at $h = 2$).
    """
    block = GLBlock(n, m, sub.h, eps)
    if mode not in ("equation", "direct"):
        raise ValueError(f"mode must be 'equation' or 'direct', got {mode!r}")

    def run() -> Outcome:
        if mode == "direct":
            if solve is None:
                raise ValueError("mode='direct' needs a solve (solve=None proves the "
                                 "equation alone)")
            return _direct_projection(block, sub, metric, solve)
        return _equation_projection(block, sub, metric, solve)

    what = mode if mode == "direct" or solve is None else f"{mode}+solver"
    sizes = f"n={n},m={m}," + subalgebra_label(sub) + (",ε" if eps != 0 else "")
    return run_check("projection", f"subgroup {metric} ({what})", sizes, "symbolic", run)


# -- 4. numeric bridge -------------------------------------------------------------------------
def subgroup_projection_bridge(
    n: int,
    m: int,
    sub: sg.RotaryCommutant,
    metric: str,
    eps: float = 0.0,
    seed: int = 0,
    points: int = 3,
    project: Callable | None = None,
) -> CheckResult:
    r"""The torch projection equals the $g$-orthogonal projection derived from the metric.

    $\Pi\xi = \xi - V (V^\top g V)^{-1} V^\top g\, \xi$ with $g$ the lambdified coordinate
    metric (relaxed by `eps`) and $V$ the derived vertical basis of the subgroup action.
    `project(G, H, uG, uH, grams, metric, sub)` (torch) defaults to
    [project][quotient_manifolds.geometry.subgroup.project].
    """
    block = GLBlock(n, m, sub.h, sp.nsimplify(eps))
    project = project or sg.project

    def run() -> Outcome:
        N = commutant_basis(sub)
        action, omega = _action(block, N)
        V = vertical_basis(action, block.coords, omega)
        cm = block.coordinate_metric(metric)
        g_fn = sp.lambdify([list(block.coords)], cm.matrix, cse=True)
        v_fn = sp.lambdify([list(block.coords)], V, cse=True)
        rng = np.random.default_rng(seed)
        err = 0.0
        for _ in range(points):
            x = rng.standard_normal((n + m, sub.h)) / np.sqrt(sub.h) + 0.5 * np.eye(n + m, sub.h)
            xi = rng.standard_normal((n + m, sub.h))
            g = np.asarray(g_fn(x.ravel()), dtype=float)
            Vx = np.asarray(v_fn(x.ravel()), dtype=float)
            c = np.linalg.solve(Vx.T @ g @ Vx, Vx.T @ g @ xi.ravel())
            ref = xi.ravel() - Vx @ c
            G, H = torch.from_numpy(x[:n]), torch.from_numpy(x[n:])
            pG, pH = project(G, H, torch.from_numpy(xi[:n]), torch.from_numpy(xi[n:]),
                             gl.grams(G, H, eps), metric, sub)
            got = torch.cat([pG, pH]).numpy().ravel()
            err = max(err, float(np.max(np.abs(got - ref)) / max(1.0, np.max(np.abs(ref)))))
        return err <= 1e-9, f"max rel err proju {err:.1e}"

    sizes = f"n={n},m={m}," + subalgebra_label(sub) + (f",eps={eps:g}" if eps else "")
    return run_check("projection", f"subgroup {metric} (bridge)", sizes, "numeric", run)
