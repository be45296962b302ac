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
    "SubalgebraError",
    "ExampleInputError",
    "DistributedError",
    "ShardedModelError",
    "PopulationInputError",
    "NonFiniteWeightError",
    "MissingDependencyError",
    "NoParametersError",
    "ParameterSelectionError",
    "DetachedLossError",
    "SingleBatchError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "UnsupportedModelError",
    "LossEvaluationError",
    "ModelStateError",
    "InfeasibleSolutionError",
    "InferenceModeError",
    "SymmetryFallbackWarning",
    "NoBlocksWarning",
    "ProbeWarning",
    "ZeroGradientWarning",
    "ModelStateWarning",
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
    ``geometry=Geometry(half="float32")``; the block algebra then runs in float32.
    """


class BlockSpecError(QuotientManifoldError, ValueError):
    """A declared GL block does not match the model's parameters."""


class SubalgebraError(QuotientManifoldError, ValueError):
    """A subalgebra of gl(h) is described inconsistently.

    E.g. rotary pairs that share an index or leave ``range(h)``, blocks that do not
    partition ``range(h)``, or a matrix whose size is not ``h``.  The message names the
    offending entry; rotary layouts are easiest built with
    ``RotaryCommutant.rotate_half(h, rotary_dims)`` or ``RotaryCommutant.interleaved``.
    """


class ExampleInputError(QuotientManifoldError, TypeError):
    """No example input could be built for a model (needed by the symmetry probes).

    Pass one yourself: `discover(model, example_inputs=(args, kwargs))`, a dict of keyword
    arguments, or a tensor.
    """


class DistributedError(QuotientManifoldError, RuntimeError):
    """The ranks of a data-parallel sharpness call cannot work together.

    E.g. they hold different models, or a batch cannot be sliced along its first
    dimension (``shard="within_batch"``); see ``docs/distributed.md``.
    """


class ShardedModelError(DistributedError):
    """A model whose parameters are sharded (``torch.distributed.fsdp.fully_shard`` or
    DTensor) cannot be measured as laid out: e.g. a mesh of more than two dimensions, parameters
    on different meshes, the old ``FullyShardedDataParallel`` wrapper, or data parallelism
    requested without a data dimension in the mesh; see the "Model-parallel (FSDP2)" section
    of ``docs/distributed.md``.
    """


class PopulationInputError(QuotientManifoldError, ValueError):
    """A file, factory, checkpoint, results line or setting given to the command line does not
    fit.

    The message names the input (or the parameter: `out=…`, `seed=…`) and what to do; the
    command line prints it as one line, in its own flags (`--out …`), and exits with status 2.
    """


class NonFiniteWeightError(NonFiniteError, PopulationInputError):
    """A checkpoint given to the command line holds a NaN or Inf weight.

    Raised when the checkpoint is loaded, before it is measured; the message names the
    checkpoint and the parameter. Drop the checkpoint from the population (its training
    diverged, or the file is corrupt) or re-save it. A
    [`NonFiniteError`][quotient_manifolds.errors.NonFiniteError] and a
    [`PopulationInputError`][quotient_manifolds.errors.PopulationInputError]: the command line
    prints it as one line and exits with status 2.
    """


class MissingDependencyError(QuotientManifoldError, ImportError):
    """An optional package that a feature needs is not installed.

    The message names the feature, the package and the `pip` line that installs it (the
    extras of `pyproject.toml`: `hf`, `vision`, `plots`). The command line prints it as one
    line and exits with status 2.
    """


class NoParametersError(QuotientManifoldError, ValueError):
    """A sharpness call has no weight to perturb.

    The model has no parameters, or `params=` (or `requires_grad`) selects none of them. Pass
    `params=` naming the parameters to perturb, or set `requires_grad=True` on them.
    """


class ParameterSelectionError(QuotientManifoldError, ValueError):
    """`params=` names a parameter the model does not have, or is of an unknown form.

    Pass names from `model.named_parameters()`, a predicate `(name, param) -> bool` or a dict
    `{name: parameter}`.
    """


class DetachedLossError(QuotientManifoldError, RuntimeError):
    """`loss_fn` returned a loss that does not depend on the perturbed weights.

    The loss has no `grad_fn`: it was computed under `torch.no_grad()`, detached
    (`.detach()`, `.item()`, numpy), or from weights other than the model's parameters.
    Return the loss tensor itself.
    """


class SingleBatchError(QuotientManifoldError, TypeError):
    """A single batch was passed where an iterable of batches is expected.

    `data` is iterated batch by batch; iterating a tensor, a dict or an `(inputs, targets)`
    pair yields its rows or keys instead. Wrap one batch in a list: `data=[batch]`.
    """


class InvalidArgumentError(QuotientManifoldError, ValueError):
    """An argument has a value outside its domain (e.g. `n_iter=nan`, `step_mult=0`,
    `exact_steps=2.7`, a seed beyond 64 bits).

    The message names the argument, the value and the values that are accepted.
    """


class ArgumentTypeError(QuotientManifoldError, TypeError):
    """An argument has the wrong type (e.g. `geometry="mix"`, `model=None`, `eps="0.1"`).

    The message names the argument, the type given and the type expected.
    """


class UnsupportedModelError(QuotientManifoldError, TypeError):
    """The model cannot be measured as it is: it is not an `nn.Module` instance, its weights
    are on the meta device (not materialised), or it cannot be copied for the symmetry
    probes (it holds a lock, a file or another object that `copy.deepcopy` refuses).

    The message says what to do: materialise the weights (`to_empty` and load them), pass
    the module instance, or pass `geometry=Geometry(symmetries=...)` / `blocks=` so that no
    probe copies the model.
    """


class LossEvaluationError(QuotientManifoldError, RuntimeError):
    """`loss_fn(model, batch)` raised on one batch.

    The message names the batch (its index in `data`) and the original error, which is
    chained as `__cause__`.
    """


class ModelStateError(QuotientManifoldError, RuntimeError):
    """User code (`loss_fn` or the model's forward) changed the model during a sharpness call
    in a way that makes the result meaningless: it switched a module's train/eval mode, wrote
    to a parameter, or replaced one.

    What can be restored (modes, parameters that were replaced, buffers, `.grad`,
    `requires_grad`, the random number generators) has been restored when this is raised; a
    weight written in place cannot be and is named. Compute the loss without changing the
    model.
    """


class InfeasibleSolutionError(QuotientManifoldError, RuntimeError):
    """A solver returned a maximiser outside the feasible set (e.g. a plain torch optimizer
    that does not keep its iterate in the ball).

    The value at such a point is not the sharpness of the ball; use `APGD`, or a geoopt
    Riemannian optimizer in `GeooptSolver`, whose `retr` keeps the iterate in the set.
    """


class InferenceModeError(QuotientManifoldError, RuntimeError):
    """A sharpness call runs inside `torch.inference_mode()`, or the model's weights were
    created there (inference tensors): the ascent needs autograd.

    Call it outside `torch.inference_mode()` (`torch.no_grad()` around it is fine: the
    engine turns gradients on where it needs them), and load the model outside it too.
    """


class SymmetryFallbackWarning(UserWarning):
    """An attention-like module has weights without a claimed symmetry block.

    Emitted once per module, with the reason (e.g. q/k normalisation, a norm or gate before
    the output projection, an unrecognised layout, or a claim the function-preservation probe
    rejected). Those weights use the adaptive geometry; the fallbacks are recorded in the
    result.
    """


class NoBlocksWarning(UserWarning):
    """No GL block was found in a model; every weight uses the adaptive geometry.

    Declare blocks with [`quotient_manifolds.declare_block`][quotient_manifolds.declare_block] if
    the model has symmetries that discovery does not know about.
    """


class ProbeWarning(UserWarning):
    """Some discovered blocks could not be checked by the function-preservation probe.

    Discovery found them by their structure, but no example input reached their module. Pass
    `example_inputs=` to `discover` so that every claim is verified.
    """


class ZeroGradientWarning(UserWarning):
    """The loss gradient of a claimed GL block (or of every perturbed weight) is identically
    zero at the unperturbed weights.

    Either the loss does not read those weights, or the model's backward does not propagate
    to them (e.g. a reversible layer that computes its own gradients). Those blocks stay at
    ξ = 0, so the sharpness ignores them.
    """


class ModelStateWarning(UserWarning):
    """The model's forward changed a buffer during a sharpness call (e.g. a cache or a
    counter); the buffer was restored, but the losses were computed with the changing
    buffer."""
