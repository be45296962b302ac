"""Symbolic verification (quotient_manifolds.symbolic): engine, checks, wrong candidates, CLI.

The default suite runs the quick subset of ``python -m quotient_manifolds.symbolic``;
the larger sizes are marked ``slow``.  Every check must also *fail* on a wrong
formula: the paper's printed typos (docs/corrections.md) and hand-made mistakes are
injected through the checks' candidate arguments.
"""

from __future__ import annotations

import io

import pytest
import sympy as sp
import torch

from quotient_manifolds.geometry import adaptive as ad
from quotient_manifolds.geometry import diagonal as dm
from quotient_manifolds.geometry import gl
from quotient_manifolds.symbolic import cli
from quotient_manifolds.symbolic import main as symbolic_main
from quotient_manifolds.symbolic.algebra import PROVEN, REFUTED, prove_equal, prove_zero
from quotient_manifolds.symbolic.bridge import NumericMetric, christoffel_bridge, retraction_bridge
from quotient_manifolds.symbolic.candidates import (
    christoffel_mix_without_h_part,
    paper_inv_horizontal_residual,
    paper_sylvester_lambda,
    sylvester_lambda,
)
from quotient_manifolds.symbolic.checks import (
    CheckResult,
    check_christoffel_adaptive,
    check_christoffel_diagonal,
    check_christoffel_gl,
    check_christoffel_gl_quadratic,
    check_christoffel_scalar_toy,
    check_geodesic_adaptive,
    check_geodesic_diagonal,
    check_invariance_diagonal,
    check_invariance_gl,
    check_projection_diagonal,
    check_projection_gl,
    check_retraction_diagonal,
    check_rgrad_diagonal,
    check_rgrad_gl,
    check_vertical_gl,
    closed_form_geodesic,
    diagonal_rgrad_unprojected,
)
from quotient_manifolds.symbolic.models import DiagonalModel, GLBlock
from quotient_manifolds.symbolic.riemann import (
    CoordinateMetric,
    span_relation,
    vertical_basis,
)
from quotient_manifolds.symbolic.tensor import SymTensor

torch.set_num_threads(1)


def _assert_pass(r: CheckResult) -> None:
    assert r.passed, f"{r.check} {r.subject} {r.sizes}: {r.detail}"


def _assert_fail(r: CheckResult, reason: str = "refuted") -> None:
    """The candidate is rejected for the right reason (a counterexample, not a crash)."""
    assert not r.passed, f"wrong candidate accepted by {r.check} {r.subject} {r.sizes}"
    assert reason in r.detail, f"rejected for another reason: {r.detail}"


# -- the derivation engine against textbook results ---------------------------------
def test_christoffel_polar_coordinates():
    r, th = sp.symbols("r theta")
    cs = CoordinateMetric(sp.diag(1, r**2), [r, th]).christoffel()
    assert sp.simplify(cs[0, 1, 1] + r) == 0  # Γ^r_θθ = −r
    assert sp.simplify(cs[1, 0, 1] - 1 / r) == 0  # Γ^θ_rθ = 1/r
    assert sp.simplify(cs[1, 1, 0] - 1 / r) == 0
    assert cs[0, 0, 0] == 0 and cs[1, 1, 1] == 0 and cs[0, 0, 1] == 0


def test_christoffel_hyperbolic_half_plane_and_geodesics():
    x, y, t = sp.symbols("x y t", positive=True)
    g = CoordinateMetric(sp.diag(1 / y**2, 1 / y**2), [x, y])
    cs = g.christoffel()
    expected = {(0, 0, 1): -1 / y, (1, 0, 0): 1 / y, (1, 1, 1): -1 / y}
    for lam in range(2):
        for mu in range(2):
            for nu in range(2):
                key = (lam, min(mu, nu), max(mu, nu))
                assert sp.simplify(cs[lam, mu, nu] - expected.get(key, 0)) == 0
    # vertical lines y = e^t are geodesics; y = 1 + t is not
    assert prove_zero(g.geodesic_residual([sp.S(1), sp.exp(t)], t)).verdict == PROVEN
    assert prove_zero(g.geodesic_residual([sp.S(1), 1 + t], t)).verdict == REFUTED
    eqs = g.geodesic_equations(t)
    assert len(eqs) == 2 and all(isinstance(e, sp.Eq) for e in eqs)


def test_inverse_metric_blockwise():
    model = DiagonalModel(2)
    g = model.coordinate_metric("mix")
    assert sp.simplify(g.inverse() * g.matrix - sp.eye(4)) == sp.zeros(4)
    block = GLBlock(2, 2, 2)
    gb = block.coordinate_metric("inv")
    assert [len(b) for b in gb.blocks()] == [2, 2, 2, 2]


def test_prove_zero_verdicts():
    a, b = sp.symbols("a b")
    assert prove_zero((a + b) ** 2 - a**2 - 2 * a * b - b**2).ok
    assert prove_zero(1 / (a - b) - 1 / (b - a) * -1).ok
    bad = prove_zero([0, a / (a + b) - 1])
    assert bad.verdict == REFUTED and "component" in bad.detail
    assert prove_zero(sp.exp(a) * sp.exp(b) - sp.exp(a + b)).ok
    assert not prove_equal([sp.sqrt(1 + 2 * a) ** 2], [1 + a]).ok


def test_span_relation_detects_different_spans():
    u, v = sp.symbols("u v")
    V = sp.Matrix([u, -v])
    assert span_relation(V, sp.Matrix([2 * u, -2 * v])).same_span
    assert not span_relation(V, sp.Matrix([u, v])).test.ok


def test_vertical_basis_of_diagonal_action():
    model = DiagonalModel(1)
    V = vertical_basis(model.action, model.coords, model.group_params())
    assert V == sp.Matrix([model.u[0], -model.v[0]])


def test_symtensor_follows_torch_semantics():
    a = SymTensor([[1, 2], [3, 4]])
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = (0.5 * (a @ a.transpose(-1, -2)) - a * a / 2).to_matrix()
    want = 0.5 * (t @ t.T) - t * t / 2
    assert got == sp.Matrix(want.tolist()).applyfunc(sp.nsimplify)
    assert (a.sum((-2, -1))).item() == 10
    d = SymTensor([1, 2])
    assert (d.unsqueeze(-1) + d.unsqueeze(-2)).to_matrix() == sp.Matrix([[2, 3], [3, 4]])


def test_numeric_metric_matches_symbolic_christoffel():
    import numpy as np

    block = GLBlock(2, 2, 1)
    g = block.coordinate_metric("mix")
    num = NumericMetric(g)
    cs = g.christoffel()
    x, xi = np.array([0.7, -1.2, 0.4, 1.5]), np.array([0.3, 0.1, -0.2, 0.5])
    xs = [sp.Float(v) for v in xi]
    sym = [float(e.xreplace(dict(zip(g.coords, x.tolist())))) for e in cs.contract(xs)]
    np.testing.assert_allclose(num.christoffel(x, xi, xi), sym, rtol=1e-12)


# -- the registered quick suite (same rows as `--quick`) -----------------------------
QUICK = cli.select(quick=True)
FULL_ONLY = [e for e in cli.SUITE if not e.quick]


@pytest.mark.parametrize("entry", QUICK, ids=[e.label for e in QUICK])
def test_quick_check(entry):
    _assert_pass(entry.run())


@pytest.mark.slow
@pytest.mark.parametrize("entry", FULL_ONLY, ids=[e.label for e in FULL_ONLY])
def test_full_check(entry):
    _assert_pass(entry.run())


# -- wrong formulas must fail --------------------------------------------------------
def test_mix_christoffel_without_h_part_fails():
    _assert_fail(check_christoffel_gl(2, 2, 1, "mix", candidate=christoffel_mix_without_h_part))
    # the H part is irrelevant for inv, so the same candidate passes there
    _assert_pass(check_christoffel_gl(2, 2, 1, "inv", candidate=christoffel_mix_without_h_part))


@pytest.mark.slow
def test_mix_christoffel_without_h_part_fails_h2():
    _assert_fail(check_christoffel_gl(3, 2, 2, "mix", candidate=christoffel_mix_without_h_part))


def test_inv_christoffel_missing_term_fails():
    def wrong(G, H, uG, uH, vG, vH, gr, metric):
        cG, cH = gl.christoffel(G, H, uG, uH, vG, vH, gr, metric)
        extra = G @ (gr.P_inv @ (uG.transpose(-1, -2) @ vG))  # drop ½G P⁻¹(ξᵀη + ηᵀξ)
        return cG - extra, cH

    _assert_fail(check_christoffel_gl(2, 2, 1, "inv", candidate=wrong))


def test_relaxed_christoffel_must_use_relaxed_grams():
    eps = sp.Symbol("epsilon", positive=True)

    def unrelaxed(G, H, uG, uH, vG, vH, gr, metric):
        P = G.transpose(-1, -2) @ G
        Q = H.transpose(-1, -2) @ H
        P_inv = SymTensor(P.to_matrix().inv())
        Q_inv = SymTensor(Q.to_matrix().inv())
        gr0 = gr._replace(P=P, Q=Q, P_inv=P_inv, Q_inv=Q_inv)
        return gl.christoffel(G, H, uG, uH, vG, vH, gr0, metric)

    _assert_fail(check_christoffel_gl(2, 2, 1, "inv", candidate=unrelaxed, eps=eps))


def test_wrong_diagonal_and_toy_christoffel_fail():
    def flipped(u, v, xu, xv, yu, yv, metric):
        cu, cv = dm.christoffel(u, v, xu, xv, yu, yv, metric)
        return -cu, cv

    _assert_fail(check_christoffel_diagonal(2, "inv", candidate=flipped))
    _assert_fail(check_christoffel_diagonal(2, "mix", candidate=flipped))
    _assert_fail(check_christoffel_scalar_toy(diag_candidate=flipped))

    def no_eps(w, u, v, eps):
        return ad.christoffel(w, u, v, 0)

    _assert_fail(check_christoffel_adaptive(candidate=no_eps))


def test_wrong_geodesics_fail():
    _assert_fail(check_geodesic_diagonal(None, "mix", curve=lambda x, b, t: x * (1 + b * t)))
    mix_curve = closed_form_geodesic("mix")
    _assert_fail(check_geodesic_diagonal(None, "inv", curve=mix_curve))
    _assert_fail(check_geodesic_diagonal(None, "mix", curve=lambda x, b, t: x * sp.exp(b * t)))


def test_wrong_adaptive_geodesic_fails():
    def no_eps(w, xi, eps, t):
        return w * sp.exp(t * xi / w)

    _assert_fail(check_geodesic_adaptive(curve=no_eps))


def test_retraction_coefficient_minus_two_fails():
    # Alg. 1 line 3 printed with −2Γ in some renderings
    _assert_fail(check_retraction_diagonal(2, "inv", coefficient=-2))
    _assert_fail(check_retraction_diagonal(2, "mix", coefficient=-2))
    _assert_fail(check_retraction_diagonal(2, "mix", coefficient=sp.Rational(1, 2)))


def test_paper_sylvester_fails_for_h2_only():
    # AΛ + ΛAᵀ = B (paper) vs AΩ + ΩA = B, Λ = Ωᵀ (docs/corrections.md)
    _assert_fail(check_projection_gl(2, 2, 2, "inv", lam=paper_sylvester_lambda))
    # for h = 1 both equations coincide
    _assert_pass(check_projection_gl(2, 2, 1, "inv", lam=paper_sylvester_lambda))


def test_wrong_projections_fail():
    # for h ≥ 2 the inv solution is not the mix projection (for h = 1 they coincide)
    _assert_fail(check_projection_gl(2, 2, 2, "mix", lam=sylvester_lambda, mode="factored"))
    _assert_pass(check_projection_gl(2, 2, 1, "mix", lam=sylvester_lambda))

    def half(G, H, uG, uH, gr, metric):
        return 0.5 * gl.horizontal_lambda(G, H, uG, uH, gr, metric)

    _assert_fail(check_projection_gl(2, 2, 1, "mix", lam=half))

    def one_sided(u, v, eu, ev):
        b = eu / u
        return b * u, b * v

    _assert_fail(check_projection_diagonal(2, "inv", project=one_sided))


def test_paper_inv_horizontal_condition_fails():
    # only evaluable when m = h; there it is not the orthogonal complement
    _assert_fail(check_vertical_gl(2, 2, 2, "inv", residual=paper_inv_horizontal_residual))
    _assert_fail(check_vertical_gl(2, 2, 2, "inv", residual=gl_mix_residual_as_inv))
    _assert_pass(check_vertical_gl(2, 2, 1, "inv"))


def gl_mix_residual_as_inv(G, H, uG, uH, gr, metric):
    return gl.horizontal_residual(G, H, uG, uH, gr, "mix")


def test_wrong_vertical_fails():
    def transposed_sign(G, H, lam):
        return G @ lam, H @ lam.transpose(-1, -2)

    _assert_fail(check_vertical_gl(2, 2, 1, "mix", vertical=transposed_sign))


def test_wrong_rgrad_fails():
    def swapped(gG, gH, gr, metric):
        return gl.egrad2rgrad(gG, gH, gr, "mix" if metric == "inv" else "inv")

    _assert_fail(check_rgrad_gl(2, 2, 1, "inv", rgrad=swapped))
    _assert_fail(check_rgrad_gl(2, 2, 1, "mix", rgrad=swapped))

    def swapped_diag(u, v, gu, gv, metric):
        return diagonal_rgrad_unprojected(u, v, gu, gv, "mix" if metric == "inv" else "inv")

    _assert_fail(check_rgrad_diagonal(2, "inv", rgrad=swapped_diag))


def test_wrong_inner_fails_invariance():
    def euclidean(G, H, uG, uH, vG, vH, gr, metric):
        return (uG * vG).sum((-2, -1)) + (uH * vH).sum((-2, -1))

    _assert_fail(check_invariance_gl(2, 2, 1, "inv", inner=euclidean))

    def swapped(u, v, eu, ev, fu, fv, metric):
        return dm.inner_terms(u, v, eu, ev, fu, fv, "mix" if metric == "inv" else "inv")

    _assert_fail(check_invariance_diagonal(2, "inv", inner=swapped))


def test_numeric_bridge_rejects_wrong_torch_christoffel():
    from quotient_manifolds import GLQuotient

    man = GLQuotient(2, 2, "mix")

    def no_h(x, u, v):
        out = man.christoffel(x, u, v).clone()
        out[..., 2:, :] = 0
        return out

    _assert_fail(christoffel_bridge(2, 2, 1, "mix", candidate=no_h), reason="max rel err")


def test_wrong_transpose_in_the_quadratic_christoffel_fails(monkeypatch):
    """The quadratic fast path Γ(ξ, ξ) (what the retractions run) is proven on its own."""
    from quotient_manifolds.geometry.linalg import transpose

    orig = gl._christoffel_inv_factor

    def wrong(F, M_inv, u, v):
        if v is None:  # S + S instead of S + Sᵀ
            S = transpose(u) @ F
            return F @ (M_inv @ (transpose(u) @ u)) - u @ (M_inv @ (S + S))
        return orig(F, M_inv, u, v)

    monkeypatch.setattr(gl, "_christoffel_inv_factor", wrong)
    _assert_fail(check_christoffel_gl_quadratic(2, 2, 2, "inv"))
    _assert_pass(check_christoffel_gl(2, 2, 1, "inv"))  # the polarised path is untouched


def test_retraction_bridge_rejects_wrong_second_order():
    from quotient_manifolds import GLQuotient

    def plus_half(x, u):  # x + u + ½Γ: the wrong sign
        man = GLQuotient(6, 5, "mix")
        return x + u + 0.5 * man.christoffel(x, u)

    _assert_fail(retraction_bridge(6, 5, 3, "mix", candidate=plus_half), reason="max rel err")


def test_crashing_candidate_is_a_failure():
    def boom(*args):
        raise RuntimeError("boom")

    r = check_christoffel_gl(2, 2, 1, "inv", candidate=boom)
    assert not r.passed and "RuntimeError" in r.detail


# -- command line ----------------------------------------------------------------------
def test_main_runs_selected_checks(capsys):
    assert symbolic_main(["--quick", "-k", "christoffel diagonal"]) == 0
    out = capsys.readouterr().out
    assert "christoffel" in out and "PASS" in out and "2/2 passed" in out


def test_main_list_and_no_match(capsys):
    assert symbolic_main(["--list", "--quick"]) == 0
    listed = capsys.readouterr().out.strip().splitlines()
    assert len(listed) == len(QUICK)
    assert symbolic_main(["-k", "no such check"]) == 2


def test_main_exits_nonzero_on_failure(monkeypatch, capsys):
    bad = cli.Entry(
        "wrong mix Γ",
        lambda: check_christoffel_gl(2, 2, 1, "mix", candidate=christoffel_mix_without_h_part),
        True,
    )
    monkeypatch.setattr(cli, "SUITE", [bad])
    assert symbolic_main(["--quick"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_markdown_table():
    import dataclasses

    r = CheckResult("christoffel", "GL inv", "n=2,m=2,h=1", "symbolic", True, 0.5, "")
    md = cli.format_table([r], markdown=True)
    assert md.splitlines()[0].startswith("| check |") and "PASS" in md
    failed = dataclasses.replace(r, passed=False, detail="why")
    assert "FAIL christoffel GL inv n=2,m=2,h=1: why" in cli.format_table([failed])


def test_latex_sections():
    from quotient_manifolds.symbolic import latex

    toy = "\n".join(latex._toy())
    # derived scalar-toy symbols Γ^G_GG = −1/G, Γ^H_HH = −1/H, rendered by sympy.latex
    assert "\\Gamma^{G}_{GG} = " + sp.latex(-1 / sp.Symbol("G")) in toy
    assert "\\Gamma^{H}_{HH} = " + sp.latex(-1 / sp.Symbol("H")) in toy
    assert "**proven**" in toy and "FAILED" not in toy
    diag = "\n".join(latex._diagonal())
    assert "\\Gamma^{v}_{uu} = " + sp.latex(-sp.Symbol("v") / sp.Symbol("u") ** 2) in diag


@pytest.mark.slow
def test_latex_derivations(capsys):
    assert symbolic_main(["--latex"]) == 0
    out = capsys.readouterr().out
    assert "\\Gamma" in out and "Sylvester" in out and "FAILED" not in out
    assert out.count("**rejected**") >= 3


def test_stream_output():
    buf = io.StringIO()
    results = cli.run_suite(cli.select(quick=True, pattern="projection diagonal"), buf)
    assert len(results) == 2 and all(r.passed for r in results)
    assert buf.getvalue().count("PASS") == 2


def test_top_level_cli_runs_verify(capsys):
    from quotient_manifolds.cli import main as cli_main

    assert cli_main(["verify", "--list", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "christoffel" in out and out.count("\n") >= 10
    assert cli_main(["verify", "--quick", "-k", "christoffel diagonal inv"]) == 0
