"""Reliability of the sharpness calls: nothing lost on every path, no silent wrong answer, every
bad input named.

Every call here runs inside `kept(model)`, which checks on return and on exception that the
parameters, buffers, `requires_grad`, modes, `.grad` and the global random generators are
bit-identical.
"""

from __future__ import annotations

import copy
import math
import random
import threading
import warnings
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_zoo import MHANet, ce_loss, mha_data
from torch import nn

import quotient_manifolds as qm
from quotient_manifolds.errors import QuotientManifoldError

F64 = torch.float64


# -- the state check ------------------------------------------------------------------
def _state(model: nn.Module) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "objects": {n: p for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "modes": {n: m.training for n, m in model.named_modules()},
        "grads": {n: (p.grad, None if p.grad is None else p.grad.clone())
                  for n, p in model.named_parameters()},
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state()[1].copy(),  # noqa: NPY002 - the global one
    }


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN equal to NaN."""
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _assert_kept(model: nn.Module, before: dict) -> None:
    after = _state(model)
    assert after["objects"].keys() == before["objects"].keys()
    for n, p in after["objects"].items():
        assert p is before["objects"][n], f"parameter {n} replaced"
        assert _equal(p.detach(), before["params"][n]), f"parameter {n} changed"
    assert after["buffers"].keys() == before["buffers"].keys()
    for n, b in after["buffers"].items():
        assert _equal(b, before["buffers"][n]), f"buffer {n} changed"
    assert after["requires_grad"] == before["requires_grad"]
    assert after["modes"] == before["modes"]
    for n, (g, _) in after["grads"].items():
        g0, v0 = before["grads"][n]
        assert g is g0, f".grad of {n} changed"
        assert g is None or torch.equal(g, v0), f".grad of {n} written"
    assert torch.equal(after["torch_rng"], before["torch_rng"]), "global torch RNG moved"
    assert after["python_rng"] == before["python_rng"], "Python's random moved"
    assert np.array_equal(after["numpy_rng"], before["numpy_rng"]), "NumPy's RNG moved"


@contextmanager
def kept(model: nn.Module):
    """The call inside leaves the model and the generators as they were, raising or not."""
    before = _state(model)
    try:
        yield
    finally:
        _assert_kept(model, before)


def _net(seed: int = 0, train: bool = False) -> MHANet:
    torch.manual_seed(seed)
    m = MHANet().double()
    with torch.no_grad():  # redrawn weights: attention far from uniform
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.7)
    return m.train(train)


def _data(n: int = 2):
    return [(x.double(), y) for x, y in mha_data(n_batches=n)]


def _sharp(model, loss=ce_loss, data=None, **kw):
    kw.setdefault("rho", 0.1)
    kw.setdefault("n_iter", 3)
    return qm.geodesic_sharpness(model, loss, _data() if data is None else data, **kw)


class _BNDropNet(nn.Module):
    """A body (attention, BatchNorm, dropout) and a head that the loss calls one by one."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MHANet()
        self.body.head = nn.Identity()
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.drop(self.body(x)))


def _submodule_loss(m, b):
    x, y = b
    return nn.functional.cross_entropy(m.head(m.drop(m.body(x))), y)


# -- nothing lost ---------------------------------------------------------------------------
def test_loss_calling_submodules_runs_in_eval_mode_and_changes_nothing():
    torch.manual_seed(0)
    model = _BNDropNet().double().train()
    with torch.no_grad():
        model.body.norm.running_mean.normal_()
    ref = None
    for _ in range(2):
        with kept(model):
            r = qm.geodesic_sharpness(model, _submodule_loss, _data(), rho=0.1, n_iter=3)
        assert math.isfinite(r.value) and r.value > 0
        assert ref is None or r.value == ref  # no dropout draw, no running-statistic update
        ref = r.value


def test_loss_calling_eval_leaves_the_modes_as_they_were():
    model = _net(train=True)

    def loss(m, b):
        m.eval()
        return ce_loss(m, b)

    with kept(model):
        _sharp(model, loss)
    assert model.training


def test_loss_calling_train_is_refused_and_restored():
    model = _net()

    def loss(m, b):
        m.train()
        return ce_loss(m, b)

    with kept(model), pytest.raises(qm.errors.ModelStateError, match="train mode"):
        _sharp(model, loss)


def test_loss_writing_a_weight_is_named():
    model = _net()

    def loss(m, b, calls=[0]):  # noqa: B006
        calls[0] += 1
        if calls[0] == 1:  # the first call runs on the model itself (the input capture)
            with torch.no_grad():
                m.head.bias.add_(1e-3)
        return ce_loss(m, b)

    before = model.head.bias.detach().clone()
    with pytest.raises(qm.errors.ModelStateError, match="head.bias"):
        _sharp(model, loss)
    assert not torch.equal(model.head.bias, before)  # it cannot be undone, it is named


class _Counting(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


def test_forward_changing_a_buffer_is_restored_with_a_warning():
    model = _Counting(_net())
    with kept(model), pytest.warns(qm.errors.ModelStateWarning, match="calls"):
        r = _sharp(model)
    assert math.isfinite(r.value)


class _Recompute(torch.autograd.Function):
    """A reversible-style layer: no graph in the forward; the backward recomputes the module
    and calls `torch.autograd.backward` itself (as Reformer's reversible layers do), so the
    module's own `.grad` fills up and the perturbed weights get no gradient."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.save_for_backward(x)
        ctx.module = module
        with torch.no_grad():
            return module(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            torch.autograd.backward(ctx.module(x), g)
        return x.grad, None


class _Attend(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x)[0]


class _ReversibleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.block = _Attend()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(_Recompute.apply(self.emb(x), self.block).mean(1))


def test_reversible_backward_leaves_no_grad_and_zero_block_gradient_is_warned():
    torch.manual_seed(0)
    model = _ReversibleNet().double()
    with kept(model), pytest.warns(qm.errors.ZeroGradientWarning, match="mha"):
        _sharp(model, geometry=qm.Geometry(symmetries=qm.discover(model, warn=False)))
    assert all(p.grad is None for p in model.parameters())


def test_existing_grads_are_kept():
    model = _net()
    model.head.weight.grad = torch.ones_like(model.head.weight)
    with kept(model):
        _sharp(model)


def test_interrupt_in_the_loss_keeps_everything():
    model = _net(train=True)

    def loss(m, b, calls=[0]):  # noqa: B006
        calls[0] += 1
        if calls[0] == 5:
            raise KeyboardInterrupt
        return ce_loss(m, b)

    with kept(model), pytest.raises(KeyboardInterrupt):
        _sharp(model, loss)


def test_shuffled_dataloader_draws_once_and_restores_the_generator():
    from torch.utils.data import DataLoader, TensorDataset

    x, y = torch.randn(12, 5, 4, dtype=F64), torch.randint(0, 3, (12,))
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    model = _net()
    with kept(model):
        a = _sharp(model, data=loader)
    with kept(model):
        b = _sharp(model, data=loader)
    assert len(a.per_batch) == 3 and a.value == b.value


class _SharedIterator:
    """A re-iterable whose `__iter__` hands out one shared iterator."""

    def __init__(self, batches) -> None:
        self.it = iter(batches)

    def __iter__(self):
        return self.it


def test_a_shared_iterator_is_iterated_once_and_every_batch_measured():
    model = _net()
    data = _data(2)
    r = _sharp(model, data=_SharedIterator(data))
    assert len(r.per_batch) == 2
    assert r.per_batch == _sharp(model, data=data).per_batch


# -- no silent wrong answer ----------------------------------------------------------------
def test_plain_torch_optimizer_outside_the_ball_is_refused():
    model = _net()
    solver = qm.GeooptSolver(lambda ps: torch.optim.SGD(ps, lr=0.5), n_iter=5)
    with kept(model), pytest.raises(qm.errors.InfeasibleSolutionError, match="feasible set"):
        _sharp(model, solver=solver)


def test_nan_in_a_parameter_the_loss_never_reads_is_named():
    model = _net()
    model.unused = nn.Parameter(torch.tensor([1.0, float("nan")], dtype=F64))
    with kept(model), pytest.raises(qm.NonFiniteError, match="unused"):
        _sharp(model)


def test_one_batch_as_a_tuple_of_same_shaped_tensors_is_refused():
    x = torch.randn(4, 3, dtype=F64)
    with pytest.raises(qm.errors.SingleBatchError, match="tuple"):
        qm.adaptive_sharpness(nn.Linear(3, 3).double(),
                              lambda m, b: (m(b[0]) - b[1]).square().mean(), (x, x), rho=0.1)


@pytest.mark.parametrize("solver", [None, qm.Average(n=3, seed=0)], ids=["apgd", "average"])
def test_a_loss_of_a_copy_of_the_model_is_refused(solver):
    model = _net()
    twin = copy.deepcopy(model)
    with kept(model), pytest.raises(qm.errors.DetachedLossError, match="copy"):
        _sharp(model, lambda m, b: ce_loss(twin, b), solver=solver)


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        e = self.emb(ids)
        return self.head(self.mha(e, e, e)[0].mean(1))


def test_a_list_of_variable_length_batches_is_measured():
    torch.manual_seed(0)
    model = _Tokens().double()
    data = [torch.randint(0, 20, (3, 5)), torch.randint(0, 20, (3, 7))]

    def loss(m, ids):
        return nn.functional.cross_entropy(m(ids), ids[:, 0] % 3)

    with kept(model):
        r = qm.geodesic_sharpness(model, loss, data, rho=0.1, n_iter=3)
    assert len(r.per_batch) == 2 and all(math.isfinite(v) for v in r.per_batch)


# -- every bad input named ------------------------------------------------------------------
def test_bad_models_are_named():
    with pytest.raises(qm.errors.UnsupportedModelError, match="NoneType"):
        _sharp(None)
    with pytest.raises(qm.errors.UnsupportedModelError, match="class MHANet"):
        _sharp(MHANet)
    with torch.device("meta"):
        meta = MHANet()
    with pytest.raises(qm.errors.UnsupportedModelError, match="meta device"):
        _sharp(meta)
    locked = _net()
    locked.lock = threading.Lock()
    with kept(locked), pytest.raises(qm.errors.UnsupportedModelError, match="copied"):
        _sharp(locked)


def test_bad_arguments_are_named():
    model = _net()
    with kept(model):
        with pytest.raises(qm.errors.ArgumentTypeError, match="metric='mix'"):
            _sharp(model, geometry="mix")
        with pytest.raises(qm.errors.ArgumentTypeError, match="shard"):
            _sharp(model, shard=3)
        with pytest.raises(qm.errors.ArgumentTypeError, match="loss_fn"):
            _sharp(model, None)
        with pytest.raises(qm.errors.InvalidArgumentError, match="shard"):
            _sharp(model, shard="rows")


def test_integer_parameters_and_inference_mode_are_named():
    model = _net()
    model.steps = nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False)
    with kept(model):
        with pytest.raises(qm.errors.ParameterSelectionError, match="not floating point"):
            _sharp(model, params=["steps"])
        with torch.inference_mode(), pytest.raises(qm.errors.InferenceModeError):
            _sharp(model)
    with torch.inference_mode():
        frozen = _net()
    with pytest.raises(qm.errors.InferenceModeError, match="created under"):
        _sharp(frozen)


def test_symmetries_of_another_model_are_refused():
    sym = qm.symmetries_of(_net(), ce_loss, _data())
    other = _Tokens().double()
    with pytest.raises(qm.errors.BlockSpecError, match="another model"):
        qm.geodesic_sharpness(other, lambda m, b: m(b).sum(), [torch.zeros(2, 3).long()],
                              rho=0.1, geometry=qm.Geometry(symmetries=sym))


def test_a_failing_batch_is_named():
    model = _net()
    data = _data(2)
    data[1] = (data[1][0][:, :, :3], data[1][1])  # the model takes 4 features
    with kept(model), pytest.raises(qm.errors.LossEvaluationError, match="batch 1") as e:
        _sharp(model, data=data)
    assert isinstance(e.value.__cause__, RuntimeError)


def test_a_loss_returning_a_vector_is_named():
    model = _net()

    def loss(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1], reduction="none")

    with pytest.raises(qm.errors.LossEvaluationError, match="scalar"):
        _sharp(model, loss)


# -- property-based: bad input is named, good input gives a feasible finite value -----------
_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 2**70), st.none(),
    st.booleans(), st.sampled_from(["0.1", "inv", "mix", ""]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rho=_values,
       n_iter=st.one_of(st.integers(-3, 4), _values.filter(
           lambda v: not isinstance(v, int) or isinstance(v, bool))),
       metric=st.sampled_from([None, "inv", "mix", "adaptive", 3]),
       shard=st.sampled_from([None, "none", "batches", 3, "rows"]),
       average=st.booleans())
def test_generated_arguments_are_named_or_measured(rho, n_iter, metric, shard, average):
    torch.set_num_threads(1)
    model = _MODEL
    solver = qm.Average(n=2, seed=0) if average else None
    with kept(model):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = qm.geodesic_sharpness(model, ce_loss, _DATA, rho=rho, n_iter=n_iter,
                                          metric=metric, shard=shard, solver=solver)
        except QuotientManifoldError:
            return
    assert math.isfinite(r.value)
    for p in r.perturbation_norm:
        assert average or p <= float(rho) * (1 + 1e-6)


_MODEL = _net()
_DATA = _data(1)
