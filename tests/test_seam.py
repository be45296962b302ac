"""The seam between manifolds, models and sharpness: tangent spaces, feasible sets, solvers,
the measure table, parameter selection, named errors and the import layers."""

from __future__ import annotations

import ast
import math
import warnings
from pathlib import Path

import geoopt
import pytest
import torch
from model_zoo import MHANet, ce_loss, mha_data
from torch import nn

import quotient_manifolds as qm
from quotient_manifolds.geometry import gl
from quotient_manifolds.manifolds.base import TangentSpace
from quotient_manifolds.manifolds.product import ProductTangentSpace
from quotient_manifolds.sharpness import feasible as F

ROOT = Path(qm.__file__).parent
F64 = torch.float64


def _nonzero_biases(model: nn.Module) -> nn.Module:
    """Untrained zero biases make the adaptive-norm ball undefined (ZeroWeightError)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "bias" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


# -- tangent spaces ----------------------------------------------------------------------
def _dense_weighted_projection(M: qm.GLQuotient, x: torch.Tensor, u: torch.Tensor,
                               w2: torch.Tensor) -> torch.Tensor:
    """argmin Σ(u − η)²/w2 over horizontal η, by a dense KKT solve (one block)."""
    h = x.shape[-1]
    C = []
    for a in range(h):
        for b in range(h):
            E = torch.zeros(h, h, dtype=F64)
            E[a, b] = 1
            V = M.vertical(x[None], E)[0]  # vertical vector (G E, −H Eᵀ)
            probe = torch.zeros_like(x, requires_grad=True)
            (g,) = torch.autograd.grad(M.inner(x, probe, V), probe)
            C.append(g.reshape(-1))  # the functional u ↦ ⟨u, V⟩_x
    C = torch.stack(C)
    Winv = w2.reshape(-1)
    uf = u.reshape(-1)
    eta = uf - Winv * (C.T @ torch.linalg.solve((C * Winv) @ C.T, C @ uf))
    return eta.reshape(x.shape)


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_weighted_projection_is_exact(metric, eps):
    """proju_weighted: horizontal, idempotent, orthogonal in Σu²/w2, equal to a dense solve."""
    g = torch.Generator().manual_seed(1)
    n, m, h = 6, 5, 3
    M = qm.GLQuotient(n, m, metric, eps)
    x = torch.randn(2, n + m, h, generator=g, dtype=F64)
    ts = M.at(x)
    u, v = torch.randn(2, 2, n + m, h, generator=g, dtype=F64)
    w2 = torch.rand(2, n + m, h, generator=g, dtype=F64) * 3 + 0.05
    pu, pv = ts.proju_weighted(u, w2), ts.proju_weighted(v, w2)
    for k in range(2):
        ref = _dense_weighted_projection(M, x[k], u[k], w2[k])
        torch.testing.assert_close(pu[k], ref, rtol=1e-10, atol=1e-10)
    scale = float(ts.horizontal_residual(u).abs().max())
    assert float(ts.horizontal_residual(pu).abs().max()) < 1e-10 * scale
    torch.testing.assert_close(ts.proju_weighted(pu, w2), pu, rtol=1e-10, atol=1e-10)
    # orthogonality in the weighted inner product: ⟨u − Pu, Pv⟩_W = 0
    ip = ((u - pu) * pv / w2).sum((-2, -1))
    unit = float((u * u / w2).sum().sqrt() * (v * v / w2).sum().sqrt())
    assert float(ip.abs().max()) < 1e-9 * unit


def test_weighted_projection_diagonal_and_adaptive():
    g = torch.Generator().manual_seed(2)
    D = qm.DiagonalQuotient("mix")
    x = D.pack_point(torch.rand(3, 4, generator=g, dtype=F64) + 0.5,
                     torch.rand(3, 4, generator=g, dtype=F64) + 0.5)
    ts = D.at(x)
    u = torch.randn(3, 2, 4, generator=g, dtype=F64)
    w2 = torch.rand(3, 2, 4, generator=g, dtype=F64) + 0.1
    pu = ts.proju_weighted(u, w2)
    # horizontal (η_u/u = η_v/v) and W-orthogonal to every horizontal direction (bu, bv)
    torch.testing.assert_close(pu[:, 0] / x[:, 0], pu[:, 1] / x[:, 1])
    torch.testing.assert_close((((u - pu) / w2) * x).sum(1), torch.zeros(3, 4, dtype=F64),
                               atol=1e-12, rtol=0)
    # with w2 = (u², v²) the weighted projection is the metric projection
    torch.testing.assert_close(ts.proju_weighted(u, x**2), ts.proju(u))
    A = qm.AdaptiveEuclidean(ndim=1).at(torch.rand(5, dtype=F64) + 0.1)
    v = torch.randn(5, dtype=F64)
    assert torch.equal(A.proju_weighted(v, torch.rand(5, dtype=F64)), v)


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_fused_second_order_retraction_matches_the_proven_formula(metric, eps):
    """The engine's retraction (span form, hand-written backward) = x + u − ½Γ(u, u) with the
    polarised Christoffel form, values and gradients (float64)."""
    g = torch.Generator().manual_seed(3)
    n, m, h = 7, 6, 3
    M = qm.GLQuotient(n, m, metric, eps)
    x = torch.randn(4, n + m, h, generator=g, dtype=F64)
    u = (0.3 * torch.randn(4, n + m, h, generator=g, dtype=F64)).requires_grad_()
    y = M.at(x).retract(u, "second_order")
    ref = x + u - 0.5 * M.christoffel(x, u, u)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-13)
    w = torch.randn(y.shape, generator=g, dtype=F64)
    (a,) = torch.autograd.grad(y, u, w)
    (b,) = torch.autograd.grad(ref, u, w)
    torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: M.at(x[:1]).retract(t, "second_order"),
                                    (u[:1].detach().clone().requires_grad_(),))


def test_manifold_methods_run_through_the_tangent_space():
    """geoopt's methods and `at(x)` are one code path (same results, bit for bit)."""
    g = torch.Generator().manual_seed(4)
    for M, x in ((qm.GLQuotient(5, 4, "mix", retraction="second_order"),
                  torch.randn(2, 9, 2, generator=g, dtype=F64)),
                 (qm.DiagonalQuotient("inv", "exact"),
                  torch.rand(2, 2, 3, generator=g, dtype=F64) + 0.5),
                 (qm.AdaptiveEuclidean(0.0, "exact", ndim=1),
                  torch.rand(6, generator=g, dtype=F64) + 0.5)):
        ts = M.at(x)
        u = 0.1 * M.proju(x, torch.randn(x.shape, generator=g, dtype=F64))
        assert torch.equal(M.inner(x, u), ts.inner(u))
        assert torch.equal(M.proju(x, u), ts.proju(u))
        assert torch.equal(M.egrad2rgrad(x, u), ts.egrad2rgrad(u))
        assert torch.equal(M.retr(x, u), ts.retract(u))
        assert torch.equal(M.expmap(x, u), ts.retract(u, "exact"))
    assert qm.manifolds.RETRACTIONS == ("first_order", "second_order", "exact")


# -- feasible sets and solvers ------------------------------------------------------------
WORST = [name for name, m in qm.MEASURES.items() if m.kind == "worst"]


@pytest.mark.parametrize("name", WORST)
def test_every_measure_respects_its_set_through_apgd_and_geoopt(name):
    """Both solvers search the measure's own set: the final norm (the set's norm) ≤ ρ."""
    model = _nonzero_biases(MHANet())
    data = mha_data(n_batches=1)
    meas = qm.MEASURES[name]
    rho = 0.05
    sgd = qm.GeooptSolver(lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.02), n_iter=4)
    adam = qm.GeooptSolver(lambda ps: geoopt.optim.RiemannianAdam(ps, lr=0.01), n_iter=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qm.NoBlocksWarning)
        runs = [qm.geodesic_sharpness(model, ce_loss, data, rho=rho, geometry=meas.geometry,
                                      solver=s) for s in (qm.APGD(n_iter=4), sgd, adam)]
    for r in runs:
        assert r.settings["ball"] == meas.geometry.ball
        assert r.perturbation_norm[0] <= rho * (1 + 1e-6), (name, r.settings["solver"])
        assert math.isfinite(r.value)
    assert runs[0].value > 0


def test_geoopt_path_honours_the_box():
    """The bug of the old geoopt path: ℓ∞ gave the ℓ2 value. The box contains the ellipsoid,
    so its maximum is larger, and the recorded settings belong to the solver that ran."""
    model, data = MHANet(), mha_data(n_batches=1)
    sgd = qm.GeooptSolver(lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.05), n_iter=15)
    l2 = qm.adaptive_sharpness(model, ce_loss, data, rho=0.05, norm="l2", solver=sgd)
    linf = qm.adaptive_sharpness(model, ce_loss, data, rho=0.05, norm="linf", solver=sgd)
    assert linf.value > 2 * l2.value
    assert linf.settings["ball"] == "box" and linf.settings["solver"] == "geoopt"
    assert "momentum" not in linf.settings


class _Quadratic(nn.Module):
    """loss = −½ (p − t)ᵀ A (p − t): a concave quadratic of the parameters p = (G, H, b)."""

    def __init__(self, far: float = 3.0, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.G = nn.Parameter(torch.randn(3, 2, generator=g, dtype=F64) + 0.5)
        self.H = nn.Parameter(torch.randn(4, 2, generator=g, dtype=F64) + 0.5)
        self.b = nn.Parameter(torch.randn(3, generator=g, dtype=F64) + 2.0)
        D = 17
        R = torch.randn(D, D, generator=g, dtype=F64)
        self.register_buffer("A", R @ R.T / D + 0.5 * torch.eye(D, dtype=F64))
        p0 = self.flat().detach()
        self.register_buffer("t", p0 + far * torch.randn(D, generator=g, dtype=F64))

    def flat(self) -> torch.Tensor:
        return torch.cat([self.G.reshape(-1), self.H.reshape(-1), self.b])

    def forward(self, batch):
        d = self.flat() - self.t
        return -0.5 * d @ self.A @ d


def _quad_loss(model, batch):
    return model(batch)


SPEC = qm.declare_block(G="G", H="H")


def _trust_region_max(model: _Quadratic, geometry: qm.Geometry, rho: float) -> float:
    """The exact maximum of the quadratic over {ξ horizontal, ‖ξ‖ ≤ ρ} (first-order
    retraction): a trust-region problem in an orthonormal basis of the horizontal space."""
    geo = qm.ModelGeometry(model, geometry)
    D = geo.D
    eye = torch.eye(D, dtype=F64)
    ball = F.make_feasible(geometry.ball, geo.space, rho,
                           w2=None if geometry.ball == "metric" else geo.w2())
    def flat(xi):
        return torch.cat([t.reshape(-1) for t in geo.params_at(xi).values()])

    L = torch.stack([flat(e) for e in eye], 1) - flat(0 * eye[0])[:, None]
    names = [n for n, _ in model.named_parameters()]
    assert names == ["G", "H", "b"]
    P = torch.stack([ball.proju(e) for e in eye], 1)  # projector onto the horizontal space
    Kmat = torch.stack([torch.stack([ball.inner(a, b) for b in eye]) for a in eye])
    U, s, _ = torch.linalg.svd(P)
    V = U[:, s > 1e-8]  # a basis of the horizontal space
    # K-orthonormalise: V (Vᵀ K V)^{-1/2}
    evals, evecs = torch.linalg.eigh(V.T @ Kmat @ V)
    V = V @ evecs @ torch.diag(evals.rsqrt()) @ evecs.T
    r = model.t - model.flat().detach()
    Mq = (L @ V).T @ model.A @ (L @ V)
    b = (L @ V).T @ model.A @ r

    def y(lam):
        return torch.linalg.solve(Mq + lam * torch.eye(len(b), dtype=F64), b)

    lo, hi = 0.0, 1.0
    assert float(y(0.0).norm()) > rho  # the unconstrained maximum lies outside the ball
    while float(y(hi).norm()) > rho:
        hi *= 2
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if float(y(mid).norm()) > rho else (lo, mid)
    ys = y(hi)
    return float(-0.5 * ys @ Mq @ ys + b @ ys)


@pytest.mark.parametrize("ball,metric", [("metric", "inv"), ("metric", "mix"),
                                         ("adaptive", "inv"), ("adaptive", "mix"),
                                         ("metric", None), ("box", None)])
def test_apgd_and_geoopt_agree_on_a_concave_quadratic(ball, metric):
    """Unconstrained maximum outside the ball: APGD and the geoopt path reach the same value
    (to 1e-6), and for the balls of an inner product it is the exact trust-region maximum."""
    far = 30.0 if ball == "box" else 3.0  # box: every coordinate at its bound
    model = _Quadratic(far)
    blocks = () if metric is None else (SPEC,)
    geometry = qm.Geometry(metric=metric, ball=ball, blocks=blocks, retraction="first_order")
    rho = 0.3
    a = qm.geodesic_sharpness(model, _quad_loss, [None], rho=rho, geometry=geometry,
                              solver=qm.APGD(n_iter=100))
    sgd = qm.GeooptSolver(lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.2), n_iter=250)
    b = qm.geodesic_sharpness(model, _quad_loss, [None], rho=rho, geometry=geometry, solver=sgd)
    assert a.value == pytest.approx(b.value, rel=1e-6, abs=1e-6)
    assert a.perturbation_norm[0] == pytest.approx(rho, rel=1e-9)
    if ball != "box":
        assert a.value == pytest.approx(_trust_region_max(model, geometry, rho), rel=1e-8)


def test_adaptive_norm_ball_projection_is_orthogonal_in_its_own_norm():
    """The old ablation projected with the block metric's Π, which is not orthogonal in the
    adaptive norm: on this quadratic its maximum is visibly lower than the exact one."""
    model = _Quadratic(3.0)
    geometry = qm.Geometry(metric="inv", ball="adaptive", blocks=(SPEC,), retraction="first_order")
    exact = _trust_region_max(model, geometry, 0.3)
    geo = qm.ModelGeometry(model, geometry)

    class MetricPi(F.AdaptiveNormBall):  # the previous, inconsistent projection
        def _proj(self, u):
            return self.space.proju(u)

    ball = MetricPi(geo.space, 0.3, geo.w2())

    def objective(xi):
        x = xi.detach().requires_grad_()
        val = torch.func.functional_call(model, geo.params_at(x), (None,))
        (grad,) = torch.autograd.grad(val, x)
        return val.detach(), grad

    base = float(model(None).detach())
    old = float(qm.sharpness.apgd(objective, ball, base, n_iter=200).best_loss) - base
    assert old < exact * (1 - 1e-3)


def test_ellipsoid_is_the_reference_algorithm():
    """The reference ℓ2 step c ⊙ ∇/‖∇‖ with the Euclidean projection onto the ellipsoid (by
    bisection to 1e-5): the projection is the Euclidean one (KKT), steps stay in the set."""
    g = torch.Generator().manual_seed(0)
    c = torch.rand(50, generator=g) + 0.1
    y = torch.randn(50, generator=g)
    y[:10] = 0.0
    p = F._ellipsoid_projection(y, c, 0.3)
    assert torch.equal(p[:10], torch.zeros(10))
    assert abs(float((p / c).norm()) - 0.3) < 1e-5
    n = p / c**2  # y − p is parallel to the ellipsoid normal
    cos = float((y - p) @ n / ((y - p).norm() * n.norm()))
    assert cos == pytest.approx(1.0, abs=1e-6)
    # batched: one λ per problem
    Y = torch.stack([y, 3 * y, 0.001 * y])
    P = F._ellipsoid_projection(Y, c, 0.3)
    for k in range(3):
        torch.testing.assert_close(P[k], F._ellipsoid_projection(Y[k], c, 0.3))


def test_feasible_sets_on_a_batch_of_problems():
    """Sets over (B, D) vectors: norms, projections and samples are per problem."""
    g = torch.Generator().manual_seed(7)
    M = qm.DiagonalQuotient("inv")
    x = M.pack_point(torch.rand(3, 4, generator=g, dtype=F64) + 0.5,
                     torch.rand(3, 4, generator=g, dtype=F64) + 0.5)
    space = ProductTangentSpace([M.at(x)], (3,))
    for ball in (F.MetricBall(space, 0.2), F.AdaptiveNormBall(space, 0.2, space.join([x * x]))):
        u = 5 * torch.randn(3, 8, generator=g, dtype=F64)
        p = ball.project(u)
        torch.testing.assert_close(ball.norm(p), torch.full((3,), 0.2, dtype=F64))
        torch.testing.assert_close(ball.project(p), p)
        s = ball.sample([torch.Generator().manual_seed(i) for i in range(3)])
        assert s.shape == (3, 8) and bool((ball.proju(s) - s).abs().max() < 1e-12)


def _one_space_per_family(dtype: torch.dtype = F64) -> list[TangentSpace]:
    """A tangent space of every manifold family at a batch of 2 problems."""
    g = torch.Generator().manual_seed(11)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=g, dtype=F64) + 0.5).to(dtype)

    sub = qm.manifolds.BlockDiagonal(2, ((0,), (1,)))
    return [qm.GLQuotient(3, 3, "inv").at(torch.randn(2, 6, 2, generator=g).to(dtype)),
            qm.GLQuotient(3, 3, "mix", subalgebra=sub).at(
                torch.randn(2, 6, 2, generator=g).to(dtype)),
            qm.DiagonalQuotient("inv").at(rand(2, 2, 3)),
            qm.AdaptiveEuclidean(ndim=1).at(rand(2, 5))]


@pytest.mark.parametrize("kind", ["first_order", "second_order", "exact"])
def test_retract_into_a_buffer_is_the_retraction(kind):
    """`retract(u, kind, out=buf)` writes the same point into `buf`, bit for bit."""
    for ts in _one_space_per_family():
        u = 0.05 * ts.proju(torch.randn(ts.x0.shape, generator=torch.Generator().manual_seed(1),
                                        dtype=F64))
        buf = torch.full_like(ts.x0, float("nan"))
        y = ts.retract(u, kind, out=buf)
        assert y is buf, type(ts).__name__
        assert torch.equal(buf, ts.retract(u, kind)), (type(ts).__name__, kind)


class _SpyFactor(TangentSpace):
    """⟨u, v⟩ = Σ u v / 2 on the last dimension, no vertical space; counts the product's
    requests for its gradient and norm."""

    calls = 0

    def inner(self, u, v=None):
        return (u * (u if v is None else v)).sum(-1) / 2

    def proju(self, u):
        return u

    def egrad2rgrad(self, g, *, out=None):
        return 2.0 * g if out is None else torch.mul(g, 2.0, out=out)

    def egrad2rgrad_and_norm2(self, g, *, out=None):
        type(self).calls += 1
        r = self.egrad2rgrad(g, out=out)
        return r, self.inner(r)


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_the_product_asks_each_factor_for_its_gradient(dtype):
    """The product's gradient and norm come from each factor's own answer, whatever its type
    (a factor class unknown to the product included), and land in the input."""
    spaces = [*_one_space_per_family(dtype),
              _SpyFactor(qm.AdaptiveEuclidean(), torch.ones(2, 4, dtype=dtype))]
    if dtype == torch.bfloat16:  # the block factors need float32 or float64 algebra
        spaces = [s for s in spaces if not isinstance(s, qm.manifolds.gl_quotient.GLTangentSpace)]
    P = ProductTangentSpace(spaces, (2,))
    g = torch.randn(2, P.D, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = P.egrad2rgrad(g)
    _SpyFactor.calls = 0
    g_in = g.clone()
    r, n2 = P.egrad2rgrad_and_norm2(g_in)
    assert _SpyFactor.calls == 1
    assert r is g_in
    assert torch.equal(r, expected)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(n2.double(), P.inner(expected).double(), rtol=tol, atol=0)
    out = torch.full_like(g, float("nan"))
    assert P.egrad2rgrad(g, out=out) is out and torch.equal(out, expected)
    for s, a in zip(P.spaces, P.split(g.clone()), strict=True):  # out=g, factor by factor
        want = s.egrad2rgrad(a.clone())
        assert s.egrad2rgrad(a, out=a) is a and torch.equal(a, want), type(s).__name__


def test_the_product_knows_no_concrete_factor():
    path = ROOT / "manifolds" / "product.py"
    names = _imports(path)
    assert all(not n.startswith(f"quotient_manifolds.manifolds.{m}")
               for n in names for m in ("adaptive", "diagonal", "gl_quotient")), names
    assert "isinstance" not in path.read_text()


# -- parameters, errors ---------------------------------------------------------------------
def test_params_selection_forms():
    model = MHANet()
    names = [n for n, _ in model.named_parameters()]
    full = qm.ModelGeometry(model, warn=False)
    assert full.selected == tuple(names)
    head = [n for n in names if n.startswith("head")]
    for sel in (head, lambda n, p: n.startswith("head"),
                {n: p for n, p in model.named_parameters() if n.startswith("head")},
                [model.head.weight, model.head.bias]):
        geo = qm.ModelGeometry(model, params=sel, warn=False)
        assert geo.selected == tuple(head)
        assert geo.D == sum(p.numel() for p in model.head.parameters())
        # the attention blocks are not selected: recorded as fallbacks
        assert not geo.groups and {f.kind for f in geo.fallbacks} >= {"attention.qk"}
    with pytest.raises(qm.ParameterSelectionError, match="did you mean"):
        qm.ModelGeometry(model, params=["head.wieght", "head.weight"], warn=False)
    with pytest.raises(qm.ParameterSelectionError, match="wrap"):
        qm.ModelGeometry(model, params="head.weight", warn=False)
    with pytest.raises(qm.ParameterSelectionError, match="not the model's parameter"):
        qm.ModelGeometry(model, params={"head.weight": torch.zeros(3)}, warn=False)
    with pytest.raises(qm.NoParametersError, match="params="):
        qm.ModelGeometry(model, params=lambda n, p: False, warn=False)


def test_requires_grad_default_and_partial_blocks():
    """Frozen weights are not perturbed; a block with a frozen part falls back to adaptive."""
    model = MHANet()
    model.mha.out_proj.weight.requires_grad_(False)  # the H factor of the V/O block
    geo = qm.ModelGeometry(model, warn=False)
    assert "mha.out_proj.weight" not in geo.selected
    assert [b.kind for b in geo.blocks] == ["attention.qk"]
    fb = [f for f in geo.fallbacks if f.kind == "attention.vo"]
    assert fb and "mha.out_proj.weight" in fb[0].reason
    snap = {n: p.detach().clone() for n, p in model.named_parameters()}
    r = qm.geodesic_sharpness(model, ce_loss, mha_data(n_batches=1), rho=0.1, n_iter=3)
    assert r.settings["perturbed_parameters"] == len(geo.selected)
    assert all(torch.equal(p, snap[n]) for n, p in model.named_parameters())
    assert not model.mha.out_proj.weight.requires_grad


def test_peft_lora_perturbs_only_the_adapters():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    net = get_peft_model(base, LoraConfig(r=2, target_modules=["0", "2"],
                                          init_lora_weights=False)).double()
    geo = qm.ModelGeometry(net, warn=False)
    lora = [n for n, p in net.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n in lora)
    assert geo.selected == tuple(lora)
    assert [b.kind for b in geo.blocks] == ["lora", "lora"]
    assert geo.D == sum(p.numel() for n, p in net.named_parameters() if p.requires_grad)
    data = [(torch.randn(5, 6, dtype=F64), torch.randint(0, 3, (5,)))]
    r = qm.geodesic_sharpness(net, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                              data, rho=0.1, n_iter=3)
    assert r.value > 0 and len(r.blocks) == 2


def test_named_errors_on_common_mistakes():
    model, data = MHANet(), mha_data(n_batches=1)
    x, y = data[0]
    for bad in (x, (x, y), {"x": x, "y": y}):
        with pytest.raises(qm.SingleBatchError, match=r"data=\[batch\]"):
            qm.geodesic_sharpness(model, ce_loss, bad, rho=0.1, n_iter=2)
    with pytest.raises(qm.DetachedLossError, match="grad_fn"):
        qm.geodesic_sharpness(model, lambda m, b: ce_loss(m, b).detach(), data, rho=0.1,
                              n_iter=2)

    class Empty(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(qm.NoParametersError, match="no parameters"):
        qm.geodesic_sharpness(Empty(), lambda m, b: b[0].sum(), data, rho=0.1)
    frozen = MHANet().requires_grad_(False)
    with pytest.raises(qm.NoParametersError, match="requires_grad"):
        qm.geodesic_sharpness(frozen, ce_loss, data, rho=0.1)


def test_no_global_state_and_quiet_by_default(capsys):
    model, data = MHANet(), mha_data(n_batches=2)
    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    qm.geodesic_sharpness(model, ce_loss, data, rho=0.1, n_iter=2)
    qm.geodesic_sharpness(model, ce_loss, data, rho=0.1, n_iter=2, solver=qm.Average())
    assert torch.equal(torch.get_rng_state(), rng) and torch.get_num_threads() == threads
    assert capsys.readouterr().err == ""
    qm.geodesic_sharpness(model, ce_loss, data, rho=0.1, solver=qm.APGD(n_iter=2, progress=True))
    assert "sharpness" in capsys.readouterr().err


def test_library_sets_no_threads_or_global_seeds():
    """Thread counts only in command-line entry points (the CLI package, `symbolic/cli.py`,
    a module's `if __name__ == "__main__":` block); global seeds only inside `fork_rng`."""
    bad = []
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        lines = p.read_text().splitlines()
        main_block = next((i for i, line in enumerate(lines)
                           if line.startswith("if __name__ == \"__main__\":")), len(lines))
        for i, line in enumerate(lines):
            code = line.split("#")[0]
            if "set_num_threads(" in code and not (rel.startswith("cli/")
                                                    or rel == "symbolic/cli.py"
                                                    or i > main_block):
                bad.append(f"{rel}:{i + 1}")
            if "torch.manual_seed(" in code and not any("fork_rng" in lines[j]
                                                         for j in range(max(0, i - 3), i)):
                bad.append(f"{rel}:{i + 1}")
    assert not bad, bad


# -- the measure table ------------------------------------------------------------------------
def test_measure_table_names_and_settings():
    names = set(qm.MEASURES)
    for want in ("adaptive", "adaptive-linf", "adaptive-metric", "geodesic-inv", "geodesic-mix",
                 "geodesic-inv-full", "geodesic-mix-full", "geodesic-inv-adaptive-norm",
                 "geodesic-mix-first-order", "geodesic-inv-average", "adaptive-average"):
        assert want in names
    assert qm.MEASURES["geodesic-inv"].geometry.symmetry == "paper"
    assert qm.MEASURES["geodesic-inv-full"].geometry.symmetry == "full"
    assert qm.MEASURES["geodesic-mix-first-order"].geometry.retraction == "first_order"
    assert qm.MEASURES["geodesic-mix-adaptive-norm"].norm == "adaptive"
    assert qm.MEASURES["geodesic-mix"].key == "geodesic_mix"
    assert qm.sharpness.measure("geodesic_inv") is qm.MEASURES["geodesic-inv"]
    model, data = MHANet(), mha_data(n_batches=1)
    r = qm.MEASURES["geodesic-mix"].run(model, ce_loss, data, rho=0.1, n_iter=3)
    s = qm.geodesic_sharpness(model, ce_loss, data, rho=0.1, metric="mix", n_iter=3,
                              geometry=qm.Geometry(symmetry="paper"))
    assert r.per_batch == s.per_batch and r.settings["symmetry"] == "paper"
    avg = qm.MEASURES["adaptive-average"].run(model, ce_loss, data, rho=0.1, n_iter=3, seed=4)
    assert avg.kind == "average" and avg.settings["seed"] == 4


def test_public_signature_is_small():
    import inspect

    assert len(inspect.signature(qm.geodesic_sharpness).parameters) <= 10
    assert len(inspect.signature(qm.adaptive_sharpness).parameters) <= 10


# -- layers ------------------------------------------------------------------------------------
LAYERS = {"errors": 0, "geometry": 1, "manifolds": 2, "models": 3, "sharpness": 4,
          "symbolic": 4, "experiments": 5, "cli": 6}


def _imports(path: Path) -> list[str]:
    """Absolute names of the quotient_manifolds modules imported by `path`."""
    pkg = path.relative_to(ROOT.parent).with_suffix("").parts
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(pkg[: len(pkg) - node.level])
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [f"{mod}.{a.name}" for a in node.names] if not node.module else [mod]
                out += names
            elif node.module and node.module.startswith("quotient_manifolds"):
                out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("quotient_manifolds")]
    return out


def test_each_layer_imports_only_layers_below():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).parts
        if len(rel) < 2 or rel[0] not in LAYERS:
            continue
        mine = LAYERS[rel[0]]
        for name in _imports(path):
            parts = name.split(".")
            if len(parts) < 2 or parts[1] not in LAYERS:
                continue
            other = LAYERS[parts[1]]
            if other > mine or (other == mine and parts[1] != rel[0]):
                bad.append(f"{'/'.join(rel)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_engine_reaches_the_geometry_only_through_tangent_spaces():
    """No kernel of `geometry/` is called by the sharpness layer or the model geometry."""
    files = [*(ROOT / "sharpness").glob("*.py"), ROOT / "models" / "model_geometry.py"]
    bad = [f"{p.name}: {n}" for p in files for n in _imports(p)
           if n.startswith("quotient_manifolds.geometry")]
    assert not bad, bad
    geo = qm.ModelGeometry(MHANet(), warn=False)
    for space, grp in zip(geo.space.spaces, geo.groups, strict=False):
        assert isinstance(space, qm.manifolds.gl_quotient.GLTangentSpace)
        assert space.manifold is grp.manifold
    assert isinstance(geo.space.spaces[-1], qm.manifolds.adaptive.AdaptiveTangentSpace)
    assert gl.METRICS == ("inv", "mix")


def test_the_adaptive_point_is_the_tangent_spaces_retraction(monkeypatch):
    """`params_and_leaves` reaches the first-order adaptive point $w + \\xi$ through the
    adaptive tangent space's `retract`, into one buffer reused from call to call."""
    geo = qm.ModelGeometry(_nonzero_biases(MHANet().double()), warn=False)
    space = geo.adaptive_space
    calls = []
    retract = space.retract

    def spy(u, kind=None, *, out=None):
        calls.append((kind, out))
        return retract(u, kind, out=out)

    monkeypatch.setattr(space, "retract", spy)
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):
        xi = 1e-2 * torch.randn(geo.D, generator=gen, dtype=geo.dtype)
        _, leaves = geo.params_and_leaves(xi)
        point = torch.cat([t.detach().reshape(-1) for t in leaves[len(geo.groups):]])
        assert torch.equal(point, space.x0 + geo.space.split(xi)[-1])
    assert [k for k, _ in calls] == ["first_order"] * 2
    assert calls[0][1] is not None and calls[1][1] is calls[0][1]


class _TwoInputClassifier(torch.nn.Module):
    """A model whose forward needs two inputs: no default example input reaches it."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.emb = torch.nn.Embedding(20, 8)
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = torch.nn.Linear(8, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        y, _ = self.attn(x, x, x, key_padding_mask=~mask, need_weights=False)
        return self.head(y.mean(1))


def test_full_symmetry_probes_folds_on_the_first_batch():
    torch.manual_seed(0)
    model = _TwoInputClassifier().double()
    ids = torch.randint(0, 20, (6, 5))
    mask = torch.ones(6, 5, dtype=torch.bool)
    y = torch.randint(0, 3, (6,))

    def loss(m, b):
        return torch.nn.functional.cross_entropy(m(b[0], b[1]), b[2])

    data = [(ids, mask, y)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", qm.SymmetryFallbackWarning)
        full = qm.geodesic_sharpness(model, loss, data, rho=0.1, n_iter=3)
    assert not [f for f in full.fallbacks if "folds" in str(f)]
    paper = qm.geodesic_sharpness(model, loss, data, rho=0.1, n_iter=3,
                                  geometry=qm.Geometry(symmetry="paper"))
    assert full.value != paper.value  # the value-bias fold changed the point
    # a one-shot iterator is iterated once: its first batch is probed, and then measured
    with warnings.catch_warnings():
        warnings.simplefilter("error", qm.SymmetryFallbackWarning)
        once = qm.geodesic_sharpness(model, loss, iter(data), rho=0.1, n_iter=3)
    assert once.value == full.value and len(once.per_batch) == len(data)


def _two_input_setup():
    model = _TwoInputClassifier().double()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 20, (6, 5), generator=g)
    mask = torch.ones(6, 5, dtype=torch.bool)
    y = torch.randint(0, 3, (6,), generator=g)

    def loss(m, b):
        return torch.nn.functional.cross_entropy(m(b[0], b[1]), b[2])

    return model, loss, [(ids, mask, y)]


@pytest.mark.parametrize("symmetry", ["full", "paper"])
def test_given_symmetries_are_used_without_discovery(monkeypatch, symmetry):
    model, loss, data = _two_input_setup()
    geo = qm.Geometry(symmetry=symmetry)
    discovered = qm.geodesic_sharpness(model, loss, data, rho=0.1, n_iter=3, geometry=geo)
    sym = qm.symmetries_of(model, loss, data, geometry=geo)
    assert sym.symmetry == symmetry and sym.blocks
    assert (symmetry == "full") == bool(sym.folds)

    def no_discovery(*a, **k):
        raise AssertionError("discovered again")

    monkeypatch.setattr(qm.models.discovery, "discover", no_discovery)  # the cache's too
    given = qm.geodesic_sharpness(model, loss, data, rho=0.1, n_iter=3,
                                  geometry=geo.replace(symmetries=sym))
    assert given.value == discovered.value and given.blocks == discovered.blocks
    assert given.settings["symmetries"] == {"given": True, "symmetry": symmetry,
                                            "blocks": len(sym.blocks),
                                            "folds": len(sym.folds)}
    assert "symmetries" not in discovered.settings  # and not in the measures' specs:
    assert all("symmetries" not in m.spec()["geometry"] for m in qm.MEASURES.values())


def test_given_symmetries_must_match_the_geometry():
    model, loss, data = _two_input_setup()
    sym = qm.symmetries_of(model, loss, data, geometry=qm.Geometry(symmetry="paper"))
    with pytest.raises(ValueError, match="symmetry='paper'"):
        qm.Geometry(symmetry="full", symmetries=sym)
    with pytest.raises(TypeError, match="Symmetries"):
        qm.Geometry(symmetries=list(sym.blocks))
    assert qm.Geometry(metric=None, symmetries=sym).metric is None  # no GL block: unused


def test_a_sweep_discovers_once_per_symmetry(monkeypatch):
    from quotient_manifolds.experiments import rho_sweep
    from quotient_manifolds.experiments import sharpness_suite as suite

    model, loss, data = _two_input_setup()
    calls = []
    real = suite.symmetries_of

    def counted(m, fn, d, *, geometry):
        calls.append(geometry.symmetry)
        return real(m, fn, d, geometry=geometry)

    monkeypatch.setattr(suite, "symmetries_of", counted)
    radii = {"adaptive": [0.1, 0.2], "inv": [0.05, 0.1], "mix": [0.05, 0.1],
             "inv_average": [0.01]}
    names = ("adaptive", "geodesic_inv", "geodesic_mix", "geodesic_inv_full",
             "geodesic_mix_full", "geodesic_inv_full_average")
    values = rho_sweep.measure_sweep(
        model, loss, data, settings=rho_sweep.SweepSettings(radii=radii, n_iter=2, seed=0,
                                                            names=names),
        cached={}, save=lambda d: None)
    assert sorted(calls) == ["full", "paper"]
    ref = qm.MEASURES["geodesic-inv-full"].run(model, loss, data, rho=0.1, n_iter=2, seed=0)
    assert values["geodesic_inv_full"]["0.1"] == pytest.approx(ref.value, rel=1e-12)
