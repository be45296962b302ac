"""The symmetry plug-in protocol: a user family is one class, found, probed and drawn like the
built-in ones; a wrong claim is rejected by the probe; the registries are left as they were."""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import quotient_manifolds as qm
from quotient_manifolds.models import (
    FAMILIES,
    BlockSpec,
    FactorPart,
    Fold,
    Scene,
    SymmetryFamily,
    register_family,
)
from quotient_manifolds.models.families import attention_layouts
from quotient_manifolds.models.symmetry import full_mask, random_normal

torch.set_num_threads(1)


class LowRank(nn.Module):
    """`y = B (A x)` with no bias: `(A, B) -> (M A, B M⁻¹)` for every invertible `M`."""

    def __init__(self, d: int, r: int, k: int) -> None:
        super().__init__()
        self.down = nn.Parameter(torch.randn(r, d) / math.sqrt(d))
        self.up = nn.Parameter(torch.randn(k, r) / math.sqrt(r))

    def forward(self, x):
        return (x @ self.down.T) @ self.up.T


class Net(nn.Module):
    def __init__(self, d=6, r=3, k=4):
        super().__init__()
        self.low = LowRank(d, r, k)
        self.act = nn.Tanh()
        self.head = nn.Linear(k, 3)
        self.shift = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self.head(self.act(self.low(x))) + self.shift


class LowRankFamily(SymmetryFamily):
    """GL(r) between the two factors of every `LowRank`; `wrong=True` claims the transposed
    layout of `down`, which is no symmetry."""

    name = "low rank"
    kind = "blocks"

    def __init__(self, wrong: bool = False) -> None:
        self.wrong = wrong

    def find(self, scene: Scene) -> None:
        for name, m in scene.modules.items():
            if isinstance(m, LowRank):
                scene.account(name, m)
                r = m.down.shape[0]
                scene.claim(BlockSpec(
                    "custom", name, 1, r, (FactorPart(scene.name(m.up), "cols"),),
                    (FactorPart(scene.name(m.down), "cols" if self.wrong else "rows"),)))


@dataclass(frozen=True)
class ShiftFold(Fold):
    bias: str = ""
    shift: str = ""
    sign: float = -1.0

    kind = "shift"
    order = 2  # before the softmax shift (2.8), which then centres the bias it folded into

    @property
    def params(self):
        return (self.bias, self.shift)

    def _move(self, params, t):
        return {**params, self.bias: params[self.bias] + t,
                self.shift: params[self.shift] + self.sign * t}

    def apply(self, params):
        return self._move(params, params[self.shift]), self.frozen(params)

    def act(self, params, generator=None, a=1.0):
        s = params[self.shift]
        return self._move(params, a * random_normal(s.shape, generator, s.dtype, s.device))

    def frozen(self, params):
        return {self.shift: full_mask(params, self.shift)}


class ShiftFamily(SymmetryFamily):
    name = "shift"
    kind = "folds"

    def __init__(self, sign: float = -1.0) -> None:
        self.sign = sign

    def find(self, scene: Scene) -> None:
        p = scene.prober
        if "shift" in p.params:
            scene.propose([ShiftFold("", "head.bias", "shift", self.sign)])


def _model():
    torch.manual_seed(0)
    return Net().double().eval()


def _x():
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _discover(model, *families, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qm.discover(model, example_inputs=_x(), families=[*FAMILIES, *families], **kw)


def test_a_user_block_family_is_probed():
    sym = _discover(_model(), LowRankFamily())
    assert [b.module for b in sym.blocks] == ["low"]
    assert len(sym.probes) == 1 and sym.probes[0].passed
    bad = _discover(_model(), LowRankFamily(wrong=True))
    assert bad.blocks == () and not bad.probes[0].passed
    assert any(f.module == "low" and "probe rejected" in f.reason for f in bad.fallbacks)


def test_a_user_fold_family_is_probed_and_canonicalised():
    model = _model()
    sym = _discover(model, ShiftFamily())
    assert [f.kind for f in sym.folds] == ["shift"]
    assert _discover(model, ShiftFamily(sign=1.0)).folds == ()
    params = {n: p.detach() for n, p in model.named_parameters()}
    can, frozen = sym.canonicalize(params)
    assert float(can["shift"].abs().max()) == 0 and bool(frozen["shift"].all())
    with torch.no_grad():
        assert torch.allclose(torch.func.functional_call(model, can, (_x(),)), model(_x()),
                              rtol=0, atol=1e-12)


def test_registered_families_are_drawn_and_make_the_measure_invariant():
    model = _model()
    data = [(_x(), torch.randint(0, 3, (5,), generator=torch.Generator().manual_seed(2)))]

    def loss(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])

    moved = copy.deepcopy(model)
    with torch.no_grad():
        M = torch.randn(3, 3, generator=torch.Generator().manual_seed(3),
                        dtype=torch.float64) * 3
        moved.low.down.copy_(M @ moved.low.down)
        moved.low.up.copy_(moved.low.up @ torch.linalg.inv(M))
        moved.head.bias.add_(4.0)
        moved.shift.sub_(4.0)
        assert torch.allclose(moved(_x()), model(_x()), rtol=0, atol=1e-10)

    def value(m):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return qm.geodesic_sharpness(m, loss, data, rho=0.05, n_iter=4).value

    before = list(FAMILIES)
    assert not math.isclose(value(model), value(moved), rel_tol=1e-3)
    register_family(LowRankFamily(), index=0)
    register_family(ShiftFamily())
    try:
        assert math.isclose(value(model), value(moved), rel_tol=1e-6)
        drawn = qm.reparametrize(model, a=2.0, generator=torch.Generator().manual_seed(4),
                                 example_inputs=_x())
        with torch.no_grad():
            assert float((drawn.shift - model.shift).abs().max()) > 0.1
            assert float((drawn.low.down - model.low.down).abs().max()) > 0.1
            assert torch.allclose(drawn(_x()), model(_x()), rtol=0, atol=1e-10)
        assert math.isclose(value(drawn), value(model), rel_tol=1e-6)
    finally:
        FAMILIES[:] = before
    assert FAMILIES == before


def test_registries_refuse_what_is_not_a_plug_in():
    with pytest.raises(TypeError, match="SymmetryFamily"):
        register_family(lambda scene: None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        attention_layouts.register_layout("qkv")  # type: ignore[arg-type]
