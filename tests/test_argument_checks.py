"""Argument checks of the configurations, solvers and reparametrisation, and the relative
tolerance of the ellipsoid projection (small radii)."""

from __future__ import annotations

import math

import geoopt
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_zoo import MHANet, ce_loss
from torch import nn

import quotient_manifolds as qm
from quotient_manifolds.errors import (
    ArgumentTypeError,
    InfeasibleSolutionError,
    InvalidArgumentError,
    QuotientManifoldError,
)
from quotient_manifolds.models.config import QuotientConfig, check_choice
from quotient_manifolds.sharpness import APGD, Average, Geometry, GeooptSolver
from quotient_manifolds.sharpness.feasible import _ellipsoid_projection
from quotient_manifolds.sharpness.solvers import FeasibleSetManifold

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


# -- 3. the solvers' numeric arguments ---------------------------------------------------
_INT_BAD_VALUE = (NAN, INF, 2.5, 3.0, 0, -1)
_INT_BAD_TYPE = (True, False, "5", None, [3])


@pytest.mark.parametrize("make,name", [
    (lambda v: APGD(n_iter=v), "n_iter"),
    (lambda v: Average(n=v), "n"),
    (lambda v: GeooptSolver(lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.1), n_iter=v),
     "n_iter"),
    (lambda v: APGD().with_iterations(v), "n_iter"),
    (lambda v: Average().with_iterations(v), "n"),
])
def test_counts_must_be_positive_integers(make, name):
    for bad in _INT_BAD_VALUE:
        with pytest.raises(InvalidArgumentError, match=rf"{name} must be an integer ≥ 1"):
            make(bad)
    for bad in _INT_BAD_TYPE:
        with pytest.raises(ArgumentTypeError, match=name):
            make(bad)
    assert make(np.int64(4)) is not None


def test_restarts_and_seeds():
    for bad in (-1, 1.5, NAN):
        with pytest.raises(InvalidArgumentError, match="restarts"):
            APGD(restarts=bad)
    for cls in (APGD, Average):
        for bad in (2**70, 2**63, -1, 1.5, NAN):
            with pytest.raises(InvalidArgumentError, match=r"seed must be an integer in \[0, 2"):
                cls(seed=bad)
        for bad in ("1", True, b"1"):
            with pytest.raises(ArgumentTypeError, match="seed"):
                cls(seed=bad)
        assert cls(seed=2**63 - 1).seed == 2**63 - 1
        s = cls(seed=np.uint32(7)).seed
        assert s == 7 and type(s) is int
    with pytest.raises(ArgumentTypeError, match="progress"):
        APGD(progress="yes")
    with pytest.raises(ArgumentTypeError, match="active_set"):
        APGD(active_set=None)


def test_step_mult_and_momentum():
    for bad in (0, -1.0, NAN, INF):
        with pytest.raises(InvalidArgumentError, match="step_mult must be a finite number > 0"):
            APGD(step_mult=bad)
    for bad in (NAN, INF, -0.1, 1.5):
        with pytest.raises(InvalidArgumentError,
                           match="momentum must be a finite number ≥ 0 and ≤ 1"):
            APGD(momentum=bad)
    with pytest.raises(ArgumentTypeError, match="momentum"):
        APGD(momentum="0.75")
    with pytest.raises(InvalidArgumentError, match="momentum_form"):
        APGD(momentum_form="nesterov")
    a = APGD(momentum=np.float64(0.5), step_mult=2)
    assert (a.momentum, a.step_mult) == (0.5, 2.0)
    # the function itself checks too
    ball = qm.sharpness.feasible.Box(
        qm.manifolds.product.ProductTangentSpace([qm.AdaptiveEuclidean().at(torch.ones(3))]),
        0.1, torch.ones(3))

    def objective(xi):
        return xi.sum(), torch.ones_like(xi)

    for kw in (dict(step_mult=0.0), dict(momentum=NAN), dict(n_iter=NAN)):
        with pytest.raises(InvalidArgumentError, match=next(iter(kw))):
            qm.sharpness.apgd(objective, ball, 0.0, **kw)


def test_n_iter_of_the_drivers_reaches_the_check():
    model, data, loss = _mlp()
    for bad in (NAN, 0, 2.5):
        with pytest.raises(InvalidArgumentError, match="n_iter"):
            qm.geodesic_sharpness(model, loss, data, rho=0.1, n_iter=bad,
                              geometry=Geometry(blocks=()))
        with pytest.raises(InvalidArgumentError, match="n"):
            qm.adaptive_sharpness(model, loss, data, rho=0.1, n_iter=bad,
                                  solver=Average(seed=0))
    with pytest.raises(InvalidArgumentError, match="step_mult"):
        qm.adaptive_sharpness(model, loss, data, rho=0.1, solver=APGD(step_mult=0))


# -- 4. GeooptSolver: what the factory returns, and feasibility ---------------------------
def test_factory_must_be_callable_and_return_an_optimizer():
    with pytest.raises(ArgumentTypeError, match="factory must be a callable"):
        GeooptSolver(None)  # type: ignore[arg-type]
    model, data, loss = _mlp()

    def returns_none(ps):
        return None

    for factory, got in ((returns_none, "None"), (lambda ps: ps, r"\[Parameter")):
        with pytest.raises(ArgumentTypeError,
                           match=rf"factory .* returned {got}.*not a torch.optim.Optimizer"):
            qm.adaptive_sharpness(model, loss, data, rho=0.1,
                                  solver=GeooptSolver(factory, n_iter=2))


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_plain_torch_optimizer_leaving_the_ball_is_refused(norm):
    model, data, loss = _mlp()
    plain = GeooptSolver(lambda ps: torch.optim.SGD(ps, lr=0.5), n_iter=5)
    with pytest.raises(InfeasibleSolutionError, match="geoopt Riemannian optimizer"):
        qm.adaptive_sharpness(model, loss, data, rho=0.01, norm=norm, solver=plain)
    with pytest.raises(InfeasibleSolutionError, match="SGD"):
        qm.geodesic_sharpness(model, loss, data, rho=0.01, solver=plain,
                              geometry=Geometry(blocks=()))
    riem = GeooptSolver(lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.5), n_iter=5)
    r = qm.adaptive_sharpness(model, loss, data, rho=0.01, norm=norm, solver=riem)
    assert math.isfinite(r.value) and r.perturbation_norm[0] <= 0.01 * FEAS


# -- 5. reparametrize --------------------------------------------------------------------
def test_reparametrize_scale_and_generator():
    model = MHANet()
    for bad in (0, 0.0, -1.0, NAN, INF):
        with pytest.raises(InvalidArgumentError, match="a must be a finite number > 0"):
            qm.reparametrize(model, a=bad)
    with pytest.raises(ArgumentTypeError, match="a must be"):
        qm.reparametrize(model, a="2")
    with pytest.raises(ArgumentTypeError, match="generator"):
        qm.reparametrize(model, a=2.0, generator=0)
    with pytest.raises(InvalidArgumentError, match="symmetry"):
        qm.reparametrize(model, symmetry="none")
    moved = qm.reparametrize(model, a=np.float64(2.0), generator=torch.Generator().manual_seed(0))
    assert all(bool(torch.isfinite(p).all()) for p in moved.parameters())


# -- 6. the ellipsoid projection at small radii --------------------------------------------
def _fine_projection(y: torch.Tensor, c: torch.Tensor, rho: float) -> torch.Tensor:
    """The Euclidean projection onto ‖δ ⊘ c‖ ≤ ρ by a long float64 bisection on λ, from a
    bracket that surely contains it."""
    y, c = y.double(), c.double()

    def n(lam):
        return float(torch.linalg.vector_norm(y / (1 + 2 * lam / c**2) / c))

    if n(0.0) <= rho:
        return y
    lo, hi = 0.0, float(n(0.0) / rho * c.max() ** 2)
    for _ in range(400):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if n(mid) > rho else (lo, mid)
    return y / (1 + 2 * hi / c**2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rho", [1e-6, 1e-4, 1e-2, 0.3])
def test_ellipsoid_projection_is_accurate_at_every_radius(rho, dtype):
    g = torch.Generator().manual_seed(0)
    c = (torch.rand(3, 40, generator=g) + 0.1).to(dtype)
    y = (torch.randn(3, 40, generator=g) * torch.tensor([[1e-3], [1.0], [10.0]])).to(dtype)
    p = _ellipsoid_projection(y, c, rho)
    for k in range(3):
        n = float(torch.linalg.vector_norm(p[k].double() / c[k].double()))
        if float(torch.linalg.vector_norm(y[k].double() / c[k].double())) <= rho:
            assert torch.equal(p[k], y[k])  # inside: unchanged
            continue
        top = FEAS if dtype == torch.float64 else 1 + 1e-5  # float32: the norm recomputed
        assert rho * (1 - 1e-4) <= n <= rho * top  # on the boundary (was anywhere below 1e-5)
        ref = _fine_projection(y[k], c[k], rho)
        assert float((p[k].double() - ref).norm() / ref.norm()) < 1e-4


def test_adaptive_sharpness_reaches_the_boundary_at_small_radii():
    """At ρ = 1e-6 the absolute bisection tolerance 1e-5 stopped inside the ellipsoid and
    halved the value; in the linear regime value/ρ is constant."""
    model, data, loss = _mlp()
    per_rho = {}
    for rho in (1e-6, 1e-4, 1e-2):
        r = qm.adaptive_sharpness(model, loss, data, rho=rho, n_iter=20)
        assert 0.99 * rho <= r.perturbation_norm[0] <= rho * FEAS, rho
        per_rho[rho] = r.value / rho
    assert per_rho[1e-6] == pytest.approx(per_rho[1e-4], rel=1e-3)
    assert per_rho[1e-6] == pytest.approx(per_rho[1e-2], rel=2e-2)


def test_feasible_set_manifold_tolerance_is_relative_to_the_radius():
    space = qm.manifolds.product.ProductTangentSpace([qm.AdaptiveEuclidean().at(torch.ones(3))])
    rho = 1e-6
    M = FeasibleSetManifold(qm.sharpness.feasible.MetricBall(space, rho))
    inside = torch.tensor([rho, 0.0, 0.0])
    assert M.check_point_on_manifold(inside)
    assert not M.check_point_on_manifold(5 * inside)  # was accepted: absolute atol 1e-5


# -- hypothesis: any value is accepted or refused with a library error ---------------------
_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 0.0, -0.0, 1, 2, 0.5, 1e-300, 1e300, NAN, INF, -INF, 2**63, 2**70]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=0, max_value=6),
    st.text(max_size=3),
    st.none(),
    st.booleans(),
)
_FIELDS = {
    "apgd": ("n_iter", "momentum", "step_mult", "restarts", "seed", "progress", "active_set"),
    "average": ("n", "seed", "progress"),
    "geoopt": ("n_iter", "progress"),
    "geometry": ("eps", "adaptive_eps", "exact_steps"),
}


def _build(kind: str, name: str, value: object):
    if kind == "apgd":
        return APGD(**{name: value})
    if kind == "average":
        return Average(**{name: value})
    if kind == "geoopt":
        return GeooptSolver(lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.1), **{name: value})
    return Geometry(**{name: value})


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from([(k, n) for k, ns in _FIELDS.items() for n in ns]),
       value=_values)
def test_constructors_accept_or_raise_a_library_error(field, value):
    kind, name = field
    try:
        obj = _build(kind, name, value)
    except QuotientManifoldError as e:
        assert name in str(e) and isinstance(e, (InvalidArgumentError, ArgumentTypeError))
        return
    stored = getattr(obj, name)
    assert type(stored) in (int, float, bool, type(None))  # normalised to plain Python types


_GEO_BASE = {"eps": 1e-3, "adaptive_eps": 1e-3}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(["momentum", "step_mult", "n_iter", "restarts", "seed", "eps",
                              "adaptive_eps", "exact_steps"]),
       value=_values, ball=st.sampled_from(["metric", "ellipsoid"]))
def test_accepted_configurations_give_a_finite_feasible_value(field, value, ball):
    torch.set_num_threads(1)
    model, data, loss = _mlp()
    solver_kw: dict = {"n_iter": 3}
    geo_kw: dict = {"retraction": "exact", "adaptive_retraction": "exact", "blocks": (),
                    **_GEO_BASE}
    target = geo_kw if field in ("eps", "adaptive_eps", "exact_steps") else solver_kw
    target[field] = value
    try:
        solver = APGD(**solver_kw)
        geo = Geometry(**geo_kw)
    except QuotientManifoldError:
        return
    if solver.n_iter > 6 or solver.restarts > 2 or geo.exact_steps > 16:
        return  # accepted, but too long to run here
    if ball == "ellipsoid":
        r = qm.adaptive_sharpness(model, loss, data, rho=1e-3, geometry=geo, solver=solver)
    else:
        r = qm.geodesic_sharpness(model, loss, data, rho=1e-3, geometry=geo, solver=solver)
    assert math.isfinite(r.value)
    assert r.perturbation_norm[0] <= 1e-3 * FEAS
