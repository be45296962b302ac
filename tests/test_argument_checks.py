"""Argument checks of the configurations, solvers and reparametrisation, and the relative
tolerance of the ellipsoid projection (small radii)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_zoo import ce_loss
from torch import nn

import quotient_manifolds as qm
from quotient_manifolds.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
)
from quotient_manifolds.models.config import QuotientConfig, check_choice
from quotient_manifolds.sharpness import Geometry

NAN, INF = float("nan"), float("inf")
FEAS = 1 + 1e-6  # a maximiser's norm may exceed ρ by rounding only


def _mlp() -> tuple[nn.Module, list, object]:
    """A tiny float64 MLP (no GL block), one batch, cross-entropy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g))]
    return model, data, ce_loss


# -- 1. check_choice ---------------------------------------------------------------------
def test_check_choice_raises_invalid_argument_error():
    with pytest.raises(InvalidArgumentError, match=r"metric must be one of .*'euclid'"):
        check_choice("metric", "euclid", ("inv", "mix", None))
    with pytest.raises(InvalidArgumentError, match="retraction"):
        Geometry(retraction="third_order")
    with pytest.raises(InvalidArgumentError, match="ball"):
        Geometry(ball="sphere")
    with pytest.raises(ValueError):  # still a ValueError for old handlers
        QuotientConfig(symmetry="none")
    check_choice("metric", None, ("inv", "mix", None))


# -- 2. the numeric fields of the geometry -----------------------------------------------
@pytest.mark.parametrize("cls", [Geometry, QuotientConfig])
@pytest.mark.parametrize("name", ["eps", "adaptive_eps"])
def test_relaxations_must_be_finite_non_negative_numbers(cls, name):
    with pytest.raises(ArgumentTypeError, match=rf"{name} must be a finite number ≥ 0.*'0.1'"):
        cls(**{name: "0.1"})
    for bad in (True, None):
        with pytest.raises(ArgumentTypeError, match=name):
            cls(**{name: bad})
    for bad in (NAN, INF, -INF, -1e-3):
        with pytest.raises(InvalidArgumentError, match=rf"{name} must be a finite number ≥ 0"):
            cls(**{name: bad})
    g = cls(**{name: np.float32(0.5)})
    assert getattr(g, name) == 0.5 and type(getattr(g, name)) is float
    assert getattr(cls(**{name: 0}), name) == 0.0


@pytest.mark.parametrize("cls", [Geometry, QuotientConfig])
def test_exact_steps_must_be_a_positive_integer(cls):
    for bad in (2.7, 3.0, NAN, INF, 0, -2):
        with pytest.raises(InvalidArgumentError, match="exact_steps must be an integer ≥ 1"):
            cls(retraction="exact", exact_steps=bad)
    for bad in (True, "3", None):
        with pytest.raises(ArgumentTypeError, match="exact_steps"):
            cls(exact_steps=bad)
    g = cls(exact_steps=np.int64(3))
    assert g.exact_steps == 3 and type(g.exact_steps) is int


def test_nan_eps_is_refused_before_any_computation():
    """NaN used to reach the metric and end in "increase eps"; inf gave a sharpness of 0."""
    model, data, loss = _mlp()
    for geo in (Geometry(metric=None), Geometry()):
        for name in ("adaptive_eps", "eps"):
            with pytest.raises(InvalidArgumentError, match=name):
                geo.replace(**{name: NAN})
    with pytest.raises(InvalidArgumentError, match="adaptive_eps"):
        qm.adaptive_sharpness(model, loss, data, rho=0.1,
                              geometry=Geometry(metric=None, adaptive_eps=INF))
