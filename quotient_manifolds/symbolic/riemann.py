r"""Riemannian geometry from a metric written as a SymPy matrix in coordinates.

Everything the checks compare the library against is *derived* here from the
metric $g_{μν}(x)$ alone (App. B, App. I.2):

* Christoffel symbols of the Levi-Civita connection,

    $$
    Γ^λ_{μν} = \tfrac12\, g^{λσ}\,(\partial _ν g_{σμ} + \partial _μ g_{σν} - \partial _σ g_{μν});
    $$

* the geodesic equations $\ddot x^λ + Γ^λ_{μν}\dot x^μ\dot x^ν = 0$;
* the vertical space of a group action, the derivative of the action at the
  identity, $\mathcal V_x = \{\partial_s ψ(\exp(sω), x)|_{s=0}\}$;
* the horizontal condition, its metric-orthogonal complement
  $g(ξ, V) = 0$ for all vertical ``V``.

The algebra runs in the field ``QQ(x)`` of rational functions
(`sympy.polys.fields`), where every element is a reduced fraction of
sparse polynomials: far faster than expression trees plus ``simplify``, and
exact.  The inverse metric is computed block by block (the connected
components of the sparsity pattern of ``g``), so a metric with ``h×h`` blocks
never needs a dense ``N×N`` symbolic inverse.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import sympy as sp
from sympy.polys.fields import FracElement, FracField
from sympy.polys.matrices import DomainMatrix

from .algebra import ZeroTest, prove_zero, random_point, rational_field

__all__ = [
    "CoordinateMetric",
    "ChristoffelSymbols",
    "vertical_basis",
    "pushforward",
    "horizontal_conditions",
    "linear_form_matrix",
    "SpanRelation",
    "span_relation",
]


def _sorted_symbols(symbols: set[sp.Symbol]) -> tuple[sp.Symbol, ...]:
    return tuple(sorted(symbols, key=lambda s: s.name))


@dataclass
class ChristoffelSymbols:
    r"""The symbols $Γ^λ_{μν}$ of a
    [`CoordinateMetric`][quotient_manifolds.symbolic.riemann.CoordinateMetric].

    Attributes
    ----------
    coords : tuple of Symbol
        The coordinates ``x^μ``.
    domain : FracField
        ``QQ(coords, parameters)``, where the entries live.
    table : dict
        $(λ, μ, ν) \mapsto Γ^λ_{μν}$ for ``μ ≤ ν`` and nonzero symbols only.
    """

    coords: tuple[sp.Symbol, ...]
    domain: FracField
    table: dict[tuple[int, int, int], FracElement]

    def __getitem__(self, key: tuple[int, int, int]) -> sp.Expr:
        lam, mu, nu = key
        if mu > nu:
            mu, nu = nu, mu
        val = self.table.get((lam, mu, nu))
        return sp.S.Zero if val is None else val.as_expr()

    def nonzero(self) -> list[tuple[tuple[int, int, int], sp.Expr]]:
        """$[((λ, μ, ν), Γ^λ_{μν})]$ for ``μ ≤ ν``, in index order."""
        return [(k, self.table[k].as_expr()) for k in sorted(self.table)]

    def as_array(self) -> sp.ImmutableDenseNDimArray:
        """All ``N³`` symbols as a SymPy array indexed ``[λ, μ, ν]``."""
        n = len(self.coords)
        return sp.ImmutableDenseNDimArray(
            [[[self[lam, mu, nu] for nu in range(n)] for mu in range(n)] for lam in range(n)]
        )

    def contract(
        self, xi: Sequence[sp.Expr], eta: Sequence[sp.Expr] | None = None
    ) -> list[sp.Expr]:
        r"""The vector $Γ^λ_{μν} ξ^μ η^ν$ (``η = ξ`` if omitted).

        Terms are grouped by their (reduced) denominator, so the result is a
        short sum of fractions rather than ``N²`` of them.
        """
        eta = xi if eta is None else eta
        n = len(self.coords)
        if len(xi) != n or len(eta) != n:
            raise ValueError(f"vectors must have {n} components")
        groups: list[dict] = [{} for _ in range(n)]
        for (lam, mu, nu), val in self.table.items():
            w = xi[mu] * eta[nu] + (xi[nu] * eta[mu] if mu != nu else 0)
            acc = groups[lam]
            acc[val.denom] = acc.get(val.denom, 0) + val.numer.as_expr() * w
        return [sp.Add(*[num / den.as_expr() for den, num in acc.items()]) for acc in groups]


class CoordinateMetric:
    r"""A metric $g_{μν}(x)$ given as a symmetric SymPy matrix.

    Parameters
    ----------
    matrix : sympy.Matrix
        ``N×N`` symmetric matrix of rational functions of ``coords`` (and of
        constant parameters such as the relaxation ``ε``).
    coords : sequence of Symbol
        The ``N`` coordinates.
    name : str
        Label used in reports.
    """

    def __init__(self, matrix: sp.Matrix, coords: Sequence[sp.Symbol], name: str = "g") -> None:
        matrix = sp.Matrix(matrix)
        coords = tuple(coords)
        if matrix.shape != (len(coords), len(coords)):
            raise ValueError(f"metric is {matrix.shape}, expected {len(coords)}×{len(coords)}")
        if not prove_zero(list(matrix - matrix.T)).ok:
            raise ValueError("metric matrix is not symmetric")
        self.matrix = matrix
        self.coords = coords
        self.name = name
        self.params = _sorted_symbols(matrix.free_symbols - set(coords))

    @classmethod
    def from_quadratic_form(
        cls,
        q: sp.Expr,
        coords: Sequence[sp.Symbol],
        velocities: Sequence[sp.Symbol],
        name: str = "g",
    ) -> CoordinateMetric:
        r"""$g_{μν} = \tfrac12 \partial ^{2}q / \partial ξ^μ \partial ξ^ν$ from the quadratic
        form ``q(x, ξ) = ⟨ξ, ξ⟩_x``."""
        return cls(sp.hessian(q, list(velocities)) / 2, coords, name)

    @classmethod
    def from_bilinear_form(
        cls,
        form: Callable[[Sequence[sp.Expr], Sequence[sp.Expr]], sp.Expr],
        coords: Sequence[sp.Symbol],
        name: str = "g",
    ) -> CoordinateMetric:
        r"""$g_{μν} = \langle e_μ, e_ν\rangle$ from a bilinear form on coordinate vectors.

        Equivalent to
        [`from_quadratic_form`][quotient_manifolds.symbolic.riemann.CoordinateMetric.from_quadratic_form]
        but never differentiates: much faster for large metrics with rational entries.
        """
        n = len(coords)
        basis = [[sp.S.One if k == i else sp.S.Zero for k in range(n)] for i in range(n)]
        rows = [[sp.S.Zero] * n for _ in range(n)]
        for i in range(n):
            for j in range(i, n):
                rows[i][j] = rows[j][i] = sp.sympify(form(basis[i], basis[j]))
        return cls(sp.Matrix(rows), coords, name)

    def __repr__(self) -> str:
        return f"CoordinateMetric({self.name!r}, N={len(self.coords)})"

    # -- algebra ------------------------------------------------------------------
    @cached_property
    def field(self) -> FracField:
        """``QQ(coords, params)``."""
        return rational_field(self.coords + self.params)

    @cached_property
    def _g(self) -> list[list[FracElement]]:
        K = self.field
        n = len(self.coords)
        return [[K.from_sympy(self.matrix[i, j]) for j in range(n)] for i in range(n)]

    def __call__(self, xi: Sequence[sp.Expr], eta: Sequence[sp.Expr] | None = None) -> sp.Expr:
        """$g(ξ, η) = ξ^μ g_{μν} η^ν$."""
        eta = xi if eta is None else eta
        return (sp.Matrix(list(xi)).T * self.matrix * sp.Matrix(list(eta)))[0, 0]

    def blocks(self) -> list[list[int]]:
        """Index sets of the diagonal blocks (connected components of ``g ≠ 0``)."""
        n = len(self.coords)
        g = self._g
        seen: set[int] = set()
        out = []
        for start in range(n):
            if start in seen:
                continue
            comp, stack = {start}, [start]
            while stack:
                k = stack.pop()
                for j in range(n):
                    if j not in comp and g[k][j] != 0:
                        comp.add(j)
                        stack.append(j)
            seen |= comp
            out.append(sorted(comp))
        return out

    @cached_property
    def _ginv(self) -> list[list[FracElement]]:
        K = self.field
        n = len(self.coords)
        g = self._g
        inv = [[K.zero] * n for _ in range(n)]
        for idx in self.blocks():
            block = DomainMatrix([[g[i][j] for j in idx] for i in idx], (len(idx), len(idx)), K)
            binv = block.inv()
            rows = binv.to_list()
            for a, ia in enumerate(idx):
                for b, ib in enumerate(idx):
                    inv[ia][ib] = rows[a][b]
        return inv

    def inverse(self) -> sp.Matrix:
        """The inverse metric $g^{λσ}$ (block-wise exact inverse)."""
        n = len(self.coords)
        return sp.Matrix(n, n, lambda i, j: self._ginv[i][j].as_expr())

    def christoffel(self) -> ChristoffelSymbols:
        r"""Christoffel symbols $Γ^λ_{μν} = \tfrac12 g^{λσ}(\partial _ν g_{σμ} + \partial _μ
        g_{σν} - \partial _σ g_{μν})$."""
        return self._christoffel

    @cached_property
    def _christoffel(self) -> ChristoffelSymbols:
        K = self.field
        n = len(self.coords)
        gens = K.gens[:n]
        g, ginv = self._g, self._ginv
        # ∂_c g_{ij}; only nonzero entries are differentiated.
        nz = [(i, j) for i in range(n) for j in range(i, n) if g[i][j] != 0]
        dg: dict[tuple[int, int, int], FracElement] = {}
        for c in range(n):
            for i, j in nz:
                dgij = g[i][j].diff(gens[c])
                if dgij != 0:
                    dg[c, i, j] = dg[c, j, i] = dgij

        def d(c: int, i: int, j: int) -> FracElement:
            return dg.get((c, i, j), K.zero)

        # Γ_{σμν} (first kind), then raise the index with g^{λσ}.
        first: dict[tuple[int, int, int], FracElement] = {}
        for s in range(n):
            for mu in range(n):
                for nu in range(mu, n):
                    val = d(nu, s, mu) + d(mu, s, nu) - d(s, mu, nu)
                    if val != 0:
                        first[s, mu, nu] = val
        support = [[s for s in range(n) if ginv[lam][s] != 0] for lam in range(n)]
        half = K(sp.Rational(1, 2))
        table: dict[tuple[int, int, int], FracElement] = {}
        for lam in range(n):
            for mu in range(n):
                for nu in range(mu, n):
                    acc = K.zero
                    for s in support[lam]:
                        f = first.get((s, mu, nu))
                        if f is not None:
                            acc += ginv[lam][s] * f
                    if acc != 0:
                        table[lam, mu, nu] = half * acc
        return ChristoffelSymbols(self.coords, K, table)

    def geodesic_equations(self, t: sp.Symbol | None = None) -> list[sp.Eq]:
        r"""$[ẍ^λ + Γ^λ_{μν} ẋ^μ ẋ^ν = 0]$ with ``x^λ = x^λ(t)`` as SymPy functions."""
        t = sp.Symbol("t") if t is None else t
        curve = [sp.Function(c.name)(t) for c in self.coords]
        vel = [sp.Dummy(f"d{c.name}") for c in self.coords]
        gam = self.christoffel().contract(vel)
        sub = dict(zip(self.coords, curve))
        sub.update({v: c.diff(t) for v, c in zip(vel, curve)})
        return [sp.Eq(c.diff(t, 2) + gm.xreplace(sub), 0) for c, gm in zip(curve, gam)]

    def geodesic_residual(self, curve: Sequence[sp.Expr], t: sp.Symbol) -> list[sp.Expr]:
        r"""$γ̈^λ + Γ^λ_{μν}(γ) γ̇^μ γ̇^ν$ for an explicit curve ``γ(t)``; zero iff geodesic."""
        vel = [sp.Dummy(f"d{c.name}") for c in self.coords]
        gam = self.christoffel().contract(vel)
        sub = dict(zip(self.coords, curve))
        sub.update({v: c.diff(t) for v, c in zip(vel, curve)})
        return [c.diff(t, 2) + gm.xreplace(sub) for c, gm in zip(curve, gam)]


# -- group actions -------------------------------------------------------------------
Action = Callable[[Sequence[sp.Expr], Sequence[sp.Symbol]], Sequence[sp.Expr]]


def vertical_basis(
    action: Action, coords: Sequence[sp.Symbol], params: Sequence[sp.Symbol]
) -> sp.Matrix:
    r"""Columns spanning the vertical space: ``∂ψ(x; ω)/∂ω_k`` at ``ω = 0``.

    ``action(x, ω)`` must be the group action with the element parametrised
    so that ``ω = 0`` is the identity (e.g. ``A = I + Ω`` for GL(h)).
    """
    image = sp.Matrix(list(action(list(coords), list(params))))
    J = image.jacobian(list(params))
    return J.xreplace({p: 0 for p in params})


def pushforward(
    action: Action,
    coords: Sequence[sp.Symbol],
    params: Sequence[sp.Symbol],
    xi: Sequence[sp.Expr],
) -> list[sp.Expr]:
    """The tangent map ``dψ_x ξ = (∂ψ/∂x) ξ`` of the action at a fixed group element."""
    image = sp.Matrix(list(action(list(coords), list(params))))
    return list(image.jacobian(list(coords)) * sp.Matrix(list(xi)))


def horizontal_conditions(
    metric: CoordinateMetric, vertical: sp.Matrix, xi: Sequence[sp.Expr]
) -> list[sp.Expr]:
    r"""``[g(V_k, ξ)]_k``: ``ξ`` is horizontal iff all vanish (metric-orthogonal complement)."""
    g = metric.matrix
    x = sp.Matrix(list(xi))
    return [(vertical[:, k].T * g * x)[0, 0] for k in range(vertical.cols)]


def linear_form_matrix(forms: Sequence[sp.Expr], xi: Sequence[sp.Symbol]) -> sp.Matrix:
    """Coefficient matrix ``M`` with ``forms = M ξ`` (forms must be linear in ``ξ``)."""
    return sp.Matrix(list(forms)).jacobian(list(xi))


@dataclass(frozen=True)
class SpanRelation:
    """Result of [`span_relation`][quotient_manifolds.symbolic.riemann.span_relation]:
    ``W = V K`` and whether ``K`` is invertible."""

    K: sp.Matrix
    test: ZeroTest
    invertible: bool

    @property
    def same_span(self) -> bool:
        """``W = V K`` proven with ``K`` invertible: the column spans agree."""
        return self.test.ok and self.invertible


def span_relation(V: sp.Matrix, W: sp.Matrix, *, seed: int = 0) -> SpanRelation:
    r"""Find ``K`` with ``W = V K`` and prove it symbolically.

    ``V`` (``N×k``) must have full column rank.  ``K`` is computed from ``k``
    rows of ``V`` that are independent at a random point, then
    ``W − V K = 0`` is proven on *all* rows.  With ``W`` also ``N×k`` and ``K``
    invertible this proves ``span V = span W`` (as rational-function modules,
    i.e. at every point where the chosen minor does not vanish).
    """
    if V.rows != W.rows:
        raise ValueError("V and W need the same number of rows")
    syms = _sorted_symbols(V.free_symbols | W.free_symbols)
    point = random_point(syms, random.Random(seed))
    Vp = V.xreplace(point)
    rows: list[int] = []
    for r in range(V.rows):
        if Vp.extract(rows + [r], list(range(V.cols))).rank() > len(rows):
            rows.append(r)
        if len(rows) == V.cols:
            break
    if len(rows) < V.cols:
        raise ValueError("V does not have full column rank at a random point")
    K_field = rational_field(syms)
    sub = DomainMatrix(
        [[K_field.from_sympy(V[r, c]) for c in range(V.cols)] for r in rows],
        (V.cols, V.cols),
        K_field,
    )
    rhs = DomainMatrix(
        [[K_field.from_sympy(W[r, c]) for c in range(W.cols)] for r in rows],
        (V.cols, W.cols),
        K_field,
    )
    Kdm = sub.inv() * rhs
    K = sp.Matrix([[e.as_expr() for e in row] for row in Kdm.to_list()])
    test = prove_zero(list(W - V * K), seed=seed)
    invertible = K.shape[0] == K.shape[1] and K.xreplace(point).det() != 0
    return SpanRelation(K, test, bool(invertible))
