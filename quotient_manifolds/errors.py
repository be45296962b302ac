"""Named exceptions and warnings of quotient_manifolds.

Every error says what went wrong and what to do about it.  They subclass the
built-in exception a user would otherwise catch (``ValueError``,
``ArithmeticError``), so generic handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "QuotientManifoldError",
    "ShapeError",
    "RankDeficientError",
    "ZeroWeightError",
    "NonFiniteError",
    "GeodesicDomainError",
    "InvalidRadiusError",
    "EmptyDataError",
    "PrecisionError",
    "BlockSpecError",
    "DistributedError",
    "PopulationInputError",
    "MissingDependencyError",
    "SymmetryFallbackWarning",
    "NoBlocksWarning",
]


class QuotientManifoldError(Exception):
    """Base class of every error raised by quotient_manifolds."""


class ShapeError(QuotientManifoldError, ValueError):
    """A tensor does not have the shape the manifold expects."""


class RankDeficientError(QuotientManifoldError, ArithmeticError):
    """A factor of a GL(h) block does not have full column rank.

    The quotient geometry needs invertible Gram matrices ``GᵀG`` and ``HᵀH``.
    Pass ``eps > 0`` to use the [relaxation][eps-relaxation] ``GᵀG + eps·I``.
    """


class ZeroWeightError(QuotientManifoldError, ArithmeticError):
    """An elementwise (adaptive) metric met a zero weight with ``eps = 0``.

    The metric ``ξ²/w²`` is undefined at ``w = 0``.  Pass ``eps > 0`` to use
    ``ξ²/(w² + eps)``.
    """


class NonFiniteError(QuotientManifoldError, ValueError):
    """An input or a loss contains NaN or Inf."""


class GeodesicDomainError(QuotientManifoldError, ValueError):
    """A closed-form geodesic leaves the manifold before ``t = 1``.

    For the ``mix`` metric of a diagonal net the geodesic is
    ``u·sqrt(1 + 2bt)``, which needs ``1 + 2b > 0``.  Use a smaller step or
    the second-order retraction.
    """


class InvalidRadiusError(QuotientManifoldError, ValueError):
    """A sharpness radius ``rho`` is not a positive finite number.

    The perturbation ball ``‖ξ‖ ≤ ρ`` needs ``ρ > 0``; pass e.g. ``rho=0.1``.
    """


class EmptyDataError(QuotientManifoldError, ValueError):
    """The data iterable of a sharpness call yielded no batch.

    Sharpness is a mean over batches; pass a non-empty iterable (a list of
    batches or a ``DataLoader`` over a non-empty data set).
    """


class PrecisionError(QuotientManifoldError, TypeError):
    """A model in half precision was given where float32/float64 is required.

    The ``h×h`` Gram, projection and Christoffel algebra must not run in
    float16/bfloat16.  Convert the model (``model.float()``) or pass
    ``allow_half=True``; the block algebra then runs in float32.
    """


class BlockSpecError(QuotientManifoldError, ValueError):
    """A declared GL block does not match the model's parameters."""


class DistributedError(QuotientManifoldError, RuntimeError):
    """The ranks of a data-parallel sharpness call cannot work together.

    E.g. they hold different models, or a batch cannot be sliced along its first
    dimension (``shard="within_batch"``); see ``docs/distributed.md``.
    """


class PopulationInputError(QuotientManifoldError, ValueError):
    """A file, factory, checkpoint or results line given to the command line does not fit.

    The message names the input and what to do; the command line prints it as one line and
    exits with status 2.
    """


class MissingDependencyError(QuotientManifoldError, ImportError):
    """An optional package that a feature needs is not installed.

    The message names the feature, the package and the `pip` line that installs it (the
    extras of `pyproject.toml`: `hf`, `vision`, `plots`). The command line prints it as one
    line and exits with status 2.
    """


class SymmetryFallbackWarning(UserWarning):
    """Some weights lack the full GL symmetry; they use the adaptive geometry instead.

    Emitted once per discovery, e.g. for rotary embeddings (no full GL(d_k) on
    Q/K) or grouped K/V heads.  The fallbacks are recorded in the result.
    """


class NoBlocksWarning(UserWarning):
    """No GL block was found in a model; every weight uses the adaptive geometry.

    Declare blocks with [`quotient_manifolds.declare_block`][quotient_manifolds.declare_block] if
    the model has symmetries that discovery does not know about.
    """
