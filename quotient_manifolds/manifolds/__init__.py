"""Geoopt manifolds for the symmetry quotients of the paper."""

from .adaptive import AdaptiveEuclidean
from .base import RETRACTIONS, QuotientManifold
from .diagonal import DiagonalQuotient
from .gl_quotient import GLQuotient

__all__ = ["AdaptiveEuclidean", "DiagonalQuotient", "GLQuotient", "QuotientManifold", "RETRACTIONS"]
