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

from ..linear import linear_layer, storage
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
        outputs = {storage(t) for t in p.reference if t.dim() and t.shape[-1] > 1}
        for c in reversed(p.calls):
            lin = linear_layer(p.modules[c.name])
            if lin is None or storage(c.out) not in outputs:
                continue
            weight = p.name(lin.weight)
            if p.tied(weight):
                return
            scene.propose([SoftmaxShiftFold(c.name, weight, 1 if lin.transposed else 0)])
            if lin.bias is not None:
                scene.propose([SoftmaxShiftFold(c.name, p.name(lin.bias), 0)])
            return
