"""Half-precision models (forward in the model's dtype, geometry in float32) and devices.

No GPU is available to the test suite: device handling is checked by moving every
manifold with ``.to``, by running the check-free exact integrator on ``meta`` tensors
(no host sync, output on the input's device) and by a scan of the hot paths for a
hard-coded CPU device.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import quotient_manifolds as qm
from quotient_manifolds.geometry import gl

sys.path.insert(0, os.path.dirname(__file__))
from model_zoo import MHANet, ce_loss, mha_data  # noqa: E402

HALF = [torch.bfloat16, torch.float16]
ROOT = Path(qm.__file__).parent


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return MHANet().eval().to(dtype)


def _data(dtype: torch.dtype) -> list:
    return [(x.to(dtype), y) for x, y in mha_data(n_batches=2)]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", HALF)
def test_half_model_needs_the_float32_geometry(dtype):
    with pytest.raises(qm.PrecisionError, match="half='float32'"):
        qm.geodesic_sharpness(_model(dtype), ce_loss, _data(dtype), rho=0.1, n_iter=1)


@pytest.mark.parametrize("retraction", ["second_order", "exact"])
@pytest.mark.parametrize("dtype", HALF)
def test_half_model_forward_in_its_dtype_geometry_in_float32(dtype, retraction):
    model = _model(dtype)
    seen: list[torch.dtype] = []
    hook = model.mha.register_forward_pre_hook(
        lambda m, args: seen.append(m.in_proj_weight.dtype))
    geometry = qm.Geometry(retraction=retraction, half="float32")
    geo = qm.ModelGeometry(model, geometry, warn=False)
    assert geo.dtype == torch.float32 and geo.groups
    assert all(t.dtype == torch.float32 for t in geo.base_points)
    pts = geo.retract(geo.zeros())
    assert all(t.dtype == torch.float32 for t in pts)
    params = geo.params_at(geo.zeros())
    assert all(params[n].dtype == p.dtype for n, p in model.named_parameters())
    res = qm.geodesic_sharpness(model, ce_loss, _data(dtype), rho=0.1, n_iter=3,
                                geometry=geometry)
    hook.remove()
    assert seen and set(seen) == {dtype}  # every forward ran in the model's dtype
    assert all(p.dtype == dtype for p in model.parameters())  # the model is untouched
    ref = qm.geodesic_sharpness(_model(torch.float32), ce_loss, _data(torch.float32), rho=0.1,
                                n_iter=3, geometry=qm.Geometry(retraction=retraction))
    # base losses agree to half-precision rounding of a cross entropy of about 1
    for a, b in zip(res.base_loss, ref.base_loss, strict=True):
        assert abs(a - b) < 2e-2, (a, b)
    assert res.value >= 0 and all(v == v for v in res.per_batch)


@pytest.mark.parametrize("dtype", HALF)
def test_half_model_adaptive_sharpness(dtype):
    res = qm.adaptive_sharpness(_model(dtype), ce_loss, _data(dtype), rho=0.1, n_iter=3,
                                geometry=qm.Geometry(half="float32"))
    assert res.value >= 0 and len(res.per_batch) == 2


def _manifolds():
    x0 = torch.randn(2, 7, 2, dtype=torch.float64)
    gl_m = qm.GLQuotient(4, 3)
    return [gl_m, qm.DiagonalQuotient(), qm.AdaptiveEuclidean(), qm.TangentBall(gl_m, x0, 0.5)]


@pytest.mark.parametrize("index", range(4))
def test_every_manifold_moves_with_to(index):
    M = _manifolds()[index]
    moved = M.to("cpu")
    assert moved is M  # nn.Module.to moves in place and returns self
    for t in list(M.buffers()) + list(M.parameters()):
        assert t.device.type == "cpu"
    if isinstance(M, qm.TangentBall):
        M.to(torch.float32)
        assert M.base_point.dtype == torch.float32
        u = M.random()
        assert u.dtype == torch.float32 and u.device == M.base_point.device


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_exact_integrator_runs_without_host_sync_on_any_device(metric):
    # meta tensors have no data: any .item()/bool() (a host sync) would raise
    x = torch.empty(3, 9, 2, device="meta")
    u = torch.empty(3, 9, 2, device="meta")
    yG, yH = gl.geodesic(x[:, :5], x[:, 5:], u[:, :5], u[:, 5:], metric, eps=0.0, steps=2)
    assert yG.device.type == "meta" and yG.shape == (3, 5, 2) and yH.shape == (3, 4, 2)


HOT_PATHS = ["geometry", "manifolds", "models", "sharpness"]
CPU_PATTERN = re.compile(r"""\.cpu\(\)|device\s*=\s*["']cpu|torch\.device\(\s*["']cpu""")


def test_no_hard_coded_cpu_device_in_hot_paths():
    files = [p for d in HOT_PATHS for p in sorted((ROOT / d).glob("*.py"))]
    assert len(files) > 10
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
           for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
           if CPU_PATTERN.search(line)]
    assert not bad, "hard-coded CPU device:\n" + "\n".join(bad)


def test_samples_follow_the_model_device_and_are_reproducible():
    model = _model(torch.float64)
    geo = qm.ModelGeometry(model, warn=False)
    ball = qm.sharpness.MetricBall(geo.space, 0.1)
    a = geo.space.split(ball.sample(torch.Generator().manual_seed(1)))
    b = geo.space.split(ball.sample(torch.Generator().manual_seed(1)))
    for s, t, x in zip(a, b, geo.base_points, strict=True):
        assert torch.equal(s, t) and s.device == x.device and s.dtype == x.dtype


@pytest.mark.parametrize("dtype", HALF)
def test_half_model_keeps_a_float32_ascent_state(dtype):
    """A bf16/fp16 model with `half="float32"`: the ascent state (the iterates APGD returns)
    is float32, and the sharpness is that of the same weights in float32, to the rounding of
    a forward pass in half precision."""
    seen: list[torch.dtype] = []

    @dataclasses.dataclass(frozen=True)
    class Spy(qm.APGD):
        def solve(self, problem, feasible, base_loss, generator=None):
            best, xi, n = super().solve(problem, feasible, base_loss, generator)
            seen.append(xi.dtype)
            return best, xi, n

    half = _model(dtype)
    full = _model(dtype).float()  # the same (rounded) weights, in float32
    data = _data(dtype)
    res = qm.geodesic_sharpness(half, ce_loss, data, rho=1.0, solver=Spy(n_iter=5),
                                geometry=qm.Geometry(half="float32"))
    ref = qm.geodesic_sharpness(full, ce_loss, [(x.float(), y) for x, y in data], rho=1.0,
                                n_iter=5)
    assert seen == [torch.float32] * len(data)
    assert all(p.dtype == dtype for p in half.parameters())
    assert ref.value > 0.1, ref.value  # a sharpness well above the rounding below
    assert abs(res.value - ref.value) <= 0.1 * ref.value, (res.value, ref.value)
