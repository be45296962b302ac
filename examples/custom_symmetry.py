"""A user-registered symmetry family: a learned shift that duplicates a bias.

A custom head computes ``W x + b + s`` with a separate learned shift ``s`` (a pattern of hand-built
models: a "logit offset" added after a biased projection). Then ``(b, s) ↦ (b + t, s − t)``
leaves the function unchanged for every ``t``: a flat direction that no built-in family knows,
and one that moves adaptive and geodesic sharpness (the adaptive metric ``ξ²/w²`` is not
invariant under translations). This script adds the family in a few lines (a ``Fold`` with the
canonical representative ``s = 0``, a ``SymmetryFamily`` that finds the modules), registers it,
and shows

* that discovery claims it only after the function-preservation probe has confirmed it (a wrong
  claim, ``(b + t, s + t)``, is rejected);
* that geodesic sharpness moves when the model is translated along the new orbit by hand before
  the family is registered, and does not move after;
* that ``qm.reparametrize`` then draws the new symmetry too::

    python examples/custom_symmetry.py [--small]
"""

from __future__ import annotations

import argparse
import copy
import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

import quotient_manifolds as qm
from quotient_manifolds.models import Fold, Scene, SymmetryFamily
from quotient_manifolds.models.symmetry import full_mask, random_normal


class ShiftedHead(nn.Module):
    """`W x + b + s`: a linear map followed by a separate learned shift."""

    def __init__(self, d: int, k: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, k)
        self.shift = nn.Parameter(torch.zeros(k))

    def forward(self, x):
        return self.proj(x) + self.shift


class Net(nn.Module):
    def __init__(self, d: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.head = ShiftedHead(d, classes)

    def forward(self, x):
        return self.head(self.body(x))


# -- the family: one fold, one finder ------------------------------------------------------------
@dataclass(frozen=True)
class ShiftFold(Fold):
    r"""$(b, s) \mapsto (b + t, s - t)$; canonical representative $b \leftarrow b + s$,
    $s = 0$ (frozen)."""

    bias: str = ""
    shift: str = ""
    sign: float = -1.0  # +1 is no symmetry: the wrong claim of the demonstration

    kind = "shift"
    order = 2  # before the softmax shift (2.8), which then centres the bias it folds into

    @property
    def params(self):
        return (self.bias, self.shift)

    def _move(self, params, t):
        out = dict(params)
        out[self.bias] = params[self.bias] + t
        out[self.shift] = params[self.shift] + self.sign * t
        return out

    def apply(self, params):
        return self._move(params, params[self.shift]), self.frozen(params)

    def act(self, params, generator=None, a=1.0):
        s = params[self.shift]
        return self._move(params, a * random_normal(s.shape, generator, s.dtype, s.device))

    def frozen(self, params):
        return {self.shift: full_mask(params, self.shift)}


class Shifts(SymmetryFamily):
    """Every module with a `shift` parameter after its biased linear map `proj`."""

    name = "shifts"
    kind = "folds"

    sign = -1.0

    def find(self, scene: Scene) -> None:
        p = scene.prober  # names in the probed float64 copy (the same as the model's)
        for name, m in p.modules.items():
            s = getattr(m, "shift", None)
            lin = p.modules.get(f"{name}.proj")
            if isinstance(s, nn.Parameter) and isinstance(lin, nn.Linear) and (
                    lin.bias is not None and lin.bias.shape == s.shape):
                scene.propose([ShiftFold(name, p.name(lin.bias), p.name(s), self.sign)])


class WrongShifts(Shifts):
    """A wrong claim, `(b + t, s + t)`: the probe rejects it."""

    sign = 1.0


# -- the demonstration ---------------------------------------------------------------------------
def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="3 APGD steps (CI)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    n_iter = 3 if args.small else 20
    torch.manual_seed(0)
    d = 8
    model = Net(d).double().eval()
    with torch.no_grad():
        model.body[0].bias.normal_(0, 1)
        model.head.proj.bias.normal_(0, 1)
        model.head.shift.normal_(0, 1)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, d, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (16,), generator=g)) for _ in range(2)]
    x0 = data[0][0]

    def folds_found(family):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sym = qm.discover(model, example_inputs=x0,
                              families=[*qm.models.FAMILIES, family])
        return [f.kind for f in sym.folds]

    print("folds with the family:              ", folds_found(Shifts()))
    print("with a wrong claim (b + t, s + t):   ", folds_found(WrongShifts()))
    assert folds_found(Shifts()) == ["shift"] and folds_found(WrongShifts()) == []

    def sharpness(m):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return qm.geodesic_sharpness(m, loss_fn, data, rho=0.05, n_iter=n_iter).value

    moved_by_hand = copy.deepcopy(model)  # (b, s) -> (b + 3, s - 3), written by hand
    with torch.no_grad():
        moved_by_hand.head.proj.bias.add_(3.0)
        moved_by_hand.head.shift.sub_(3.0)
        assert float((model(x0) - moved_by_hand(x0)).abs().max()) < 1e-12
    plain = (sharpness(model), sharpness(moved_by_hand))
    qm.models.register_family(Shifts())
    try:
        quotient = (sharpness(model), sharpness(moved_by_hand))
        drawn = qm.reparametrize(model, a=3.0, generator=torch.Generator().manual_seed(2),
                                 example_inputs=x0)
        with torch.no_grad():
            same = float((model(x0) - drawn(x0)).abs().max())
            shift_moved = float((drawn.head.shift - model.head.shift).abs().max())
        on_drawn = sharpness(drawn)
    finally:
        qm.models.FAMILIES.pop()  # leave the registry as it was
    for what, (a, b) in (("without the family", plain), ("with the family   ", quotient)):
        print(f"geodesic sharpness {what}: {a:.6f}, moved by t = 3: {b:.6f} "
              f"(ratio {b / a:.6f})")
    print(f"reparametrize moves the shift by up to {shift_moved:.2f}, outputs equal to "
          f"{same:.1e}, sharpness {on_drawn:.6f}")
    assert not math.isclose(*plain, rel_tol=1e-3)
    assert math.isclose(*quotient, rel_tol=1e-6)
    assert shift_moved > 0.1 and same < 1e-12 and math.isclose(on_drawn, quotient[0],
                                                               rel_tol=1e-6)


if __name__ == "__main__":
    main()
