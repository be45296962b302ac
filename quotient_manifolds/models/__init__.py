"""Model layer: symmetry discovery, block specs and the geometry of a whole model.

Imports only from `quotient_manifolds.manifolds`, ``geometry`` and ``errors``.
"""

from .blocks import KINDS, BlockSpec, FactorPart, declare_block, gather_block, scatter_block
from .config import QuotientConfig
from .discovery import discover, discover_blocks, rope_pairs
from .model_geometry import ModelGeometry, select_parameters
from .probe import example_inputs
from .records import Fallback, ProbeRecord, Symmetries
from .reparam import reparametrize

__all__ = [
    "KINDS",
    "BlockSpec",
    "FactorPart",
    "Fallback",
    "ModelGeometry",
    "ProbeRecord",
    "QuotientConfig",
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
