"""geoopt optimizers on the quotient manifolds: convergence, Scaled, state_dict, ascent."""

import geoopt
import pytest
import torch
from helpers import conditioned_factor, gl_point

import quotient_manifolds as qm

OPTIMIZERS = {
    "sgd": (geoopt.optim.RiemannianSGD, {}),
    "sgd-momentum": (geoopt.optim.RiemannianSGD, {"momentum": 0.9}),
    "sgd-nesterov": (geoopt.optim.RiemannianSGD, {"momentum": 0.9, "nesterov": True}),
    "adam": (geoopt.optim.RiemannianAdam, {}),
    "adam-amsgrad": (geoopt.optim.RiemannianAdam, {"amsgrad": True}),
}
# Learning rates from a sweep over {0.01, 0.03, 0.1, 0.3}: mix preconditions like a
# Gauss-Newton step on G Hᵀ and tolerates larger steps with momentum.
LR = {
    "inv": {"sgd": 0.3, "sgd-momentum": 0.03, "sgd-nesterov": 0.03, "adam": 0.3,
            "adam-amsgrad": 0.3},
    "mix": {"sgd": 0.1, "sgd-momentum": 0.03, "sgd-nesterov": 0.1, "adam": 0.1,
            "adam-amsgrad": 0.1},
}


def _low_rank_problem(metric, retraction, scale=1.0):
    gen = torch.Generator().manual_seed(0)
    target = conditioned_factor(8, 3, gen) @ conditioned_factor(6, 3, gen).T
    M = qm.GLQuotient(8, 6, metric=metric, retraction=retraction)
    base = geoopt.Scaled(M, scale) if scale != 1.0 else M
    x = geoopt.ManifoldParameter(gl_point(M, 3, gen), manifold=base)
    return M, x, target


def _loss(M, x, target):
    return 0.5 * ((M.invariant(x) - target) ** 2).sum()


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_fit_low_rank_matrix_through_GHt(opt, metric):
    cls, kw = OPTIMIZERS[opt]
    M, x, target = _low_rank_problem(metric, "second_order")
    optim = cls([x], lr=LR[metric][opt], **kw)
    start = _loss(M, x, target).item()
    for step in range(1500):  # noqa: B007
        optim.zero_grad()
        loss = _loss(M, x, target)
        loss.backward()
        optim.step()
        if loss.item() < 1e-10:
            break
    assert start > 1.0 and loss.item() < 1e-8, (step, start, loss.item())
    assert x.is_contiguous() and isinstance(x, geoopt.ManifoldParameter)
    # state_dict round trip, then one more step
    optim.load_state_dict(optim.state_dict())
    optim.zero_grad()
    _loss(M, x, target).backward()
    optim.step()
    assert _loss(M, x, target).item() < 1e-8


@pytest.mark.parametrize("retraction", ["first_order", "second_order", "exact"])
def test_scaled_sgd_equals_sgd_with_rescaled_lr(retraction):
    """RSGD on Scaled(M, s) with lr η is RSGD on M with lr η/s (geoopt's Scaled contract)."""
    M, x, target = _low_rank_problem("inv", retraction)
    _, xs, _ = _low_rank_problem("inv", retraction, scale=2.0)
    o1 = geoopt.optim.RiemannianSGD([x], lr=0.01)
    o2 = geoopt.optim.RiemannianSGD([xs], lr=0.02)
    for _ in range(5):
        for o, p in ((o1, x), (o2, xs)):
            o.zero_grad()
            _loss(M, p, target).backward()
            o.step()
    torch.testing.assert_close(xs.detach(), x.detach())


def test_ascent_by_negated_loss_and_no_maximize_flag():
    gen = torch.Generator().manual_seed(1)
    M = qm.GLQuotient(5, 4, metric="mix", retraction="second_order")
    x = geoopt.ManifoldParameter(gl_point(M, 2, gen), manifold=M)
    w = torch.randn(5, 4, generator=gen)
    objective = lambda: torch.tanh((M.invariant(x) * w).sum())  # noqa: E731  (bounded above by 1)
    optim = geoopt.optim.RiemannianSGD([x], lr=0.1)
    start = objective().item()
    for _ in range(300):
        optim.zero_grad()
        (-objective()).backward()  # geoopt has no `maximize`: ascend by minimising the negation
        optim.step()
    assert objective().item() > max(start, 0.99)
    with pytest.raises(TypeError):
        geoopt.optim.RiemannianSGD([x], lr=0.1, maximize=True)


def test_stabilize_leaves_points_on_their_orbit_representative():
    M, x, target = _low_rank_problem("inv", "second_order")
    optim = geoopt.optim.RiemannianSGD([x], lr=0.01, momentum=0.9, stabilize=1)
    optim.zero_grad()
    _loss(M, x, target).backward()
    optim.step()
    before = x.detach().clone()
    optim.stabilize()
    assert torch.equal(x.detach(), before)  # projx is the identity
    buf = optim.state[x]["momentum_buffer"]
    assert M.check_vector_on_tangent(x.detach(), buf, atol=1e-8, rtol=1e-8)


@pytest.mark.parametrize("opt,lr", [("sgd", 1.0), ("adam", 0.3)])
def test_diagonal_net_sparse_regression_inv(opt, lr):
    """Diagonal net u ⊙ v with small init recovers a sparse β* from n < d measurements."""
    gen = torch.Generator().manual_seed(2)
    n, d = 40, 60
    beta = torch.zeros(d)
    beta[:4] = torch.tensor([1.0, 0.8, 0.6, 0.5])
    X = torch.randn(n, d, generator=gen) / n**0.5
    y = X @ beta
    M = qm.DiagonalQuotient(metric="inv", retraction="exact")
    x = geoopt.ManifoldParameter(torch.full((2, d), 0.1), manifold=M)
    cls = geoopt.optim.RiemannianSGD if opt == "sgd" else geoopt.optim.RiemannianAdam
    optim = cls([x], lr=lr)
    for _ in range(2000):
        optim.zero_grad()
        loss = 0.5 * ((X @ M.invariant(x) - y) ** 2).sum()
        loss.backward()
        optim.step()
    assert loss.item() < 5e-3  # from 1.3; zero coordinates decay like e^{2b} (slowly)
    # small initialisation implicitly regularises towards the sparse solution
    assert (M.invariant(x).detach() - beta).abs().max() < 0.06


@pytest.mark.parametrize("retraction", ["second_order", "exact"])
@pytest.mark.parametrize("opt,lr", [("sgd", 0.3), ("adam", 0.3)])
def test_diagonal_net_regression_mix(retraction, opt, lr):
    """mix moves β = u ⊙ v linearly: plain GD on β, fast on a dense target.

    On a sparse target it cannot cross β_i = 0 (the geodesic leaves the manifold
    there; see test_errors.py), so this problem has a positive β*.
    """
    gen = torch.Generator().manual_seed(2)
    n, d = 60, 40
    beta = torch.rand(d, generator=gen) + 0.5
    X = torch.randn(n, d, generator=gen) / n**0.5
    y = X @ beta
    M = qm.DiagonalQuotient(metric="mix", retraction=retraction)
    x = geoopt.ManifoldParameter(torch.ones(2, d), manifold=M)
    cls = geoopt.optim.RiemannianSGD if opt == "sgd" else geoopt.optim.RiemannianAdam
    optim = cls([x], lr=lr)
    for _ in range(800):
        optim.zero_grad()
        loss = 0.5 * ((X @ M.invariant(x) - y) ** 2).sum()
        loss.backward()
        optim.step()
    assert loss.item() < 1e-10
    torch.testing.assert_close(M.invariant(x).detach(), beta, atol=1e-5, rtol=0)
