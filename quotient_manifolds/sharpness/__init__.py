"""Sharpness layer: feasible sets, Auto-PGD and the other solvers, the engine and the measures.

Imports only from `quotient_manifolds.models` and ``manifolds``; the geometry is reached
only through the tangent spaces ``M.at(x0)`` of the manifolds.
"""

from .apgd import APGDResult, apgd, checkpoints
from .config import Geometry
from .diagonal import DiagonalGeometry, DiagonalPopulation, diagonal_sharpness
from .distributed import Shard
from .engine import adaptive_sharpness, geodesic_sharpness, symmetries_of
from .feasible import AdaptiveNormBall, Box, Ellipsoid, FeasibleSet, MetricBall, make_feasible
from .measures import MEASURES, Measure, measure
from .result import SharpnessResult
from .solvers import APGD, Average, FeasibleSetManifold, GeooptSolver
from .tangent_ball import TangentBall

__all__ = [
    "APGD",
    "APGDResult",
    "AdaptiveNormBall",
    "Average",
    "Box",
    "DiagonalGeometry",
    "DiagonalPopulation",
    "Ellipsoid",
    "FeasibleSet",
    "FeasibleSetManifold",
    "Geometry",
    "GeooptSolver",
    "MEASURES",
    "Measure",
    "MetricBall",
    "SharpnessResult",
    "Shard",
    "TangentBall",
    "adaptive_sharpness",
    "apgd",
    "checkpoints",
    "diagonal_sharpness",
    "geodesic_sharpness",
    "make_feasible",
    "measure",
    "symmetries_of",
]
