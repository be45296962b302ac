r"""The softmax shift: logits shifted by a constant give the same softmax.

An output head $z = W h + b$ (logits over $V$ classes or tokens) followed by a softmax
cross-entropy has the symmetry $W \mapsto W + \mathbb 1 c^\top$, $b \mapsto b + c_0 \mathbb 1$:
every logit moves by $c^\top h + c_0$, and $\log \mathrm{softmax}$ does not change. This is a
symmetry of the loss, not of the logits, so it is claimed only when the user's loss on the
example batch is unchanged (`invariant = "loss"`); an MSE loss on the logits does not get it.

Canonical representative: the columns of $W$ and $b$ centred over the classes, frozen there
(their perturbations have zero sums over the classes).
"""

from __future__ import annotations

import torch

from ..linear import linear_layer, storage
from ..norms import is_norm, norm_weight
from ..symmetry import Scene, SymmetryFamily
from .centring import CentringFold

__all__ = ["SoftmaxShift", "SoftmaxShiftFold"]


class SoftmaxShiftFold(CentringFold):
    """[`CentringFold`][quotient_manifolds.models.families.centring.CentringFold] over the
    classes of an output head, a symmetry of the softmax cross-entropy only."""

    kind = "softmax_shift"
    order = 2.8
    invariant = "loss"


class SoftmaxShift(SymmetryFamily):
    """The output head: the last linear map whose output is one of the model's outputs (its
    logits, whatever else the model returns, e.g. a loss), when it is not tied to another
    module."""

    name = "softmax shift"
    kind = "folds"
    symmetries = ("complete",)

    def find(self, scene: Scene) -> None:
        p = scene.prober
        if scene.loss is None or not p.reference:
            return
        outs = [t for t in p.reference if t.dim() and t.shape[-1] > 1]
        outputs = {storage(t) for t in outs}
        shapes = {tuple(t.shape) for t in outs}
        heads = [(c, lin) for c in reversed(p.calls)
                 if (lin := linear_layer(p.modules[c.name])) is not None
                 and isinstance(c.out, torch.Tensor)]
        # the head's output is an output, or (BART's final_logits_bias added) the last linear
        # map is shaped like one and is not as wide as a norm (no hidden state)
        widths = {norm_weight(m).numel() for m in p.modules.values() if is_norm(m)}
        for c, lin in ([h for h in heads if storage(h[0].out) in outputs]
                       or [h for h in heads[:1] if tuple(h[0].out.shape) in shapes
                           and h[0].out.shape[-1] not in widths]):
            weight = p.name(lin.weight)
            if p.tied(weight):
                return
            scene.propose([SoftmaxShiftFold(c.name, weight, 1 if lin.transposed else 0)])
            if lin.bias is not None:
                scene.propose([SoftmaxShiftFold(c.name, p.name(lin.bias), 0)])
            return
