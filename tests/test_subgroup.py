"""Subgroup quotients (geometry/subgroup.py) in float64: subalgebras, RoPE layouts, projection.

The projection is checked against a dense reference built only from the metric
(``gl.inner`` on the coordinate basis) and an explicit basis of the subalgebra.
"""

import math

import pytest
import torch
from helpers import conditioned_factor
from hypothesis import given, settings
from hypothesis import strategies as st

from quotient_manifolds.errors import RankDeficientError, ShapeError, SubalgebraError
from quotient_manifolds.geometry import gl
from quotient_manifolds.geometry import subgroup as sg

METRICS = ["inv", "mix"]


# -- helpers ---------------------------------------------------------------------------------
def metric_matrix(G, H, gr, metric):
    """``g_ij = ⟨e_i, e_j⟩`` on the coordinate basis of one block (from ``gl.inner`` only)."""
    n, h = G.shape
    m = H.shape[0]
    N = (n + m) * h
    E = torch.eye(N).reshape(N, n + m, h)
    eG, eH = E[:, None, :n], E[:, None, n:]
    fG, fH = E[None, :, :n], E[None, :, n:]
    return gl.inner(G, H, eG, eH, fG, fH, gr, metric)


def dense_projection(G, H, uG, uH, gr, metric, sub):
    """ξ − V (Vᵀ g V)⁺ Vᵀ g ξ with V = [(G B, −H Bᵀ)] over an explicit basis B of k."""
    n = G.shape[0]
    g = metric_matrix(G, H, gr, metric)
    V = torch.stack([torch.cat([G @ B, -H @ B.T]).reshape(-1) for B in sub.basis()], 1)
    u = torch.cat([uG, uH]).reshape(-1)
    c = torch.linalg.lstsq(V.T @ g @ V, V.T @ g @ u).solution
    p = (u - V @ c).reshape(uG.shape[0] + uH.shape[0], -1)
    return p[:n], p[n:]


def inner(G, H, gr, metric, a, b):
    return gl.inner(G, H, a[0], a[1], b[0], b[1], gr, metric)


def vertical(G, H, X):
    return gl.vertical(G, H, X)


@st.composite
def subalgebras(draw, max_h=6):
    h = draw(st.integers(1, max_h))
    kind = draw(st.sampled_from(["rotary", "rotary", "blocks"]))
    perm = draw(st.permutations(list(range(h))))
    if kind == "rotary":
        p = draw(st.integers(0, h // 2))
        return sg.RotaryCommutant(h, tuple((perm[2 * i], perm[2 * i + 1]) for i in range(p)))
    cuts = sorted(draw(st.sets(st.integers(1, h - 1), max_size=h - 1))) if h > 1 else []
    bounds = [0, *cuts, h]
    return sg.BlockDiagonal(h, tuple(tuple(perm[a:b]) for a, b in zip(bounds, bounds[1:])))


@st.composite
def block_case(draw):
    sub = draw(subalgebras())
    h = sub.h
    eps = draw(st.sampled_from([0.0, 0.0, 0.3]))
    n = draw(st.integers(h, h + 3))
    m = draw(st.integers(h, h + 3))
    batch = draw(st.sampled_from([(), (2,), (2, 2)]))
    metric = draw(st.sampled_from(METRICS))
    seed = draw(st.integers(0, 2**31 - 1))
    sg_ = draw(st.sampled_from([1e-2, 1.0, 10.0]))
    gen = torch.Generator().manual_seed(seed)
    G = conditioned_factor(n, h, gen, batch, sg_)
    H = conditioned_factor(m, h, gen, batch)
    uG, uH = torch.randn(*batch, n, h, generator=gen), torch.randn(*batch, m, h, generator=gen)
    vG, vH = torch.randn(*batch, n, h, generator=gen), torch.randn(*batch, m, h, generator=gen)
    return sub, metric, eps, G, H, (uG, uH), (vG, vH), gen


def close(a, b, scale=1.0, rtol=1e-9):
    torch.testing.assert_close(a, b, atol=rtol * scale, rtol=rtol)


def norm(G, H, gr, metric, a):
    return inner(G, H, gr, metric, a, a).sqrt()


# -- subalgebras -----------------------------------------------------------------------------
def test_rotary_layouts_and_dimensions():
    assert sg.RotaryCommutant.rotate_half(6).pairs == ((0, 3), (1, 4), (2, 5))
    assert sg.RotaryCommutant.interleaved(6).pairs == ((0, 1), (2, 3), (4, 5))
    neox = sg.RotaryCommutant.rotate_half(64, 16)  # GPT-NeoX rotary_pct = 0.25
    assert neox.pairs[0] == (0, 8) and len(neox.pairs) == 8
    assert neox.free() == tuple(range(16, 64))
    assert neox.dim() == 16 + 48**2 == 2320
    assert sg.RotaryCommutant.rotate_half(64).dim() == 64
    assert sg.RotaryCommutant(5).dim() == 25
    assert sg.BlockDiagonal(5, ((0, 3), (1,), (2, 4))).dim() == 9
    assert hash(sg.RotaryCommutant.rotate_half(4)) == hash(sg.RotaryCommutant(4, ((0, 2), (1, 3))))
    assert sg.RotaryCommutant(4, ((0, 2), (1, 3))) == sg.RotaryCommutant(4, [[0, 2], [1, 3]])
    assert sg.RotaryCommutant(2) != sg.BlockDiagonal(2, ((0, 1),))


@pytest.mark.parametrize(
    "bad",
    [lambda: sg.RotaryCommutant(4, ((0, 1), (1, 2))), lambda: sg.RotaryCommutant(4, ((0, 4),)),
     lambda: sg.RotaryCommutant(4, ((2, 2),)), lambda: sg.RotaryCommutant(4, ((0, 1, 2),)),
     lambda: sg.RotaryCommutant.rotate_half(6, 3), lambda: sg.RotaryCommutant.interleaved(4, 6),
     lambda: sg.RotaryCommutant(0), lambda: sg.BlockDiagonal(3, ((0, 1),)),
     lambda: sg.BlockDiagonal(3, ((0, 1), (1, 2))), lambda: sg.RotaryCommutant(2.0)],
)
def test_invalid_subalgebras_raise_named_error(bad):
    with pytest.raises(SubalgebraError):
        bad()


def test_wrong_matrix_size_raises_shape_error():
    sub = sg.RotaryCommutant.rotate_half(4)
    with pytest.raises(ShapeError):
        sub.project(torch.zeros(3, 3))
    gen = torch.Generator().manual_seed(0)
    G, H = conditioned_factor(5, 3, gen), conditioned_factor(4, 3, gen)
    with pytest.raises(ShapeError):
        sg.subgroup_system(G, H, gl.grams(G, H), "inv", sub)


@settings(max_examples=40, deadline=None)
@given(subalgebras(), st.integers(0, 2**31 - 1))
def test_projection_onto_subalgebra(sub, seed):
    gen = torch.Generator().manual_seed(seed)
    h = sub.h
    B = sub.basis()
    assert B.shape == (sub.dim(), h, h)
    close(torch.einsum("aij,bij->ab", B, B), torch.eye(sub.dim()))  # orthonormal
    X, Y = torch.randn(2, 3, h, h, generator=gen)
    P = sub.project(X)
    close(P, torch.einsum("aij,...ij,akl->...kl", B, X, B))  # = the dense projector
    close(sub.project(P), P)
    close((sub.project(X) * Y).sum((-2, -1)), (X * sub.project(Y)).sum((-2, -1)))
    assert bool(sub.is_member(P).all())
    if sub.dim() < h * h:
        assert not bool(sub.is_member(X).any())
    sub.check_closed()
    # associative and closed under transpose: products, transposes and inverses stay inside
    Q = sub.project(Y)
    assert bool(sub.is_member(P @ Q).all()) and bool(sub.is_member(P.mT).all())
    A = sub.random_element(gen, scale=0.7, batch=(3,))
    assert bool(sub.is_member(A).all()) and bool(sub.is_member(torch.linalg.inv(A)).all())
    assert torch.linalg.cond(A).max() <= math.exp(2 * 0.7) * (1 + 1e-9)


def test_subalgebra_from_project_only_gets_a_dense_layout():
    class Diagonal(sg.Subalgebra):
        def project(self, X):
            return torch.diag_embed(torch.diagonal(X, dim1=-2, dim2=-1))

    sub = Diagonal(3)
    assert sub.dim() == 3 and sub.free() == ()
    ref = sg.BlockDiagonal(3, ((0,), (1,), (2,)))
    gen = torch.Generator().manual_seed(0)
    G, H = conditioned_factor(5, 3, gen), conditioned_factor(4, 3, gen)
    uG, uH = torch.randn(5, 3, generator=gen), torch.randn(4, 3, generator=gen)
    gr = gl.grams(G, H)
    for a, b in zip(sg.project(G, H, uG, uH, gr, "inv", sub),
                    sg.project(G, H, uG, uH, gr, "inv", ref)):
        close(a, b)
    with pytest.raises(NotImplementedError):
        sg.Subalgebra(3).dim()


def test_non_lie_subspace_is_rejected_by_check_closed():
    class Strict(sg.Subalgebra):  # strictly upper-left corner + one off-diagonal entry
        def project(self, X):
            M = torch.zeros(3, 3)
            M[0, 1] = M[1, 2] = 1.0
            return X * M

    with pytest.raises(SubalgebraError):
        Strict(3).check_closed()


# -- RoPE: the layouts are the library's rotations, and the commutant is the symmetry --------
def _hf_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _gptj_rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("r", [8, 4])
def test_rotation_matches_hf_and_gptj_rope(layout, r):
    """``rotation(θ)`` reproduces the rotate-half (HF Llama/NeoX) and interleaved (GPT-J) code."""
    h, gen = 8, torch.Generator().manual_seed(0)
    sub = getattr(sg.RotaryCommutant, layout)(h, r)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2) / r))
    pos = torch.arange(5.0)
    freqs = pos[:, None] * inv_freq[None, :]  # (seq, r/2): angle of pair i at each position
    x = torch.randn(5, h, generator=gen)
    xr, xp = x[..., :r], x[..., r:]
    if layout == "rotate_half":
        emb = torch.cat((freqs, freqs), -1)
        out = xr * emb.cos() + _hf_rotate_half(xr) * emb.sin()
    else:
        emb = freqs.repeat_interleave(2, -1)
        out = xr * emb.cos() + _gptj_rotate_every_two(xr) * emb.sin()
    ref = torch.cat([out, xp], -1)
    ours = (sub.rotation(freqs) @ x.unsqueeze(-1)).squeeze(-1)
    close(ours, ref)


def _rope_scores(G, H, sub, angles_per_pos, X):
    """``s_ij = (R_i Gᵀ x_i)ᵀ (R_j Hᵀ x_j)``: RoPE attention logits of a Q/K block."""
    R = sub.rotation(angles_per_pos)  # (T, h, h)
    q = (R @ (G.T @ X.T).T.unsqueeze(-1)).squeeze(-1)
    k = (R @ (H.T @ X.T).T.unsqueeze(-1)).squeeze(-1)
    return q @ k.T


@pytest.mark.parametrize("sub", [sg.RotaryCommutant.rotate_half(6),
                                 sg.RotaryCommutant.rotate_half(6, 2),
                                 sg.RotaryCommutant.interleaved(6, 4)], ids=str)
def test_commutant_is_exactly_the_rope_symmetry(sub):
    gen = torch.Generator().manual_seed(1)
    h, d = sub.h, 7
    p = len(sub.pairs)
    inv_freq = 1.0 / (10000 ** (torch.arange(p) / max(p, 1)))
    angles = torch.arange(5.0)[:, None] * inv_freq
    G, H, X = torch.randn(d, h, generator=gen), torch.randn(d, h, generator=gen), torch.randn(
        5, d, generator=gen)
    s = _rope_scores(G, H, sub, angles, X)
    A = sub.random_element(gen, scale=1.0)
    Gi = G @ torch.linalg.inv(A)
    close(_rope_scores(Gi, H @ A.T, sub, angles, X), s, s.abs().max().item(), 1e-12)
    B = torch.linalg.matrix_exp(0.5 * torch.randn(h, h, generator=gen))  # generic GL(h)
    moved = _rope_scores(G @ torch.linalg.inv(B), H @ B.T, sub, angles, X)
    assert (moved - s).abs().max() > 1e-2 * s.abs().max()
    # the commutant of R(θ₁) (θ₁ = position-1 angles, distinct) is exactly k:
    R1 = sub.rotation(angles[1])
    I = torch.eye(h)
    Cmap = torch.kron(I, R1) - torch.kron(R1.T.contiguous(), I)  # vec(RX − XR), column-major
    null = torch.linalg.svdvals(Cmap)
    assert int((null < 1e-10).sum()) == sub.dim()
    for Bk in sub.basis():
        close(Bk @ R1, R1 @ Bk)


# -- the projection --------------------------------------------------------------------------
def _case_scale(G, H, gr, metric, u):
    return norm(G, H, gr, metric, u).max().item()


@settings(max_examples=60, deadline=None)
@given(block_case())
def test_projection_matches_dense_reference(case):
    sub, metric, eps, G, H, u, v, gen = case
    gr = gl.grams(G, H, eps)
    p = sg.project(G, H, *u, gr, metric, sub)
    flat = lambda t: t.reshape(-1, *t.shape[-2:])  # noqa: E731
    for i in range(flat(G).shape[0]):
        ref = dense_projection(flat(G)[i], flat(H)[i], flat(u[0])[i], flat(u[1])[i],
                               gl.grams(flat(G)[i], flat(H)[i], eps), metric, sub)
        scale = (flat(u[0])[i].abs().max() + flat(u[1])[i].abs().max()).item()
        close(flat(p[0])[i], ref[0], scale, 1e-8)
        close(flat(p[1])[i], ref[1], scale, 1e-8)


@settings(max_examples=60, deadline=None)
@given(block_case())
def test_projection_horizontal_idempotent_self_adjoint(case):
    sub, metric, eps, G, H, u, v, gen = case
    gr = gl.grams(G, H, eps)
    system = sg.subgroup_system(G, H, gr, metric, sub)
    P = lambda a: sg.project(G, H, *a, gr, metric, sub, system)  # noqa: E731
    p = P(u)
    nu = _case_scale(G, H, gr, metric, u)
    # orthogonal to every vertical (G X, −H Xᵀ), X ∈ k
    X = sub.random_algebra_element(gen, batch=G.shape[:-2])
    w = vertical(G, H, X)
    scale = (norm(G, H, gr, metric, p) * norm(G, H, gr, metric, w)).max().item()
    close(inner(G, H, gr, metric, p, w), torch.zeros(G.shape[:-2]), scale)
    res = sg.horizontal_residual(G, H, *p, gr, metric, sub)
    tol = sg.horizontal_residual_scale(G, H, *p, gr, metric, sub)
    assert bool((res.abs() <= 1e-9 * (tol + tol.amax((-2, -1), keepdim=True))).all())
    # u − Π(u) is a k-vertical vector: V(X) with X ∈ k
    Xu = sg.horizontal_x(G, H, *u, gr, metric, sub, system)
    assert bool(sub.is_member(Xu, rtol=1e-9).all())
    close(p[0], u[0] + G @ Xu, nu)
    close(p[1], u[1] - H @ Xu.mT, nu)
    # idempotent, self-adjoint in the metric, kills k-vertical vectors
    pp = P(p)
    close(pp[0], p[0], nu)
    close(pp[1], p[1], nu)
    nv = _case_scale(G, H, gr, metric, v)
    close(inner(G, H, gr, metric, p, v), inner(G, H, gr, metric, u, P(v)), nu * nv)
    pw = P(w)
    nw = _case_scale(G, H, gr, metric, w)
    close(pw[0], torch.zeros_like(pw[0]), nw)
    close(pw[1], torch.zeros_like(pw[1]), nw)
    # a cached system gives the same as none
    q = sg.project(G, H, *u, gr, metric, sub)
    close(q[0], p[0], nu, 1e-12)
    close(q[1], p[1], nu, 1e-12)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_restricted_projection_is_not_the_gl_projection(metric, eps):
    """Horizontal for k, but in general not orthogonal to the full GL vertical space."""
    gen = torch.Generator().manual_seed(2)
    sub = sg.RotaryCommutant.rotate_half(4)
    G, H = conditioned_factor(6, 4, gen), conditioned_factor(5, 4, gen)
    u = torch.randn(6, 4, generator=gen), torch.randn(5, 4, generator=gen)
    gr = gl.grams(G, H, eps)
    p = sg.project(G, H, *u, gr, metric, sub)
    full = gl.horizontal_residual(G, H, *p, gr, metric)
    assert full.abs().max() > 1e-3 * gl.horizontal_residual_scale(G, H, *p, gr, metric).max()
    Y = torch.randn(4, 4, generator=gen)  # a gl(h) direction outside k
    w = vertical(G, H, Y - sub.project(Y))
    ip = inner(G, H, gr, metric, p, w)
    assert ip.abs() > 1e-3 * norm(G, H, gr, metric, p) * norm(G, H, gr, metric, w)
    # the tempting shortcut "full-GL Λ, then project Λ onto k" is not the projection either
    lam = sub.project(gl.horizontal_lambda(G, H, *u, gr, metric))
    wrong = (u[0] + G @ lam, u[1] - H @ lam.T)
    assert sg.horizontal_residual(G, H, *wrong, gr, metric, sub).abs().max() > 1e-3


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.sampled_from(METRICS), st.sampled_from([0.0, 0.3]),
       st.integers(0, 2**31 - 1))
def test_full_subalgebra_reduces_to_gl_projection(h, metric, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    G, H = conditioned_factor(h + 2, h, gen, (3,)), conditioned_factor(h + 1, h, gen, (3,))
    u = torch.randn(3, h + 2, h, generator=gen), torch.randn(3, h + 1, h, generator=gen)
    gr = gl.grams(G, H, eps)
    ref = gl.project(G, H, *u, gr, metric)
    scale = max(t.abs().max().item() for t in u)
    for sub in (sg.RotaryCommutant(h), sg.BlockDiagonal(h, (tuple(range(h)),))):
        p = sg.project(G, H, *u, gr, metric, sub)
        close(p[0], ref[0], scale)
        close(p[1], ref[1], scale)
        close(sg.horizontal_residual(G, H, *u, gr, metric, sub),
              sg.vertical_dual(G, H, *u, gr, metric))


@settings(max_examples=40, deadline=None)
@given(block_case())
def test_equivariance_under_the_subgroup(case):
    sub, metric, eps, G, H, u, v, gen = case
    if eps:  # the relaxed metric is not invariant; equivariance is a property of ε = 0
        return
    A = sub.random_element(gen, scale=1.0, batch=G.shape[:-2])
    Ai = torch.linalg.inv(A)
    act = lambda t: (t[0] @ Ai, t[1] @ A.mT)  # noqa: E731
    Ga, Ha = act((G, H))
    gr, gra = gl.grams(G, H), gl.grams(Ga, Ha)
    p = sg.project(G, H, *u, gr, metric, sub)
    pa = sg.project(Ga, Ha, *act(u), gra, metric, sub)
    nu = _case_scale(G, H, gr, metric, u)
    expect = act(p)
    close(pa[0], expect[0], nu * 10, 1e-8)
    close(pa[1], expect[1], nu * 10, 1e-8)
    close(Ga @ Ha.mT, G @ H.mT, (G @ H.mT).abs().max().item(), 1e-10)  # G Hᵀ is invariant


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_riemannian_gradient_identity(metric, eps):
    gen = torch.Generator().manual_seed(3)
    sub = sg.RotaryCommutant.rotate_half(4, 2)
    G, H = conditioned_factor(6, 4, gen, (2,)), conditioned_factor(5, 4, gen, (2,))
    gr = gl.grams(G, H, eps)
    egrad = torch.randn(2, 6, 4, generator=gen), torch.randn(2, 5, 4, generator=gen)
    r = sg.project(G, H, *gl.egrad2rgrad(*egrad, gr, metric), gr, metric, sub)
    eta = sg.project(G, H, torch.randn(2, 6, 4, generator=gen),
                     torch.randn(2, 5, 4, generator=gen), gr, metric, sub)
    dL = (egrad[0] * eta[0]).sum((-2, -1)) + (egrad[1] * eta[1]).sum((-2, -1))
    close(inner(G, H, gr, metric, r, eta), dL, dL.abs().max().item())


@pytest.mark.parametrize("metric", METRICS)
def test_gradient_of_rope_invariant_loss_is_k_horizontal_before_projection(metric):
    """A loss of the RoPE logits is K-invariant (not GL-invariant): its metric gradient is
    k-horizontal without projection, and not GL-horizontal."""
    gen = torch.Generator().manual_seed(4)
    sub = sg.RotaryCommutant.rotate_half(4)
    G = conditioned_factor(6, 4, gen).requires_grad_(True)
    H = conditioned_factor(6, 4, gen).requires_grad_(True)
    X = torch.randn(5, 6, generator=gen)
    angles = torch.arange(5.0)[:, None] * torch.tensor([1.0, 0.1])
    s = _rope_scores(G, H, sub, angles, X)
    loss = torch.log_softmax(s, -1).sum() + (s**2).sum()
    gG, gH = torch.autograd.grad(loss, (G, H))
    G, H = G.detach(), H.detach()
    gr = gl.grams(G, H)
    rG, rH = gl.egrad2rgrad(gG, gH, gr, metric)
    res = sg.horizontal_residual(G, H, rG, rH, gr, metric, sub)
    assert res.abs().max() < 1e-10 * (1 + gG.abs().max() + gH.abs().max())
    assert gl.horizontal_residual(G, H, rG, rH, gr, metric).abs().max() > 1e-3


def test_batched_equals_per_block_and_float32():
    gen = torch.Generator().manual_seed(5)
    sub = sg.RotaryCommutant.rotate_half(8, 4)
    G, H = conditioned_factor(12, 8, gen, (3, 2)), conditioned_factor(10, 8, gen, (3, 2))
    u = torch.randn(3, 2, 12, 8, generator=gen), torch.randn(3, 2, 10, 8, generator=gen)
    for metric in METRICS:
        gr = gl.grams(G, H)
        p = sg.project(G, H, *u, gr, metric, sub)
        for i in range(3):
            for j in range(2):
                q = sg.project(G[i, j], H[i, j], u[0][i, j], u[1][i, j],
                               gl.grams(G[i, j], H[i, j]), metric, sub)
                close(p[0][i, j], q[0], 1.0, 1e-12)
                close(p[1][i, j], q[1], 1.0, 1e-12)
        f = [t.float() for t in (G, H, *u)]
        pf = sg.project(*f, gl.grams(f[0], f[1]), metric, sub)
        assert pf[0].dtype == torch.float32
        close(pf[0].double(), p[0], 1.0, 1e-5)


def test_degenerate_relaxed_block_gives_finite_exact_projection():
    """ε > 0 with rank-deficient factors: degenerate directions are dropped, no NaN."""
    gen = torch.Generator().manual_seed(6)
    sub = sg.RotaryCommutant.rotate_half(6, 2)
    G = torch.randn(4, 2, generator=gen) @ torch.randn(2, 6, generator=gen)  # rank 2
    H = torch.randn(4, 2, generator=gen) @ torch.randn(2, 6, generator=gen)
    u = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
    for metric in METRICS:
        gr = gl.grams(G, H, 0.1)
        p = sg.project(G, H, *u, gr, metric, sub)
        assert all(torch.isfinite(t).all() for t in p)
        ref = dense_projection(G, H, *u, gr, metric, sub)
        close(p[0], ref[0], 10.0, 1e-8)
        close(p[1], ref[1], 10.0, 1e-8)
    with pytest.raises(RankDeficientError):
        gl.grams(G, H, 0.0)


def test_dual_operator_is_the_dual_of_vertical_vectors():
    gen = torch.Generator().manual_seed(7)
    G, H = conditioned_factor(5, 3, gen), conditioned_factor(4, 3, gen)
    X, Y = torch.randn(2, 3, 3, generator=gen)
    for metric in METRICS:
        for eps in (0.0, 0.2):
            gr = gl.grams(G, H, eps)
            LX = sg.dual_operator(X, gr, metric)
            close(LX, sg.vertical_dual(G, H, *vertical(G, H, X), gr, metric))
            # ⟨Y, L X⟩_F = ⟨V(Y), V(X)⟩: symmetric positive definite
            close((Y * LX).sum(), inner(G, H, gr, metric, vertical(G, H, Y), vertical(G, H, X)))
            assert (X * LX).sum() > 0
