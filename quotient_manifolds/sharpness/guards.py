r"""The checks a sharpness call makes of what it is given and of what it computes.

Before any work: the model, the loss and the geometry have the right types, the weights are
materialised, finite and not inference tensors, and `data` is a sequence of batches
([`check_call`][quotient_manifolds.sharpness.guards.check_call],
[`check_data`][quotient_manifolds.sharpness.guards.check_data],
[`check_finite_parameters`][quotient_manifolds.sharpness.guards.check_finite_parameters]).
During and after it: the loss reaches the perturbed weights
([`reaches`][quotient_manifolds.sharpness.guards.reaches]), no claimed block has an
identically zero gradient
([`zero_gradient_blocks`][quotient_manifolds.sharpness.guards.zero_gradient_blocks]), and every
solver's maximiser lies in the feasible set
([`check_feasible`][quotient_manifolds.sharpness.guards.check_feasible]).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..errors import (
    ArgumentTypeError,
    InfeasibleSolutionError,
    InferenceModeError,
    NonFiniteError,
    SingleBatchError,
    UnsupportedModelError,
)
from ..models import ModelGeometry
from ..models.config import QuotientConfig
from ..state import fingerprint
from ..tree import tree_leaves
from .feasible import FeasibleSet

__all__ = [
    "batch_fingerprint",
    "check_call",
    "check_data",
    "check_feasible",
    "check_finite_parameters",
    "reaches",
    "zero_gradient_blocks",
]


def check_call(model: object, loss_fn: object, geometry: object) -> None:
    """The arguments every sharpness call needs, before any work.

    Raises
    ------
    UnsupportedModelError
        `model` is not an `nn.Module` instance (e.g. `None` or the class), or holds weights
        on the meta device.
    ArgumentTypeError
        `loss_fn` is not callable, or `geometry` is not a `Geometry`.
    InferenceModeError
        The call runs inside `torch.inference_mode()`, or the weights are inference tensors.
    """
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise UnsupportedModelError(
            f"model is the class {model.__name__}, not a module; pass an instance, e.g. "
            f"model={model.__name__}(...)")
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(
            f"model must be a torch.nn.Module instance, got {type(model).__name__}")
    if not callable(loss_fn):
        raise ArgumentTypeError(
            f"loss_fn must be callable as loss_fn(model, batch) -> scalar tensor, got "
            f"{type(loss_fn).__name__}; e.g. loss_fn=lambda m, b: m(**b).loss")
    if not isinstance(geometry, QuotientConfig):
        hint = (f"; for a metric pass metric={geometry!r} or geometry=Geometry(metric="
                f"{geometry!r})" if isinstance(geometry, str) else "")
        raise ArgumentTypeError(
            f"geometry must be a qm.Geometry, got {type(geometry).__name__}{hint}")
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise UnsupportedModelError(
            f"{type(model).__name__} holds tensors on the meta device ({', '.join(meta[:3])}"
            f"{' …' if len(meta) > 3 else ''}): its weights are not materialised; load them "
            "first (model.to_empty(device=...) then load_state_dict, or from_pretrained)")
    if torch.is_inference_mode_enabled():
        raise InferenceModeError(
            "sharpness is computed inside torch.inference_mode(), where autograd is off; call "
            "it outside (torch.no_grad() around the call is fine)")
    inference = [n for n, p in model.named_parameters() if p.is_inference()]
    if inference:
        raise InferenceModeError(
            f"the weights of {type(model).__name__} were created under torch.inference_mode() "
            f"({', '.join(inference[:3])}): autograd cannot use them; load the model outside "
            "it, or clone them outside it: for p in model.parameters(): p.data = p.data.clone()")


def check_data(data: object) -> None:
    """`data` must be an iterable of batches, not one batch.

    Refused, with [`SingleBatchError`][quotient_manifolds.errors.SingleBatchError]: a tensor
    (its rows would be batches), a dict (its keys would be), a tuple of two or more tensors
    (the `(inputs, targets)` convention), and a list of tensors of different dtypes or
    dimensions (`[x, y]`). A list of tensors of one dtype and dimension is a list of batches
    (e.g. token ids of different lengths).
    """
    hint = "; wrap a single batch in a list, e.g. data=[batch]"
    if isinstance(data, torch.Tensor):
        raise SingleBatchError(
            "data is a tensor: iterating it yields its rows, not batches" + hint)
    if isinstance(data, Mapping):
        raise SingleBatchError(
            "data is a dict (one batch): iterating it yields its keys, not batches" + hint)
    if not isinstance(data, (tuple, list)) or len(data) < 2 or not all(
            isinstance(t, torch.Tensor) for t in data):
        return
    shapes = ", ".join(str(tuple(t.shape)) for t in data[:4]) + (" …" if len(data) > 4 else "")
    if isinstance(data, tuple):
        raise SingleBatchError(
            f"data is a tuple of tensors ({shapes}), which is one (inputs, targets) batch; a "
            "sequence of batches is a list or another iterable" + hint)
    if len({(t.dtype, t.dim()) for t in data}) > 1:
        raise SingleBatchError(
            f"data is a list of tensors of different dtypes or dimensions ({shapes}), which "
            "looks like one [inputs, targets] batch, not a sequence of batches" + hint)


def check_finite_parameters(model: nn.Module, names: Sequence[str]) -> None:
    """Raise [`NonFiniteError`][quotient_manifolds.errors.NonFiniteError] naming every
    selected floating-point parameter with a NaN or an infinity (also one the loss never
    reads: its perturbation would be meaningless)."""
    named = dict(model.named_parameters())
    bad = []
    for n in names:
        p = named[n]
        if p.is_floating_point() or p.is_complex():
            finite = torch.isfinite(p.detach())
            if not bool(finite.all()):
                bad.append(f"{n} ({int((~finite).sum())} of {p.numel()} values)")
    if bad:
        raise NonFiniteError(
            f"the perturbed parameters hold NaN or Inf values: {', '.join(bad[:3])}"
            f"{' …' if len(bad) > 3 else ''}; repair or reload the weights, or leave them out "
            "with params=")


def reaches(loss: torch.Tensor, leaves: Sequence[torch.Tensor]) -> bool:
    """Whether the autograd graph of `loss` reaches one of `leaves` (a walk of its nodes; a
    loss computed from a copy of the model does not)."""
    targets = {id(t) for t in leaves}
    stack = [loss.grad_fn]
    seen: set = set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None and id(var) in targets:
            return True
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return False


def zero_gradient_blocks(geo: ModelGeometry, grads: Sequence[torch.Tensor | None]) -> list[str]:
    """The claimed blocks (`"kind at module (heads i, …)"`) whose gradient is identically zero,
    from the leaves' gradients of
    [`params_and_leaves`][quotient_manifolds.models.model_geometry.ModelGeometry.params_and_leaves]
    (one leaf per block group first)."""
    out = []
    for grp, g in zip(geo.groups, grads, strict=False):
        count = int(grp.x0.shape[0])
        if g is not None and g.shape[:1] != (count,):
            continue  # a batch of problems: not checked
        zero = (torch.ones(count, dtype=torch.bool, device=grp.x0.device) if g is None
                else g.reshape(count, -1).abs().amax(1).eq(0))
        start = 0
        for b in grp.blocks:
            rows = zero[start:start + b.heads]
            start += b.heads
            if bool(rows.all()):
                out.append(f"{b.kind} at {b.module!r}")
            elif bool(rows.any()):
                heads = ", ".join(str(int(i)) for i in rows.nonzero().flatten()[:4])
                out.append(f"{b.kind} at {b.module!r} (heads {heads})")
    return out


def check_feasible(feasible: FeasibleSet, xi: torch.Tensor, batch: int) -> None:
    r"""Raise [`InfeasibleSolutionError`][quotient_manifolds.errors.InfeasibleSolutionError]
    unless the maximiser `xi` lies in `feasible`: its norm at most $\rho(1 + \tau)$ and it moves
    under the horizontal projection by at most $\tau\rho$ in the set's norm, with $\tau =
    10^{-6}$ in float64 and $10^{-3}$ in lower precision (rounding of the iterates)."""
    rho = feasible.rho
    tol = 1e-6 if xi.dtype == torch.float64 else 1e-3
    with torch.no_grad():
        nrm = float(feasible.norm(xi).max())
        off = float(feasible.horizontal_distance(xi).max())
    if nrm <= rho * (1 + tol) and off <= tol * rho:
        return
    what = (f"its norm is {nrm:.6g} = {nrm / rho:.4g}ρ" if not nrm <= rho * (1 + tol) else
            f"it is {off / rho:.3g}ρ away from the horizontal space")
    raise InfeasibleSolutionError(
        f"the solver's maximiser of batch {batch} lies outside the feasible set of radius "
        f"ρ = {rho:g}: {what}. The value there is not the sharpness of the ball; use APGD, or "
        "a geoopt Riemannian optimizer (geoopt.optim.RiemannianSGD/RiemannianAdam) in "
        "GeooptSolver, whose retraction keeps the iterate in the set")


def batch_fingerprint(batch: object) -> tuple:
    """Shapes and float64 sums of every tensor of `batch`: what ranks compare to find out
    that they iterate different data."""
    return tuple((tuple(t.shape), *fingerprint(t)) for t in tree_leaves(batch)
                 if isinstance(t, torch.Tensor))
