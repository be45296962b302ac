"""Model layer: symmetry discovery, block specs and the geometry of a whole model.

Imports only from :mod:`quotient_manifolds.manifolds`, ``geometry`` and ``errors``.
"""

from .blocks import KINDS, BlockSpec, FactorPart, declare_block, gather_block, scatter_block
from .config import Geometry
from .discovery import Fallback, discover, discover_blocks
from .model_geometry import ModelGeometry, select_parameters
from .reparam import reparametrize

__all__ = [
    "KINDS",
    "BlockSpec",
    "FactorPart",
    "Fallback",
    "Geometry",
    "ModelGeometry",
    "declare_block",
    "discover",
    "discover_blocks",
    "gather_block",
    "reparametrize",
    "scatter_block",
    "select_parameters",
]
