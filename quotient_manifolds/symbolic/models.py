r"""Coordinates, metrics and group actions of the geometries under test.

Each model writes down, independently of the library code, what the paper
*defines*: the coordinates, the metric as a quadratic form (Eq. 6/7, Eq. 9/10,
Eq. 18) and the group action (Def. 3.1, §5.1, App. D).  Everything else (Christoffel symbols,
vertical and horizontal spaces) is derived from these by
[`symbolic.riemann`][quotient_manifolds.symbolic.riemann].

Coordinate order follows the library's packed tensors, so a coordinate
vector is the ``flatten()`` of a point:

* [`DiagonalModel`][quotient_manifolds.symbolic.models.DiagonalModel]: $(u_0 \dots u_{d-1}, v_0
  \dots v_{d-1})$, i.e. rows ``u``, ``v`` of a ``(2, d)`` point of ``DiagonalQuotient``;
* [`GLBlock`][quotient_manifolds.symbolic.models.GLBlock]: ``G`` row-major then ``H`` row-major,
  i.e. the ``(n + m, h)`` point of ``GLQuotient``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import sympy as sp

from ..geometry import gl as _gl
from .riemann import CoordinateMetric
from .tensor import SymTensor

# The torch kernels of `geometry`, applied here to SymTensor arguments (duck typing),
# hence typed Any.
gl: Any = _gl

SymGrams = Any
"""A `gl.Grams` whose fields are `SymTensor` (the torch kernels accept it by duck typing)."""

__all__ = [
    "SymGrams",
    "METRICS",
    "DiagonalModel",
    "GLBlock",
    "scalar_toy",
    "adaptive_metric",
    "code_grams",
    "abstract_grams",
    "symmetric_symbols",
]

METRICS = ("inv", "mix")


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")


@dataclass(frozen=True)
class DiagonalModel:
    r"""Diagonal network ``β = u ⊙ v`` with symmetry GL(1)^d (§5.1, Eq. 6/7).

    Parameters
    ----------
    d : int
        Number of coordinates of ``u`` (and of ``v``).
    names : (str, str)
        Symbol names of the two factors; ``("G", "H")`` with ``d = 1`` is the
        scalar toy of Fig. 1 and App. D.
    convention : {"diag", "gl"}
        ``"diag"``: ``(α ⊙ u, α⁻¹ ⊙ v)`` (§5.1); ``"gl"``:
        ``(u α⁻¹, v α)``, the GL(1) form ``(G A⁻¹, H Aᵀ)`` of the toy.
    """

    d: int
    names: tuple[str, str] = ("u", "v")
    convention: str = "diag"

    def _sym(self, base: str, i: int) -> sp.Symbol:
        return sp.Symbol(base if self.d == 1 else f"{base}_{i}")

    @cached_property
    def u(self) -> tuple[sp.Symbol, ...]:
        return tuple(self._sym(self.names[0], i) for i in range(self.d))

    @cached_property
    def v(self) -> tuple[sp.Symbol, ...]:
        return tuple(self._sym(self.names[1], i) for i in range(self.d))

    @property
    def coords(self) -> tuple[sp.Symbol, ...]:
        return self.u + self.v

    @property
    def sizes(self) -> str:
        return f"d={self.d}"

    def tangent(self, prefix: str = "xi") -> tuple[tuple[sp.Symbol, ...], tuple[sp.Symbol, ...]]:
        """Generic tangent vector ``(ξ_u, ξ_v)`` as fresh symbols."""
        a, b = self.names
        return (
            tuple(self._sym(f"{prefix}_{a}", i) for i in range(self.d)),
            tuple(self._sym(f"{prefix}_{b}", i) for i in range(self.d)),
        )

    def vec(self, xu: Sequence[sp.Expr], xv: Sequence[sp.Expr]) -> list[sp.Expr]:
        """Coordinate vector of a pair."""
        return list(xu) + list(xv)

    def unvec(self, x: Sequence[sp.Expr]) -> tuple[list[sp.Expr], list[sp.Expr]]:
        """Inverse of [`vec`][quotient_manifolds.symbolic.models.DiagonalModel.vec]."""
        x = list(x)
        return x[: self.d], x[self.d :]

    def metric_form(
        self,
        metric: str,
        xi: tuple[Sequence[sp.Expr], Sequence[sp.Expr]],
        eta: tuple[Sequence[sp.Expr], Sequence[sp.Expr]],
        point: tuple[Sequence[sp.Expr], Sequence[sp.Expr]] | None = None,
    ) -> sp.Expr:
        r"""Spec Eq. 6/7: inv ``Σ η_u ν_u/u² + η_v ν_v/v²``, mix ``Σ η_u ν_u v² + η_v ν_v u²``."""
        _check_metric(metric)
        u, v = point if point is not None else (self.u, self.v)
        (eu, ev), (fu, fv) = xi, eta
        if metric == "inv":
            terms = [eu[i] * fu[i] / u[i] ** 2 + ev[i] * fv[i] / v[i] ** 2 for i in range(self.d)]
        else:
            terms = [eu[i] * fu[i] * v[i] ** 2 + ev[i] * fv[i] * u[i] ** 2 for i in range(self.d)]
        return sp.Add(*terms)

    def coordinate_metric(self, metric: str) -> CoordinateMetric:
        """The metric of Eq. 6/7 as a ``2d×2d`` SymPy matrix."""
        xi = self.tangent("xi")
        q = self.metric_form(metric, xi, xi)
        return CoordinateMetric.from_quadratic_form(
            q, self.coords, self.vec(*xi), name=f"diagonal-{metric}"
        )

    def group_params(self) -> tuple[sp.Symbol, ...]:
        """Lie-algebra coordinates ``ω`` with ``α = 1 + ω`` (``ω = 0``: identity)."""
        return tuple(self._sym("omega", i) for i in range(self.d))

    def action(self, x: Sequence[sp.Expr], omega: Sequence[sp.Expr]) -> list[sp.Expr]:
        r"""``ψ(α, (u, v))`` with ``α = 1 + ω``: ``(αu, v/α)`` or, for ``"gl"``, ``(u/α, αv)``."""
        u, v = self.unvec(x)
        alpha = [1 + w for w in omega]
        if self.convention == "gl":
            return [a / s for a, s in zip(u, alpha)] + [a * s for a, s in zip(v, alpha)]
        return [s * a for a, s in zip(u, alpha)] + [a / s for a, s in zip(v, alpha)]

    def sym(self, values: Sequence[sp.Expr]) -> SymTensor:
        """A ``(d,)`` [`SymTensor`][quotient_manifolds.symbolic.tensor.SymTensor] for the
        library's elementwise kernels."""
        return SymTensor(list(values))


def code_grams(G: sp.Matrix, H: sp.Matrix, eps: sp.Expr = sp.S.Zero) -> SymGrams:
    r"""The library's [`Grams`][quotient_manifolds.geometry.gl.Grams] for symbolic factors.

    ``P = GᵀG + εI``, ``Q = HᵀH + εI`` and their exact inverses ``adj/det``
    (the code computes them from a Cholesky factor).  Cholesky factors are not
    needed symbolically and are ``None``; fields are filled by name, so any
    extra field of the library's tuple defaults to ``None``.
    """
    h = G.shape[1]
    P = G.T * G + eps * sp.eye(h)
    Q = H.T * H + eps * sp.eye(h)
    return abstract_grams(P, Q, eps)


def abstract_grams(P: sp.Matrix, Q: sp.Matrix, eps: sp.Expr = sp.S.Zero) -> SymGrams:
    """A Gram tuple from given ``P`` and ``Q`` (e.g. matrices of free symbols)."""
    values = {
        "P": SymTensor(P),
        "Q": SymTensor(Q),
        "P_inv": SymTensor(GLBlock.inverse(P)),
        "Q_inv": SymTensor(GLBlock.inverse(Q)),
        "eps": eps,
    }
    return gl.Grams(**{f: values.get(f) for f in gl.Grams._fields})


def symmetric_symbols(name: str, h: int) -> sp.Matrix:
    """A symmetric ``h×h`` matrix of free symbols ``name_ab`` (``a ≤ b``)."""
    return sp.Matrix(h, h, lambda a, b: sp.Symbol(f"{name}_{min(a, b)}{max(a, b)}"))


def scalar_toy() -> DiagonalModel:
    r"""The scalar toy ``x ↦ GHx`` with GL(1) acting by ``(G/α, αH)`` (Fig. 1, Eq. 18)."""
    return DiagonalModel(1, ("G", "H"), "gl")


def adaptive_metric(eps: sp.Expr) -> tuple[sp.Symbol, CoordinateMetric]:
    r"""One weight ``w`` with the adaptive metric ``ξ²/(w² + ε)`` (App. F, App. C.1)."""
    w, xi = sp.symbols("w xi_w")
    q = xi**2 / (w**2 + eps)
    return w, CoordinateMetric.from_quadratic_form(q, [w], [xi], name="adaptive")


@dataclass(frozen=True)
class GLBlock:
    r"""A GL(h) block ``(G, H)``, $G \in R^{n\times h}$, $H \in R^{m\times h}$ (Def. 3.1, §5.2).

    Parameters
    ----------
    n, m, h : int
        Shapes of the factors.
    eps : sympy expression
        Relaxation ``P = GᵀG + εI``, ``Q = HᵀH + εI`` ([relaxation][eps-relaxation]); ``0`` by
        default, or a positive symbol to prove formulas for every ``ε``.
    """

    n: int
    m: int
    h: int
    eps: sp.Expr = sp.S.Zero

    @property
    def sizes(self) -> str:
        s = f"n={self.n},m={self.m},h={self.h}"
        if self.eps == 0:
            return s
        return s + (",ε" if isinstance(self.eps, sp.Symbol) else f",eps={float(self.eps):g}")

    def _mat(self, base: str, rows: int) -> sp.Matrix:
        sep = "" if max(rows, self.h) <= 10 else "_"
        return sp.Matrix(rows, self.h, lambda i, a: sp.Symbol(f"{base}_{i}{sep}{a}"))

    @cached_property
    def G(self) -> sp.Matrix:
        return self._mat("G", self.n)

    @cached_property
    def H(self) -> sp.Matrix:
        return self._mat("H", self.m)

    @property
    def coords(self) -> tuple[sp.Symbol, ...]:
        return tuple(self.G) + tuple(self.H)

    def tangent(self, prefix: str = "xi") -> tuple[sp.Matrix, sp.Matrix]:
        """Generic tangent vector ``(ξ_G, ξ_H)`` of fresh symbols."""
        return self._mat(f"{prefix}G", self.n), self._mat(f"{prefix}H", self.m)

    def vec(self, XG: sp.Matrix, XH: sp.Matrix) -> list[sp.Expr]:
        """Coordinate vector: ``G`` row-major, then ``H`` row-major."""
        return list(XG) + list(XH)

    def unvec(self, x: Sequence[sp.Expr]) -> tuple[sp.Matrix, sp.Matrix]:
        """Inverse of [`vec`][quotient_manifolds.symbolic.models.GLBlock.vec]."""
        x = list(x)
        k = self.n * self.h
        return sp.Matrix(self.n, self.h, x[:k]), sp.Matrix(self.m, self.h, x[k:])

    def grams(
        self, G: sp.Matrix | None = None, H: sp.Matrix | None = None
    ) -> tuple[sp.Matrix, sp.Matrix]:
        """``P = GᵀG + εI`` and ``Q = HᵀH + εI``."""
        G = self.G if G is None else G
        H = self.H if H is None else H
        eye = sp.eye(self.h)
        return G.T * G + self.eps * eye, H.T * H + self.eps * eye

    @staticmethod
    def inverse(M: sp.Matrix) -> sp.Matrix:
        """Exact inverse ``adj(M)/det(M)``, unexpanded in the entries of ``M``.

        The cofactor formula is built on placeholder symbols and the entries
        are substituted afterwards, so e.g. ``(GᵀG)⁻¹`` stays a short
        expression in the Gram entries instead of a large polynomial in ``G``.
        """
        k = M.shape[0]
        X = sp.Matrix(k, k, lambda a, b: sp.Dummy(f"m{a}{b}"))
        inv = X.adjugate(method="berkowitz") / X.det(method="berkowitz")
        return inv.xreplace({X[a, b]: M[a, b] for a in range(k) for b in range(k)})

    @cached_property
    def _weights(self) -> dict[str, tuple[sp.Matrix, sp.Matrix]]:
        P, Q = self.grams()
        return {"inv": (self.inverse(P), self.inverse(Q)), "mix": (Q, P)}

    def metric_form(
        self,
        metric: str,
        xi: tuple[sp.Matrix, sp.Matrix],
        eta: tuple[sp.Matrix, sp.Matrix],
        point: tuple[sp.Matrix, sp.Matrix] | None = None,
    ) -> sp.Expr:
        r"""Spec Eq. 9/10.

        inv: ``Tr(P⁻¹ ξ_Gᵀ η_G + Q⁻¹ ξ_Hᵀ η_H)``;
        mix: ``Tr(Q ξ_Gᵀ η_G + P ξ_Hᵀ η_H)``.
        """
        _check_metric(metric)
        if point is None:
            MG, MH = self._weights[metric]
        else:
            P, Q = self.grams(*point)
            MG, MH = (self.inverse(P), self.inverse(Q)) if metric == "inv" else (Q, P)
        (xG, xH), (eG, eH) = xi, eta
        return (MG * xG.T * eG).trace() + (MH * xH.T * eH).trace()

    def coordinate_metric(self, metric: str) -> CoordinateMetric:
        r"""Eq. 9/10 as an ``(n+m)h × (n+m)h`` SymPy matrix, $g_{μν} = \langle e_μ, e_ν\rangle$."""
        _check_metric(metric)
        return CoordinateMetric.from_bilinear_form(
            lambda x, y: self.metric_form(metric, self.unvec(x), self.unvec(y)),
            self.coords,
            name=f"gl-{metric}",
        )

    # -- group ----------------------------------------------------------------------
    def group_params(self) -> tuple[sp.Symbol, ...]:
        """Entries of ``Ω`` with ``A = I + Ω`` (row-major)."""
        return tuple(self._omega())

    def _omega(self) -> sp.Matrix:
        return sp.Matrix(self.h, self.h, lambda a, b: sp.Symbol(f"omega_{a}{b}"))

    def act(self, A: sp.Matrix, XG: sp.Matrix, XH: sp.Matrix) -> tuple[sp.Matrix, sp.Matrix]:
        r"""``(X_G A⁻¹, X_H Aᵀ)``: the action on points and, being linear, on vectors."""
        return XG * self.inverse(A), XH * A.T

    def action(self, x: Sequence[sp.Expr], omega: Sequence[sp.Expr]) -> list[sp.Expr]:
        """``ψ(I + Ω, x)`` on a coordinate vector."""
        A = sp.eye(self.h) + sp.Matrix(self.h, self.h, list(omega))
        return self.vec(*self.act(A, *self.unvec(x)))

    # -- library side -------------------------------------------------------------------
    def code_grams(self) -> SymGrams:
        """The library's Gram tuple at the block's own symbols (see
        [`code_grams`][quotient_manifolds.symbolic.models.GLBlock.code_grams])."""
        return code_grams(self.G, self.H, self.eps)

    def sym(self, M: sp.Matrix) -> SymTensor:
        """Wrap a factor-shaped matrix for the library kernels."""
        return SymTensor(M)
