"""The symmetry families discovery asks, in order: one line per family.

Each family is one file of this package (a
[`SymmetryFamily`][quotient_manifolds.models.symmetry.SymmetryFamily] subclass). Block families
come first (their blocks are probed before the fold families read them); a family whose modules
another family must not take comes before it (the q/k norms before the pre-norm gains).
"""

from __future__ import annotations

from ..symmetry import SymmetryFamily
from .attention import Attention, rope_pairs
from .bias import BiasTranslations, KeyBiasFold, ValueBiasFold
from .centring import CentringFold, LayerNormCentring, ReaderCentringFold
from .embeddings import EmbeddingShiftFold, EmbeddingShifts, PadShiftFold, TiedEmbeddingShiftFold
from .input_shear import InputShears, ShearFold
from .key_offset import KeyOffsetFold, KeyOffsets
from .lora import LoRA
from .mlp import Neurons
from .norm_gain import NormGainFold, NormGains
from .norm_shift import NormShiftFold, NormShifts
from .qk_norm import QKNorms, QKNormScaleFold
from .relu_pairs import HomogeneousPairs
from .rotation import ResidualRotations, RotationFold
from .score_shift import ScoreShiftFold, ScoreShifts
from .shift_reader import ShiftReaderFold
from .softmax_shift import SoftmaxShift, SoftmaxShiftFold
from .summed_bias import SummedBiases, SummedBiasFold
from .token_shifts import SliceShiftFold, TokenShifts

__all__ = [
    "FAMILIES",
    "Attention",
    "BiasTranslations",
    "CentringFold",
    "EmbeddingShiftFold",
    "EmbeddingShifts",
    "HomogeneousPairs",
    "InputShears",
    "LayerNormCentring",
    "ReaderCentringFold",
    "ResidualRotations",
    "RotationFold",
    "ScoreShiftFold",
    "ScoreShifts",
    "ShearFold",
    "ShiftReaderFold",
    "SliceShiftFold",
    "SoftmaxShift",
    "SoftmaxShiftFold",
    "SummedBiasFold",
    "SummedBiases",
    "TiedEmbeddingShiftFold",
    "KeyBiasFold",
    "KeyOffsetFold",
    "KeyOffsets",
    "LoRA",
    "Neurons",
    "NormGainFold",
    "NormGains",
    "NormShiftFold",
    "NormShifts",
    "PadShiftFold",
    "QKNormScaleFold",
    "QKNorms",
    "TokenShifts",
    "ValueBiasFold",
    "register_family",
    "rope_pairs",
]

FAMILIES: list[SymmetryFamily] = [
    LoRA(),
    Attention(),
    Neurons(),
    HomogeneousPairs(),
    QKNorms(),
    NormGains(),
    NormShifts(),
    InputShears(),
    BiasTranslations(),
    LayerNormCentring(),
    SummedBiases(),
    KeyOffsets(),
    EmbeddingShifts(),
    TokenShifts(),
    SoftmaxShift(),
    ScoreShifts(),
    ResidualRotations(),
]
"""The families of [`discover`][quotient_manifolds.models.discover], asked in order."""


def register_family(family: SymmetryFamily, *, index: int | None = None) -> None:
    """Add `family` to `FAMILIES`: at `index`, or last among the families of its kind (block
    families run before fold families whatever their place)."""
    if not isinstance(family, SymmetryFamily):
        raise TypeError(f"a symmetry family must be a SymmetryFamily instance, got {family!r}")
    if index is None:
        FAMILIES.append(family)
    else:
        FAMILIES.insert(index, family)
