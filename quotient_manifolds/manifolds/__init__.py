"""Geoopt manifolds for the symmetry quotients of the paper."""

from ..geometry.subgroup import BlockDiagonal, RotaryCommutant, Subalgebra
from .adaptive import AdaptiveEuclidean
from .base import RETRACTIONS, QuotientManifold
from .diagonal import DiagonalQuotient
from .gl_quotient import GLQuotient, group_action

__all__ = ["AdaptiveEuclidean", "BlockDiagonal", "DiagonalQuotient", "GLQuotient",
           "QuotientManifold", "RETRACTIONS", "RotaryCommutant", "Subalgebra", "group_action"]
