r"""The symmetry plug-in protocol: a family of symmetries finds its candidates on a model.

Discovery ([`discover`][quotient_manifolds.models.discover]) asks every family of
[`FAMILIES`][quotient_manifolds.models.families.FAMILIES] in order. A family is a small
[`SymmetryFamily`][quotient_manifolds.models.symmetry.SymmetryFamily] subclass with one hook,
`find(scene)`, which looks at the model through a
[`Scene`][quotient_manifolds.models.symmetry.Scene] and records what it finds there:

* a **block family** (`kind = "blocks"`: attention heads, LoRA adapters) claims GL(h) or subgroup
  factor pairs ([`BlockSpec`][quotient_manifolds.models.blocks.BlockSpec]) with
  `scene.claim(block)`; every claim is then probed on its module
  ([`Prober.check_block`][quotient_manifolds.models.prober.Prober.check_block]);
* a **fold family** (`kind = "folds"`: norm gains, bias translations, q/k norms; the complete
  group only) proposes canonical representatives ([`Fold`][quotient_manifolds.models.symmetry.Fold]
  subclasses) with `scene.propose(alternatives, reject=…)`, reading the traced forward pass of
  `scene.prober`; the first alternative of each proposal that the whole-model probe confirms is
  claimed;
* both record what looks like a symmetry but is not claimed with `scene.fallback(...)`.

Blocks and folds are both **candidates**: each knows how to act,
`act(params, generator, a) -> params` moved by a random element of its group, so the probes and
[`reparametrize`][quotient_manifolds.models.reparam.reparametrize] draw from every family the
same way. A fold also has `apply(params) -> (canonical params, frozen masks)`, the canonical
representative of the orbit, which every measure is evaluated at.

Adding a family is one file with one subclass, and one line in
[`FAMILIES`][quotient_manifolds.models.families.FAMILIES] (or
[`register_family`][quotient_manifolds.models.families.register_family] at run time).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import BlockSpecError
from .blocks import BlockSpec
from .prober import Prober
from .records import DEFAULT_SYMMETRY, Fallback

__all__ = [
    "Centring",
    "Fold",
    "Proposal",
    "Scene",
    "SymmetryFamily",
    "full_mask",
    "random_normal",
    "random_scale",
    "rms",
]

Params = Mapping[str, torch.Tensor]


# -- random group elements of the folds -------------------------------------------------------
def random_normal(shape: Sequence[int], generator: torch.Generator | None, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """A standard Gaussian drawn in float64 (the same values whatever `dtype`)."""
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float64).to(
        dtype=dtype, device=device)


def random_scale(shape: Sequence[int], generator: torch.Generator | None, a: float,
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    r"""$c = a\,s\,e^{z}$ with $z \sim N(0, 1)$ and a random sign $s$: a random element of
    $(\mathbb R^*)^k$ (never zero)."""
    z = torch.randn(tuple(shape), generator=generator, dtype=torch.float64)
    s = torch.randint(0, 2, tuple(shape), generator=generator).to(torch.float64) * 2 - 1
    return (a * s * z.exp()).to(dtype=dtype, device=device)


def rms(t: torch.Tensor) -> float:
    """The root mean square of `t` (1 for an empty or all-zero tensor): the scale of a random
    translation of it, so that a probe's group element is well conditioned whatever the
    parameter's magnitude."""
    v = float(t.detach().double().pow(2).mean().sqrt()) if t.numel() else 0.0
    return v if v > 0 and v == v else 1.0


def full_mask(params: Params, name: str) -> torch.Tensor:
    """An all-`True` mask shaped like `params[name]`."""
    t = params[name]
    return torch.ones(t.shape, dtype=torch.bool, device=t.device)


# -- folds --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Centring:
    r"""A linear constraint that the perturbations of a fold's canonical slice satisfy.

    The lines of `param` along `axis` (its slices with every other index fixed; for a 2-D
    parameter only those whose other index is in `start:stop`, `stop = -1` meaning to the end)
    have $\sum_j \xi_j v_j = 0$, with `direction` $v$ (a vector of the axis' length; `None`:
    all ones, a plain sum). A translation fold freezes its orbit direction this way, as a gain
    fold freezes entries.
    """

    param: str
    axis: int = 0
    start: int = 0
    stop: int = -1
    direction: torch.Tensor | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Fold:
    """A symmetry with a canonical representative (a candidate of a fold family).

    Subclasses define `params`, `apply` (the canonical representative), `act` (a random group
    element) and `frozen` (the entries fixed at their canonical value, never perturbed). Folds
    are applied in increasing `order` (a norm gain fold writes consumer biases that the key and
    value bias folds then canonicalise).
    """

    module: str

    kind: ClassVar[str] = "fold"
    order: ClassVar[float] = 0
    invariant: ClassVar[str] = "outputs"  # or "loss": a symmetry of the loss only

    @property
    def params(self) -> tuple[str, ...]:
        """Names of every parameter the fold reads or writes."""
        raise NotImplementedError

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Return `(new params, frozen masks)`; the input is never modified."""
        raise NotImplementedError

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        """`params` moved by a random element of this fold's group (out of place)."""
        raise NotImplementedError

    def frozen(self, params: Params) -> dict[str, torch.Tensor]:
        """Boolean masks of the entries that `apply` fixes (they depend on no value)."""
        return {}

    def constraints(self, params: Params) -> tuple[Centring, ...]:
        """The linear constraints of the perturbations at the canonical point `params` (the
        orbit directions a translation fold removes; none for a fold that freezes entries)."""
        return ()

    def lie_dim(self, params: Params) -> int:
        r"""The number of coordinates $\theta$ of `act_at` (the dimension of the group, or more
        with redundant coordinates)."""
        raise NotImplementedError

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        """`params` moved by the group element of coordinates `theta` (`(lie_dim,)`; `0` is the
        identity), differentiable in `theta` and `params`: its derivative at `theta = 0` spans
        the tangent space of the orbit (what
        [`audit`][quotient_manifolds.models.audit.audit] counts)."""
        raise NotImplementedError

    def describe(self) -> dict:
        """A JSON-friendly summary."""
        return {"kind": self.kind, "module": self.module, "params": list(self.params)}


@dataclass(frozen=True)
class Proposal:
    """Alternative folds for one structure, tried in order; the first the probe confirms is
    claimed. If none is, `reject(prober)` says why (a fallback), or `None` to stay silent."""

    alternatives: tuple[Fold, ...]
    reject: Callable[[Prober], Fallback | None] | None = None


# -- the scene ----------------------------------------------------------------------------------
@dataclass
class Scene:
    """What a family sees of a model, and where it records what it finds.

    Attributes
    ----------
    model : nn.Module
        The user's model: its structure only (it is never run; runs go through `prober`).
    symmetry : str
        `"complete"`, `"full"` or `"paper"` (see
        [`SYMMETRIES`][quotient_manifolds.models.records.SYMMETRIES]).
    modules : dict
        `model.named_modules()`.
    blocks : list of BlockSpec
        Block claims so far; once the blocks are probed (before the fold families run), the
        verified blocks, bias rows included.
    proposals : list of Proposal
        The fold proposals so far.
    fallbacks : list of Fallback
        What looks like a symmetry but is not claimed, with the reason.
    accounted : set of str
        The modules a family has recognised (the modules that look like attention and are in
        nobody's account are reported).
    classes : dict
        Module path to class name, for the warnings.
    input_dims : dict
        Module path to hidden size, for probing a module the traced forward does not reach.
    loss : (loss_fn, batch), optional
        The user's loss and an example batch: folds whose `invariant` is `"loss"` (symmetries of
        the loss only, such as the softmax shift) are claimed only when it is unchanged.
    """

    model: nn.Module
    symmetry: str = DEFAULT_SYMMETRY
    example_inputs: Any = None
    loss: tuple[Callable, Any] | None = None
    modules: dict[str, nn.Module] = field(init=False)
    blocks: list[BlockSpec] = field(default_factory=list)
    proposals: list[Proposal] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    accounted: set[str] = field(default_factory=set)
    classes: dict[str, str] = field(default_factory=dict)
    input_dims: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.modules = dict(self.model.named_modules())
        self._names = {id(p): n for n, p in self.model.named_parameters()}

    @cached_property
    def prober(self) -> Prober:
        """The [`Prober`][quotient_manifolds.models.prober.Prober] of the model (a float64
        traced copy, made on first use)."""
        return Prober(self.model, self.example_inputs, loss=self.loss)

    def pname(self, t: object) -> str | None:
        """The name of `t` in the model (`None` for `None` or a tensor that is no parameter)."""
        return None if t is None else self._names.get(id(t))

    def name(self, t: object) -> str:
        """The name of `t`, a parameter of the model (`BlockSpecError` if it is none: a factor
        part must be a parameter)."""
        n = self.pname(t)
        if n is None:
            raise BlockSpecError(f"param must be a parameter name, got {n!r}")
        return n

    def account(self, name: str, module: nn.Module) -> None:
        """Record that a family recognised `module` (found at `name`)."""
        self.accounted.add(name)
        self.classes[name] = type(module).__name__

    def fallback(self, module: str, kind: str, reason: str) -> None:
        """Record weights that get no symmetry, and why."""
        self.fallbacks.append(Fallback(module, kind, reason))

    def claim(self, block: BlockSpec, input_dim: int | None = None) -> None:
        """Claim a block (probed before it is used); `input_dim` is its module's hidden size."""
        self.blocks.append(block)
        if input_dim is not None:
            self.input_dims.setdefault(block.module, int(input_dim))

    def propose(self, alternatives: Sequence[Fold],
                reject: Callable[[Prober], Fallback | None] | None = None) -> None:
        """Propose alternative folds for one structure (a
        [`Proposal`][quotient_manifolds.models.symmetry.Proposal])."""
        if alternatives:
            self.proposals.append(Proposal(tuple(alternatives), reject))


class SymmetryFamily:
    """One family of continuous symmetries (the plug-in base class).

    Class attributes: `name` (for reports), `kind` (`"blocks"` or `"folds"`), `symmetries` (the
    settings of `symmetry` under which the family is asked: by default every one but the
    paper's; the built-in families added after `"full"` was fixed belong to `"complete"` only).
    A block family reads `scene.symmetry` where it claims less under `"paper"`. Override
    `present` for a fold family whose structure can be ruled out without running the model
    (no norm layer, no bias row): when no fold family is present, the model is not traced for
    folds.
    """

    name: ClassVar[str] = "family"
    kind: ClassVar[str] = "blocks"
    symmetries: ClassVar[tuple[str, ...]] = ("complete", "full")

    def present(self, scene: Scene) -> bool:
        """Whether the model may hold this family's structure (cheap, structural)."""
        return True

    def find(self, scene: Scene) -> None:
        """Record this family's candidates and fallbacks in `scene`."""
        raise NotImplementedError

    def finish(self, scene: Scene) -> None:
        """Called once every family of this kind has run (e.g. to report the modules nobody
        recognised)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
