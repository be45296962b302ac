"""Sharpness layer: geodesic and adaptive sharpness, the tangent ball and Auto-PGD.

Imports only from :mod:`quotient_manifolds.models` and ``manifolds``.
"""

from .apgd import APGDResult, apgd, checkpoints
from .diagonal import diagonal_sharpness
from .engine import adaptive_sharpness, geodesic_sharpness
from .result import SharpnessResult
from .tangent_ball import TangentBall

__all__ = [
    "APGDResult",
    "SharpnessResult",
    "TangentBall",
    "adaptive_sharpness",
    "apgd",
    "checkpoints",
    "diagonal_sharpness",
    "geodesic_sharpness",
]
