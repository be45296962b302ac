r"""Random function-preserving reparametrisation of a model: the invariance self-test.

[`reparametrize`][quotient_manifolds.models.reparam.reparametrize] moves a copy of the model
by a random element of the full symmetry group the library claims for it, and by nothing
else:

* every GL(h) block (paper §6.2): $(G, H) ↦ (G A^{-1}, H A^\top)$ per head with
  $A = a\,\tilde G$, $\tilde G_{ij} \sim N(0, 1)$; for a block restricted to a subgroup
  (rotary embeddings), $A = a \exp(X)$ with a random $X$ of spectral norm 1 in its Lie algebra;
  grouped K/V heads share one element per K/V head (the block's stacked factors);
* every fold ([`Fold`][quotient_manifolds.models.symmetry.Fold]): norm gains scaled by
  random $c ∈ (\mathbb R^*)^d$ and shifted by random $t$, random key-bias translations, random
  value/output translations $(b_V + t, b_O − W_O t)$, random q/k-norm gain scalings.

The model's outputs do not change (up to rounding), so any measure the library claims to be
invariant must give the same value on the copy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from .._args import check_real
from ..errors import ArgumentTypeError
from .blocks import BlockSpec
from .config import check_choice
from .discovery import discover, find_folds
from .families import ValueBiasFold
from .prober import Candidate
from .records import DEFAULT_SYMMETRY, SYMMETRIES
from .symmetry import Fold

__all__ = ["SYMMETRIES", "reparametrize", "transform_params"]


def _symmetries(
    model: nn.Module,
    symmetry: str,
    blocks: Sequence[BlockSpec] | None,
    declared: Iterable[BlockSpec],
    example_inputs,
    loss: tuple[Callable, Any] | None = None,
) -> tuple[list[BlockSpec], list[Fold]]:
    """The blocks (acting on the raw parameters, bias rows included) and folds of `model`."""
    params = dict(model.named_parameters())
    declared = list(declared)
    if blocks is not None:
        bl = [b.resolved(params) for b in list(blocks) + declared]
        folds = find_folds(model, bl, example_inputs=example_inputs, symmetry=symmetry,
                           loss=loss)[0] if symmetry != "paper" else []
        return bl, folds
    sym = discover(model, symmetry=symmetry, declared=declared, warn=False,
                   example_inputs=example_inputs,
                   loss_fn=None if loss is None else loss[0],
                   batch=None if loss is None else loss[1])
    return list(sym.blocks), list(sym.folds)


def _with_fold_rows(
    blocks: Sequence[BlockSpec], folds: Sequence[Fold], params: Mapping[str, torch.Tensor]
) -> list[BlockSpec]:
    """Blocks with the bias rows of the key/value folds put back where they were stripped.

    The GL action must move a value bias together with its head's value rows (else the output
    shifts by $W_O (A^\\top − I) b_V$); if the blocks came stripped for the canonical point,
    the rows are appended again here.  A key bias need not move: it is dead under the softmax
    whatever the Q/K element does to the other rows.
    """
    out = []
    for b in blocks:
        g, h = b.G, b.H
        for f in folds:  # the fold of this block: same module, same output-weight parts
            if (isinstance(f, ValueBiasFold) and f.module == b.module and tuple(f.out) == h
                    and f.part not in g):
                g = g + (f.part,)
        out.append(b if (g, h) == (b.G, b.H) else replace(b, G=g, H=h, n=0, m=0).resolved(
            params))
    return out


def _check_scale(a: object, generator: object) -> float:
    """`a` as a float if it is a finite number > 0 (the scale of the group element), and
    `generator` None or a `torch.Generator`."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ArgumentTypeError(f"generator must be None or a torch.Generator, got {generator!r}"
                                "; pass e.g. generator=torch.Generator().manual_seed(0)")
    return check_real("a", a, minimum=0.0, open_min=True, example=1.0)


def transform_params(
    params: dict[str, torch.Tensor],
    blocks: Sequence[BlockSpec],
    folds: Sequence[Fold] = (),
    *,
    a: float = 1.0,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    r"""`params` moved by a random element of the group of `blocks` and `folds` (out of place).

    `a` and `generator` are as in
    [`reparametrize`][quotient_manifolds.models.reparam.reparametrize]. First every block by
    its GL (or subgroup) element
    ([`BlockSpec.act`][quotient_manifolds.models.blocks.BlockSpec.act]), then every fold by its
    own random element; the algebra runs in float64.  This is the parameter-level core of
    [`reparametrize`][quotient_manifolds.models.reparam.reparametrize].
    """
    a = _check_scale(a, generator)
    cur = {n: t.detach().to(torch.float64) if t.is_floating_point() else t.detach()
           for n, t in params.items()}
    candidates: list[Candidate] = [*_with_fold_rows(blocks, folds, cur), *folds]
    for c in candidates:
        cur = c.act(cur, generator, a)
    return {n: cur[n].to(params[n].dtype) for n in params}


def reparametrize(
    model: nn.Module,
    *,
    a: float = 1.0,
    generator: torch.Generator | None = None,
    symmetry: str = DEFAULT_SYMMETRY,
    blocks: Sequence[BlockSpec] | None = None,
    declared: Iterable[BlockSpec] = (),
    example_inputs: tuple[tuple, dict] | None = None,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    batch: Any = None,
) -> nn.Module:
    r"""A deep copy of `model` moved by a random element of its symmetry group.

    The self-test of invariance: the copy computes the same function (to rounding), and every
    measure that claims invariance under `symmetry` must give the same value on it.

    Parameters
    ----------
    model : nn.Module
        Not modified.
    a : float
        Scale of the group element, a finite number > 0 (0 is not a group element):
        $A = a\,\tilde G$ per GL head (the paper sweeps
        $a ∈ [10^{-2}, 10^{2}]$), norm-gain factors $c = a\,s\,e^{z}$ ($z \sim N(0, 1)$, random
        sign $s$), translations $t \sim N(0, a^2 I)$, subgroup elements $a \exp(X)$ with
        $\|X\|_2 = 1$.
    generator : torch.Generator, optional
        Source of the random element (default: torch's global generator).
    symmetry : {"complete", "full", "paper"}
        `"complete"` (the default): every symmetry the library claims (the full group, and
        MLP neurons, LayerNorm translations, embedding shifts, residual rotations, and with
        `loss_fn` the symmetries of the loss). `"full"`: GL or subgroup blocks, grouped K/V
        heads, norm gains, bias translations, q/k norms. `"paper"`: GL(h) per recognised head
        only, the group of the paper's measure.
    blocks : sequence of BlockSpec, optional
        Use these blocks instead of discovering them (folds are still found unless
        `symmetry="paper"`).
    declared : iterable of BlockSpec
        Extra user blocks ([`declare_block`][quotient_manifolds.models.blocks.declare_block]).
    example_inputs : (args, kwargs), optional
        An input for the probes that confirm the folds (default: derived from the model's
        configuration where possible).
    loss_fn, batch : optional
        The loss and a batch: the symmetries of the loss only (the softmax shift) are drawn
        too, where `loss_fn(model, batch)` confirms them.

    Returns
    -------
    nn.Module
        The reparametrised copy; its parameters keep their dtypes (the algebra runs in float64).

    Examples
    --------
    ```python
    moved = qm.reparametrize(model, a=10.0, generator=torch.Generator().manual_seed(0))
    ```
    """
    check_choice("symmetry", symmetry, SYMMETRIES)
    _check_scale(a, generator)  # before discovery, which can take long
    loss = None if loss_fn is None or batch is None else (loss_fn, batch)
    bl, folds = _symmetries(model, symmetry, blocks, declared, example_inputs, loss)
    new = copy.deepcopy(model)
    params = {n: p.detach() for n, p in new.named_parameters()}
    moved = transform_params(params, bl, folds, a=a, generator=generator)
    live = dict(new.named_parameters())
    with torch.no_grad():
        for n, t in moved.items():
            if t is not params[n]:
                live[n].copy_(t)
    return new
