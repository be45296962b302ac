"""Model layer: symmetry discovery, block specs and the geometry of a whole model.

Imports only from `quotient_manifolds.manifolds`, ``geometry`` and ``errors``.
"""

from .blocks import KINDS, BlockSpec, FactorPart, declare_block, gather_block, scatter_block
from .config import Geometry
from .discovery import Fallback, Symmetries, discover, discover_blocks, rope_pairs
from .model_geometry import ModelGeometry, select_parameters
from .probe import ProbeRecord, example_inputs
from .reparam import reparametrize

__all__ = [
    "KINDS",
    "BlockSpec",
    "FactorPart",
    "Fallback",
    "Geometry",
    "ModelGeometry",
    "ProbeRecord",
    "Symmetries",
    "declare_block",
    "discover",
    "discover_blocks",
    "example_inputs",
    "gather_block",
    "reparametrize",
    "rope_pairs",
    "scatter_block",
    "select_parameters",
]
