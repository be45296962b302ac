"""Retraction orders against geodesics integrated by SciPy's DOP853.

The reference geodesic uses Christoffel symbols obtained by differentiating the
metric tensor with autograd (``manifolds.checks``), so it shares neither the
closed-form Γ nor the integrator with the code under test.
"""

import math

import numpy as np
import pytest
import torch
from helpers import diag_point, gl_point

import quotient_manifolds as qm
from quotient_manifolds.manifolds.checks import reference_geodesic

STEPS = [0.4, 0.2, 0.1, 0.05]


def _case(kind, metric):
    gen = torch.Generator().manual_seed(11)
    if kind == "gl":
        make = lambda r: qm.GLQuotient(3, 2, metric=metric, retraction=r, steps=8)  # noqa: E731
        x = gl_point(make("exact"), 2, gen)
    elif kind == "diagonal":
        make = lambda r: qm.DiagonalQuotient(metric=metric, retraction=r)  # noqa: E731
        x = diag_point(3, gen)
    else:
        eps = 0.0 if metric == "inv" else 0.3  # reuse the axis for eps
        make = lambda r: qm.AdaptiveEuclidean(eps=eps, retraction=r, ndim=1)  # noqa: E731
        x = torch.randn(5, generator=gen)
    u = torch.randn(x.shape, generator=gen)
    M = make("exact")
    u = M.proju(x, u)
    u = u / M.norm(x, u)
    return make, x, u


def _slope(s, err):
    return np.polyfit(np.log(s), np.log(err), 1)[0]


@pytest.mark.parametrize(
    "kind,metric",
    [("gl", "inv"), ("gl", "mix"), ("diagonal", "inv"), ("diagonal", "mix"),
     ("adaptive", "inv"), ("adaptive", "mix")],
)
def test_retraction_orders(kind, metric):
    make, x, u = _case(kind, metric)
    first, second, exact = make("first_order"), make("second_order"), make("exact")
    errs = {"first": [], "second": [], "exact": []}
    for s in STEPS:
        ref = reference_geodesic(exact, x, s * u, tol=1e-13)
        for name, M in (("first", first), ("second", second), ("exact", exact)):
            errs[name].append((M.retr(x, s * u) - ref).abs().max().item())
    slope1, slope2 = _slope(STEPS, errs["first"]), _slope(STEPS, errs["second"])
    assert 1.8 < slope1 < 2.3, (slope1, errs)
    assert 2.7 < slope2 < 3.4, (slope2, errs)
    tol = 1e-10 if kind != "gl" else 1e-7  # closed forms vs RK4 with 8 steps
    assert max(errs["exact"]) < tol, errs["exact"]
    # derivative of the retraction at 0 is the identity
    t = 1e-6
    for M in (first, second, exact):
        fd = (M.retr(x, t * u) - M.retr(x, -t * u)) / (2 * t)
        torch.testing.assert_close(fd, u, atol=1e-7, rtol=1e-7)
        torch.testing.assert_close(M.retr(x, 0 * u), x)


def test_documented_exact_accuracy_at_default_steps():
    """The docstring promise: RK4 error O((‖u‖/steps)⁴), ≲1e-6 at ‖u‖ = 0.5, steps = 8."""
    for metric in ("inv", "mix"):
        make, x, u = _case("gl", metric)
        M = qm.GLQuotient(3, 2, metric=metric, retraction="exact")
        ref = reference_geodesic(M, x, 0.5 * u, tol=1e-13)
        err = (M.expmap(x, 0.5 * u) - ref).abs().max().item()
        assert err < 1e-6, err
        assert math.isfinite(err)
