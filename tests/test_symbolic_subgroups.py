"""Symbolic checks of the subgroup quotients: wrong candidates must fail, SymPy = torch.

The registered quick checks themselves run in ``test_symbolic.py`` (``cli.select``).
"""

from __future__ import annotations

import numpy as np
import sympy as sp
import torch

from quotient_manifolds.geometry import gl
from quotient_manifolds.geometry import subgroup as sg
from quotient_manifolds.symbolic.checks import CheckResult
from quotient_manifolds.symbolic.models import symmetric_symbols
from quotient_manifolds.symbolic.subgroups import (
    check_projection_subgroup,
    check_rotary_commutant,
    check_vertical_subgroup,
    commutant_basis,
    documented_x,
    gl_lambda_then_project,
    rational_rotation,
    subgroup_projection_bridge,
)
from quotient_manifolds.symbolic.tensor import SymTensor

RC = sg.RotaryCommutant


def _assert_fail(r: CheckResult, reason: str = "refuted") -> None:
    assert not r.passed, f"wrong candidate accepted by {r.check} {r.subject} {r.sizes}"
    assert reason in r.detail, f"rejected for another reason: {r.detail}"


def test_full_gl_lambda_then_project_is_rejected():
    for metric in ("inv", "mix"):
        r = check_projection_subgroup(2, 2, RC.rotate_half(2), metric,
                                      solve=gl_lambda_then_project)
        _assert_fail(r)
        assert "π(R + L(solve(R))) = 0" in r.detail


def test_wrong_subalgebra_projections_are_rejected():
    sub = RC.rotate_half(2)

    def gl_on_pairs(X):  # "the whole gl(2) of each rotary plane": does not commute with R(θ)
        return X

    def scale_only(X):  # drops the rotation part b: commutes, but misses half the commutant
        Y = X[..., [1, 0], :][..., :, [1, 0]]
        return (X + Y) * np.eye(2, dtype=np.int64) * 0.5

    r = check_rotary_commutant(sub, project=gl_on_pairs)
    _assert_fail(r)
    assert "commutes with R(θ)" in r.detail
    r = check_rotary_commutant(sub, project=scale_only)
    _assert_fail(r)
    assert "π = id on the commutant" in r.detail


def test_wrong_residuals_are_rejected():
    def unprojected(G, H, uG, uH, gr, metric, sub):  # the full-GL dual D(ξ), not π_k D(ξ)
        return sg.vertical_dual(G, H, uG, uH, gr, metric)

    def gl_residual(G, H, uG, uH, gr, metric, sub):  # GL's residual P Hᵀξ_H − ξ_GᵀGQ, projected
        return sub.project(gl.horizontal_residual(G, H, uG, uH, gr, metric))

    _assert_fail(check_vertical_subgroup(2, 2, RC.rotate_half(2), "inv", residual=unprojected))
    _assert_fail(check_vertical_subgroup(2, 2, RC.rotate_half(2), "inv", residual=gl_residual))


def test_bridge_rejects_the_torch_shortcut():
    def shortcut(G, H, uG, uH, gr, metric, sub):
        lam = sub.project(gl.horizontal_lambda(G, H, uG, uH, gr, metric))
        return uG + G @ lam, uH - H @ lam.mT

    for metric in ("inv", "mix"):
        r = subgroup_projection_bridge(4, 3, RC.rotate_half(2), metric, project=shortcut)
        assert not r.passed and "max rel err" in r.detail


def test_commutant_of_rational_rotation_is_the_library_subalgebra():
    for sub in (RC.rotate_half(4), RC.interleaved(6, 4), RC.rotate_half(5, 2)):
        R1 = rational_rotation(sub)
        assert sp.simplify(R1.T * R1 - sp.eye(sub.h)) == sp.zeros(sub.h)  # a true rotation
        N = commutant_basis(sub)
        assert len(N) == sub.dim()
        B = torch.tensor([[float(e) for e in Na] for Na in N]).reshape(-1, sub.h, sub.h)
        assert bool(sub.is_member(B).all())


def test_sympy_project_equals_torch():
    gen = torch.Generator().manual_seed(0)
    for sub in (RC.rotate_half(4), RC.interleaved(6, 2), sg.BlockDiagonal(3, ((0, 2), (1,)))):
        X = torch.randint(-5, 6, (sub.h, sub.h), generator=gen).double()
        sym = sub.project(SymTensor(sp.Matrix(X.int().tolist())))
        np.testing.assert_allclose(np.array(sym.tolist(), dtype=float), sub.project(X).numpy())


def test_torch_solver_equals_the_exact_solution_of_the_documented_equation():
    """horizontal_x (Schur + eigenbases) = documented_x (Cramer), lambdified, at random Grams."""
    rng = np.random.default_rng(0)
    for sub in (RC.rotate_half(2), RC.rotate_half(3, 2)):
        h = sub.h
        for metric in ("inv", "mix"):
            for eps in (0.0, 0.3):
                P, Q = symmetric_symbols("p", h), symmetric_symbols("q", h)
                Pi, Qi = symmetric_symbols("pi", h), symmetric_symbols("qi", h)  # P⁻¹, Q⁻¹
                R = sp.Matrix(h, h, lambda a, b: sp.Symbol(f"r_{a}{b}"))
                eps_s = sp.Rational(3, 10) if eps else sp.S.Zero
                gr_s = gl.Grams(SymTensor(P), SymTensor(Q), SymTensor(Pi), SymTensor(Qi), None,
                                None, eps_s)
                X = documented_x(SymTensor(R), gr_s, metric, sub).to_matrix()
                args = sorted(X.free_symbols, key=lambda s: s.name)
                f = sp.lambdify(args, X, "numpy")
                G, H = rng.standard_normal((h + 2, h)), rng.standard_normal((h + 1, h))
                uG, uH = rng.standard_normal((h + 2, h)), rng.standard_normal((h + 1, h))
                t = [torch.from_numpy(a) for a in (G, H, uG, uH)]
                gr = gl.grams(t[0], t[1], eps)
                Rt = sg.vertical_dual(*t, gr, metric).numpy()
                vals = {}
                for S_, T_ in ((P, gr.P), (Q, gr.Q), (Pi, gr.P_inv), (Qi, gr.Q_inv), (R, Rt)):
                    vals.update({S_[a, b]: float(T_[a, b]) for a in range(h) for b in range(h)})
                ref = np.asarray(f(*(vals[s] for s in args)), dtype=float)
                got = sg.horizontal_x(*t, gr, metric, sub).numpy()
                np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
