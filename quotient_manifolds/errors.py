"""Named exceptions and warnings of quotient_manifolds.

Every error says what went wrong and what to do about it.  They subclass the
built-in exception a user would otherwise catch (``ValueError``,
``ArithmeticError``), so generic handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "QuotientManifoldError",
    "ShapeError",
    "RankDeficientError",
    "ZeroWeightError",
    "NonFiniteError",
    "GeodesicDomainError",
]


class QuotientManifoldError(Exception):
    """Base class of every error raised by quotient_manifolds."""


class ShapeError(QuotientManifoldError, ValueError):
    """A tensor does not have the shape the manifold expects."""


class RankDeficientError(QuotientManifoldError, ArithmeticError):
    """A factor of a GL(h) block does not have full column rank.

    The quotient geometry needs invertible Gram matrices ``GᵀG`` and ``HᵀH``.
    Pass ``eps > 0`` to use the relaxation ``GᵀG + eps·I`` (spec §5.3.1).
    """


class ZeroWeightError(QuotientManifoldError, ArithmeticError):
    """An elementwise (adaptive) metric met a zero weight with ``eps = 0``.

    The metric ``ξ²/w²`` is undefined at ``w = 0``.  Pass ``eps > 0`` to use
    ``ξ²/(w² + eps)``.
    """


class NonFiniteError(QuotientManifoldError, ValueError):
    """An input or a loss contains NaN or Inf."""


class GeodesicDomainError(QuotientManifoldError, ValueError):
    """A closed-form geodesic leaves the manifold before ``t = 1``.

    For the ``mix`` metric of a diagonal net the geodesic is
    ``u·sqrt(1 + 2bt)``, which needs ``1 + 2b > 0``.  Use a smaller step or
    the second-order retraction.
    """
