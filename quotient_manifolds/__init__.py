"""Quotient manifolds for transformer symmetries, on Geoopt.

Implements the geometry of *Hide & Seek: Transformer Symmetries Obscure
Sharpness & Riemannian Geometry Finds It* (da Silva, Dangel, Oore, ICML 2025).
"""

import warnings

with warnings.catch_warnings():
    # geoopt 0.5.1 decorates kernels with torch.jit.script, deprecated in torch 2.13+.
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated")
    import geoopt  # noqa: F401

from . import errors, geometry, manifolds, models, sharpness
from .errors import (
    BlockSpecError,
    DetachedLossError,
    DistributedError,
    EmptyDataError,
    ExampleInputError,
    GeodesicDomainError,
    InvalidRadiusError,
    NoBlocksWarning,
    NonFiniteError,
    NoParametersError,
    ParameterSelectionError,
    PrecisionError,
    ProbeWarning,
    QuotientManifoldError,
    RankDeficientError,
    ShapeError,
    SingleBatchError,
    SymmetryFallbackWarning,
    ZeroWeightError,
)
from .manifolds import AdaptiveEuclidean, DiagonalQuotient, GLQuotient, QuotientManifold
from .models import (
    BlockSpec,
    DiscoveryCache,
    FactorPart,
    ModelGeometry,
    Symmetries,
    declare_block,
    discover,
    discover_blocks,
    discovery_cache,
    reparametrize,
)
from .sharpness import (
    APGD,
    MEASURES,
    Average,
    Geometry,
    GeooptSolver,
    Measure,
    Shard,
    SharpnessResult,
    TangentBall,
    adaptive_sharpness,
    geodesic_sharpness,
    landscape,
    symmetries_of,
)

__version__ = "0.1.0"

__all__ = [
    "AdaptiveEuclidean",
    "DiagonalQuotient",
    "GLQuotient",
    "QuotientManifold",
    "GeodesicDomainError",
    "NonFiniteError",
    "QuotientManifoldError",
    "RankDeficientError",
    "ShapeError",
    "ZeroWeightError",
    "errors",
    "geometry",
    "manifolds",
    "BlockSpecError",
    "DistributedError",
    "EmptyDataError",
    "ExampleInputError",
    "InvalidRadiusError",
    "NoBlocksWarning",
    "PrecisionError",
    "ProbeWarning",
    "SymmetryFallbackWarning",
    "BlockSpec",
    "FactorPart",
    "Geometry",
    "ModelGeometry",
    "DiscoveryCache",
    "Symmetries",
    "declare_block",
    "discover",
    "discover_blocks",
    "discovery_cache",
    "reparametrize",
    "APGD",
    "Average",
    "DetachedLossError",
    "GeooptSolver",
    "MEASURES",
    "Measure",
    "NoParametersError",
    "ParameterSelectionError",
    "Shard",
    "SingleBatchError",
    "SharpnessResult",
    "TangentBall",
    "adaptive_sharpness",
    "geodesic_sharpness",
    "landscape",
    "symmetries_of",
    "models",
    "sharpness",
]
