r"""Candidate formulas that the checks accept as arguments.

Every check in [`symbolic.checks`][quotient_manifolds.symbolic.checks] takes the formula
under test as an argument, with the library's kernel as default.  This module
holds the symbolic glue for the one kernel that cannot run on SymPy directly,
and the deliberately *wrong* variants (the paper's printed typos, see
[Corrections to the paper][corrections-to-the-paper])
that the checker must reject.

Horizontal ``Λ`` solvers share the signature of
[`geometry.gl.horizontal_lambda`][quotient_manifolds.geometry.gl.horizontal_lambda] minus ``basis``:
``(G, H, uG, uH, gr, metric) -> Λ``; the projection is then
``Π(ξ) = (ξ_G + GΛ, ξ_H − HΛᵀ)`` ([derivation][horizontal-projection]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sympy as sp
from sympy.polys.matrices import DomainMatrix

from ..geometry import gl as _gl
from .algebra import rational_field
from .models import SymGrams
from .tensor import SymTensor

# The torch kernels of `geometry`, applied here to SymTensor arguments (duck typing),
# hence typed Any.
gl: Any = _gl

__all__ = [
    "LambdaSolver",
    "solve_linear_matrix_equation",
    "library_lambda",
    "sylvester_lambda",
    "mix_relaxed_lambda",
    "paper_sylvester_lambda",
    "christoffel_mix_without_h_part",
    "paper_inv_horizontal_residual",
]

LambdaSolver = Callable[..., SymTensor]


def solve_linear_matrix_equation(
    residual: Callable[[sp.Matrix], sp.Matrix], shape: tuple[int, int]
) -> sp.Matrix:
    r"""Solve ``residual(X) = 0`` for ``X`` when ``residual`` is affine in ``X``.

    The system ``J x = b`` is assembled from the Jacobian; ``J⁻¹`` is computed
    exactly in the field ``QQ(…)`` of the symbols of ``J`` only
    (``DomainMatrix``), and ``x = J⁻¹ b`` is formed without expanding ``b``.
    """
    X = sp.Matrix(*shape, lambda i, j: sp.Dummy(f"x{i}{j}"))
    unknowns = list(X)
    res = sp.Matrix(residual(X)).reshape(len(unknowns), 1)
    J = res.jacobian(unknowns)
    b = -res.xreplace({x: 0 for x in unknowns})
    syms = tuple(sorted(J.free_symbols, key=lambda s: s.name))
    K = rational_field(syms)
    n = len(unknowns)
    Jd = DomainMatrix([[K.from_sympy(J[i, j]) for j in range(n)] for i in range(n)], (n, n), K)
    Jinv = [[e.as_expr() for e in row] for row in Jd.inv().to_list()]
    sol = [sp.Add(*[Jinv[i][k] * b[k, 0] for k in range(n)]) for i in range(n)]
    return sp.Matrix(*shape, sol)


def _parts(G, H, uG, uH, gr: SymGrams, metric: str):
    P, Q = gr.P.to_matrix(), gr.Q.to_matrix()
    eps = getattr(gr, "eps", 0) or 0
    eye = sp.eye(P.shape[0])
    rhs = gl.horizontal_residual(G, H, uG, uH, gr, metric).to_matrix()
    return P, Q, P - eps * eye, Q - eps * eye, rhs


def sylvester_lambda(
    G: SymTensor, H: SymTensor, uG: SymTensor, uH: SymTensor, gr: SymGrams,
    metric: str = "inv",
) -> SymTensor:
    r"""inv ``Λ`` from the [corrected Sylvester equation][sylvester-equation].

    $$
    AΩ + ΩA = B,\quad A = PQ,\quad B = P H^{\top} ξ_H - ξ_G^{\top} G Q,\quad Λ = Ω^{\top},
    $$

    with ``B`` computed by the library's
    [`horizontal_residual`][quotient_manifolds.geometry.gl.horizontal_residual] and the
    equation solved exactly.  With the relaxation ``ε`` the library documents
    ``(P Q̂) Ω + Ω (P̂ Q) = B`` with ``P̂ = P − εI``, ``Q̂ = Q − εI``; that is
    what is solved (it is the boxed equation at ``ε = 0``).  The torch solver
    returns this solution: see the numeric projection bridge.
    """
    P, Q, P_hat, Q_hat, B = _parts(G, H, uG, uH, gr, "inv")
    A1, A2 = P * Q_hat, P_hat * Q
    omega = solve_linear_matrix_equation(lambda W: A1 * W + W * A2 - B, B.shape)
    return SymTensor(omega.T)


def mix_relaxed_lambda(
    G: SymTensor, H: SymTensor, uG: SymTensor, uH: SymTensor, gr: SymGrams,
    metric: str = "mix",
) -> SymTensor:
    r"""mix ``Λ`` from ``Q Ω P̂ + Q̂ Ω P = C``, ``C = Hᵀ ξ_H P − Q ξ_Gᵀ G``, ``Λ = Ωᵀ``.

    The library documents this equation for ``ε > 0``; at ``ε = 0`` its
    solution is the closed form ``Λ = ½(ξ_Hᵀ H Q⁻¹ − P⁻¹ Gᵀ ξ_G)``.
    """
    P, Q, P_hat, Q_hat, R = _parts(G, H, uG, uH, gr, "mix")
    C = -R.T
    omega = solve_linear_matrix_equation(lambda W: Q * W * P_hat + Q_hat * W * P - C, C.shape)
    return SymTensor(omega.T)


def paper_sylvester_lambda(
    G: SymTensor, H: SymTensor, uG: SymTensor, uH: SymTensor, gr: SymGrams,
    metric: str = "inv",
) -> SymTensor:
    r"""**Wrong on purpose**: the paper's printed ``AΛ + ΛAᵀ = B`` ([why][sylvester-equation])."""
    P, Q, _, _, B = _parts(G, H, uG, uH, gr, "inv")
    A = P * Q
    lam = solve_linear_matrix_equation(lambda L: A * L + L * A.T - B, B.shape)
    return SymTensor(lam)


def library_lambda(
    G: SymTensor, H: SymTensor, uG: SymTensor, uH: SymTensor, gr: SymGrams,
    metric: str,
) -> SymTensor:
    r"""The library's ``Λ``
    ([`horizontal_lambda`][quotient_manifolds.geometry.gl.horizontal_lambda]).

    * mix, ``ε = 0``: the library's closed form, run on SymPy inputs;
    * otherwise the library solves a Sylvester-type equation in an
      eigenbasis (``torch.linalg.eigh``), which has no useful closed form;
      the equation it documents is solved exactly instead
      ([`sylvester_lambda`][quotient_manifolds.symbolic.candidates.sylvester_lambda],
      [`mix_relaxed_lambda`][quotient_manifolds.symbolic.candidates.mix_relaxed_lambda]), and the
      numeric projection bridge confirms that the torch solver returns its solution.
    """
    eps = getattr(gr, "eps", 0) or 0
    if metric == "mix":
        if eps == 0:
            return gl.horizontal_lambda(G, H, uG, uH, gr, metric)
        return mix_relaxed_lambda(G, H, uG, uH, gr, metric)
    return sylvester_lambda(G, H, uG, uH, gr, metric)


def christoffel_mix_without_h_part(
    G: SymTensor, H: SymTensor, uG: SymTensor, uH: SymTensor, vG: SymTensor, vH: SymTensor,
    gr: SymGrams, metric: str,
) -> tuple[SymTensor, SymTensor]:
    r"""**Wrong on purpose**: the library's Γ with the mix ``H`` part dropped.

    The paper prints only the ``G`` part of Eq. 12 and calls the ``H`` part
    "similar" ([derivation][christoffel-forms]); an implementation that forgets it has
    ``Γ_H = 0``.
    """
    cG, cH = gl.christoffel(G, H, uG, uH, vG, vH, gr, metric)
    if metric == "mix":
        cH = cH * 0
    return cG, cH


def paper_inv_horizontal_residual(
    G: SymTensor, H: SymTensor, uG: SymTensor, uH: SymTensor, gr: SymGrams,
    metric: str = "inv",
) -> SymTensor:
    r"""**Wrong on purpose**: the paper's printed inv condition ``ξ_GᵀGQ = P Hᵀ ξ_Hᵀ``.

    Dimensionally inconsistent unless ``m = h`` ([derivation][inv-horizontal]); where it
    can be evaluated it is not the metric-orthogonal complement of the
    vertical space.  The correct last factor is ``Hᵀ ξ_H``.
    """
    return gr.P @ (H.transpose(-1, -2) @ uH.transpose(-1, -2)) - (uG.transpose(-1, -2) @ G) @ gr.Q
