r"""Exact zero tests for the symbolic checks.

A check *proves* an identity ``lhs = rhs`` by showing that ``lhs − rhs`` is the
zero function, and *refutes* it by exhibiting a point where it is not zero.

Strategy (fast first):

1. **Refutation.**  Substitute random positive rationals for every free
   symbol and evaluate exactly (or to 60 digits when ``exp``/``sqrt`` remain).
   A nonzero value is a counterexample: the identity is false.
2. **Proof.**  For a rational function, bring it to one fraction with
   ``sympy.together`` and expand the numerator as a sparse polynomial over
   ``QQ``; it must be the zero polynomial.  Otherwise (``exp``, ``sqrt`` of
   the closed-form geodesics) use ``sympy.cancel`` after ``powsimp``, with
   ``sympy.simplify`` as a last resort.

``simplify`` is never used on rational functions: ``together``/``expand`` and
``cancel`` are orders of magnitude faster there.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import sympy as sp
from sympy.polys.fields import FracElement, FracField
from sympy.polys.rings import PolyRing

__all__ = [
    "PROVEN",
    "REFUTED",
    "UNDECIDED",
    "ZeroTest",
    "rational_field",
    "random_point",
    "evaluate",
    "prove_zero",
    "prove_equal",
    "is_rational_in",
]

PROVEN = "proven"
REFUTED = "refuted"
UNDECIDED = "undecided"


@dataclass(frozen=True)
class ZeroTest:
    """Outcome of [`prove_zero`][quotient_manifolds.symbolic.algebra.prove_zero].

    Attributes
    ----------
    verdict : {"proven", "refuted", "undecided"}
        ``proven``: every expression is identically zero.  ``refuted``: one is
        not (``detail`` names it and the value at a counterexample point).
        ``undecided``: no counterexample found, but no proof either.
    method : str
        How the verdict was reached.
    detail : str
        Human-readable detail.
    """

    verdict: str
    method: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        """``True`` only for a proof."""
        return self.verdict == PROVEN


@lru_cache(maxsize=64)
def rational_field(symbols: tuple[sp.Symbol, ...]) -> FracField:
    """The field ``QQ(symbols)`` of rational functions (cached per symbol tuple)."""
    return sp.QQ.frac_field(*symbols)


@lru_cache(maxsize=64)
def _ring(symbols: tuple[sp.Symbol, ...]) -> PolyRing:
    return sp.polys.rings.ring(symbols, sp.QQ)[0]


def _as_expr(e: Any) -> sp.Expr:
    if isinstance(e, FracElement):
        return e.as_expr()
    return sp.sympify(e)


def _free(exprs: Iterable[sp.Expr]) -> tuple[sp.Symbol, ...]:
    syms: set[sp.Symbol] = set()
    for e in exprs:
        syms |= e.free_symbols
    return tuple(sorted(syms, key=lambda s: s.name))


def random_point(symbols: Iterable[sp.Symbol], rng: random.Random) -> dict[sp.Symbol, sp.Rational]:
    """Random positive rationals in ``[1/2, 3]`` (exact), one per symbol."""
    return {s: sp.Rational(rng.randint(4, 24), rng.randint(4, 8)) for s in symbols}


def evaluate(expr: sp.Expr, point: Mapping[sp.Symbol, sp.Expr]) -> sp.Expr | None:
    """Exact value of ``expr`` at ``point``; ``None`` at a pole or undefined value."""
    val = sp.sympify(expr).xreplace(dict(point))
    if val.has(sp.zoo, sp.nan, sp.oo, -sp.oo):
        return None
    return val


def is_rational_in(expr: sp.Expr, symbols: Sequence[sp.Symbol]) -> bool:
    """Whether ``expr`` is a rational function of ``symbols`` (and nothing else)."""
    return expr.free_symbols <= set(symbols) and expr.is_rational_function(*symbols)


def _nonzero_value(val: sp.Expr) -> float | None:
    """``abs(val)`` if it is certainly nonzero, else ``None``."""
    if val.is_Rational:
        return None if val == 0 else float(abs(val))
    num = sp.N(val, 60)
    mag = abs(complex(num))
    return mag if mag > 1e-40 else None


def _refute(exprs: Sequence[sp.Expr], samples: int, seed: int) -> ZeroTest | None:
    rng = random.Random(seed)
    syms = _free(exprs)
    for _ in range(samples):
        for _attempt in range(8):
            point = random_point(syms, rng)
            vals = [evaluate(e, point) for e in exprs]
            if all(v is not None for v in vals):
                break
        else:  # pragma: no cover - only at structural singularities
            continue
        for i, v in enumerate(vals):
            mag = _nonzero_value(v)
            if mag is not None:
                where = ", ".join(f"{k}={w}" for k, w in list(point.items())[:6])
                return ZeroTest(
                    REFUTED,
                    "random exact point",
                    f"component {i} = {mag:.3g} at ({where}{', …' if len(point) > 6 else ''})",
                )
    return None


def _prove_rational(e: sp.Expr) -> bool:
    syms = _free([e])
    if not syms:
        return sp.simplify(e) == 0
    num, _den = sp.fraction(sp.together(e))
    return _ring(syms).from_expr(num) == 0


def _prove_general(e: sp.Expr) -> tuple[bool, str]:
    c = sp.cancel(sp.powsimp(sp.expand_power_base(e, force=True), force=True))
    if c == 0:
        return True, "cancel"
    c = sp.simplify(c)
    return c == 0, "simplify"


def prove_zero(
    exprs: Any, *, samples: int = 2, seed: int = 0, refute_only: bool = False
) -> ZeroTest:
    """Decide whether every expression in ``exprs`` is identically zero.

    Parameters
    ----------
    exprs : Expr, FracElement or sequence of them
        The differences ``lhs − rhs`` to test.
    samples : int
        Random exact points tried for a counterexample before the proof.
    seed : int
        Seed of those points (the verdict does not depend on it unless the
        identity is false and only fails on a measure-zero set).
    refute_only : bool
        Stop after the counterexample search (``undecided`` if none found).

    Returns
    -------
    ZeroTest
    """
    if not isinstance(exprs, (list, tuple)):
        exprs = [exprs]
    exprs = [_as_expr(e) for e in exprs]
    nontrivial = [e for e in exprs if e != 0]
    if not nontrivial:
        return ZeroTest(PROVEN, "structural zero")
    bad = _refute(nontrivial, samples, seed)
    if bad is not None:
        return bad
    if refute_only:
        return ZeroTest(UNDECIDED, "random exact points", "no counterexample")
    methods = set()
    for i, e in enumerate(nontrivial):
        syms = _free([e])
        if is_rational_in(e, syms):
            ok, how = _prove_rational(e), "together+expand"
        else:
            ok, how = _prove_general(e)
        methods.add(how)
        if not ok:
            return ZeroTest(UNDECIDED, how, f"component {i} did not simplify to 0")
    return ZeroTest(PROVEN, "+".join(sorted(methods)))


def prove_equal(lhs: Sequence[Any], rhs: Sequence[Any], **kwargs: Any) -> ZeroTest:
    """[`prove_zero`][quotient_manifolds.symbolic.algebra.prove_zero] of ``lhs[i] − rhs[i]``
    (sequences of equal length)."""
    lhs, rhs = list(lhs), list(rhs)
    if len(lhs) != len(rhs):
        raise ValueError(f"length mismatch: {len(lhs)} vs {len(rhs)}")
    return prove_zero([_as_expr(a) - _as_expr(b) for a, b in zip(lhs, rhs)], **kwargs)
