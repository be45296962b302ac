"""Model layer: symmetry discovery, block specs and the geometry of a whole model.

Imports only from `quotient_manifolds.manifolds` (and ``errors``, ``tree``). Symmetries are
plug-ins: one [`SymmetryFamily`][quotient_manifolds.models.symmetry.SymmetryFamily] per file of
[`families`][quotient_manifolds.models.families], asked in order by
[`discover`][quotient_manifolds.models.discover].
"""

from .blocks import KINDS, BlockSpec, FactorPart, declare_block, gather_block, scatter_block
from .cache import DiscoveryCache, discovery_cache, weights_fingerprint
from .config import QuotientConfig
from .discovery import apply_folds, discover, discover_blocks, find_folds, strip_frozen
from .families import FAMILIES, register_family, rope_pairs
from .inputs import example_inputs, register_input_builder
from .linear import register_reader
from .model_geometry import ModelGeometry, select_parameters
from .precision import float64_internals
from .prober import Prober
from .records import Fallback, ProbeRecord, Symmetries
from .reparam import reparametrize
from .symmetry import Fold, Scene, SymmetryFamily

__all__ = [
    "FAMILIES",
    "KINDS",
    "BlockSpec",
    "DiscoveryCache",
    "FactorPart",
    "Fallback",
    "Fold",
    "ModelGeometry",
    "ProbeRecord",
    "Prober",
    "QuotientConfig",
    "Scene",
    "Symmetries",
    "SymmetryFamily",
    "apply_folds",
    "declare_block",
    "discover",
    "discover_blocks",
    "discovery_cache",
    "example_inputs",
    "find_folds",
    "float64_internals",
    "gather_block",
    "register_family",
    "register_input_builder",
    "register_reader",
    "reparametrize",
    "rope_pairs",
    "scatter_block",
    "select_parameters",
    "strip_frozen",
    "weights_fingerprint",
]
