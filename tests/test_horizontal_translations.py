"""The complete measure's perturbations are horizontal to the translation orbits.

Tiny redrawn BERT / GPT-2 / Llama of `audit_zoo` in float64. The orbit tangents are built here
independently of the library's projection: the Jacobian of each fold's `act_at` at 0, gathered
into the adaptive vector by `ModelGeometry.gather`; the translations of the invariance test are
written out by hand on the named parameters.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from audit_zoo import hf

import quotient_manifolds as qm
import quotient_manifolds.models.model_geometry as mg
import quotient_manifolds.sharpness.engine as engine
from quotient_manifolds.errors import InfeasibleSolutionError
from quotient_manifolds.manifolds.constrained import ConstrainedAdaptiveTangentSpace
from quotient_manifolds.models.model_geometry import ModelGeometry
from quotient_manifolds.models.precision import float64_internals
from quotient_manifolds.models.translations import TranslationConstraint, translation_folds

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _ids(seed=0):
    return torch.randint(3, 16, (4, 8), generator=torch.Generator().manual_seed(seed))


def _lm_loss(model, ids):
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _cls_loss(model, ids):
    return torch.nn.functional.cross_entropy(model(input_ids=ids).logits, ids[:, 0] % 3)


LOSS = {"bert": _cls_loss, "gpt2": _lm_loss, "llama": _lm_loss}


@pytest.fixture(scope="module", params=["bert", "gpt2"])
def tiny(request):
    """`(name, model, symmetries)`: discovered once per model, on the loss and first batch."""
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hf(request.param)
        sym = qm.discover(model, symmetry="complete", loss_fn=LOSS[request.param],
                          batch=_ids(), warn=False)
    return request.param, model, sym


def _g(sym, eps):
    return qm.Geometry(metric="inv", symmetry="complete", adaptive_eps=eps, symmetries=sym)


def _geometry(model, sym, eps):
    return ModelGeometry(model, _g(sym, eps), warn=False)


def _orbit_tangents(geo):
    """`[(fold, V)]`: each translation fold's orbit tangent on the adaptive vector, `(Da, k)`,
    from `act_at` and `gather` (not from the library's projection)."""
    out = []
    for f in translation_folds(geo.symmetries.folds):
        k = f.lie_dim(geo.base)
        J = torch.func.jacfwd(lambda th, f=f: geo.gather(f.act_at(geo.base, th))[-1])(
            torch.zeros(k, dtype=torch.float64))
        if bool(J.ne(0).any()):
            out.append((f, J))
    return out


def _finite_columns(V, live):
    """The directions of finite length: `V N` with `N` a basis of `{t : (V t)_F = 0}`, `F` the
    entries of infinite weight (`c² = 0`)."""
    VF = V[~live]
    if VF.numel() == 0 or not bool(VF.ne(0).any()):
        return V
    _, S, Wh = torch.linalg.svd(VF, full_matrices=True)
    rank = int((S > S.max() * 1e-12).sum())
    return V @ Wh[rank:].T


def _capture_maximiser(monkeypatch):
    seen = []
    real = engine.check_feasible

    def spy(feasible, xi, batch):
        seen.append((feasible, xi.clone()))
        return real(feasible, xi, batch)

    monkeypatch.setattr(engine, "check_feasible", spy)
    return seen


@pytest.mark.parametrize("eps", [0.0, 1e-2])
def test_maximiser_has_no_component_along_any_translation_orbit(tiny, eps, monkeypatch):
    name, model, sym = tiny
    seen = _capture_maximiser(monkeypatch)
    qm.geodesic_sharpness(model, LOSS[name], [_ids()], rho=0.1, geometry=_g(sym, eps),
                          solver=qm.APGD(n_iter=4, restarts=1, seed=0))
    feasible, xi = seen[0]
    space = feasible.space.spaces[-1]
    assert isinstance(space, ConstrainedAdaptiveTangentSpace)
    xa = feasible.space.split(xi)[-1]
    geo = _geometry(model, sym, eps)
    assert torch.equal(geo.w0, space.w)
    m = space.inv_c2
    tangents = _orbit_tangents(geo)
    kinds = {type(f).__name__ for f, _ in tangents}
    assert {"CentringFold", "ReaderCentringFold"} <= kinds
    if name == "bert":
        assert {"NormShiftFold", "EmbeddingShiftFold"} <= kinds
    n_xi = float((m * xa * xa).sum().sqrt())
    checked = 0
    for _, V in tangents:
        W = _finite_columns(V, space.live)
        if W.shape[1] == 0:
            continue  # every direction moves an entry of infinite weight: nothing to remove
        cols = (W * W * m[:, None]).sum(0).sqrt()
        cos = (W.T @ (m * xa)).abs() / (cols.clamp_min(1e-300) * n_xi)
        assert float(cos.max()) <= 1e-10
        checked += 1
    assert checked >= 5
    if eps > 0:  # every orbit has finite length: the post-norm shifts are removed too
        assert checked == len(tangents)


def test_projection_idempotent_and_self_adjoint_in_the_metric(tiny):
    name, model, sym = tiny
    geo = _geometry(model, sym, 1e-2)
    space = geo.adaptive_space
    gen = torch.Generator().manual_seed(1)
    u, v = (torch.randn(geo.w0.shape, generator=gen, dtype=torch.float64) for _ in range(2))
    pu, pv = space.proju(u), space.proju(v)
    scale = float(space.inner(u).sqrt() * space.inner(v).sqrt())
    assert float(space.norm(space.proju(pu) - pu)) <= 1e-12 * float(space.norm(pu))
    assert abs(float(space.inner(pu, v) - space.inner(u, pv))) <= 1e-12 * scale
    assert float(space.norm(pu)) < 0.999 * float(space.norm(u))  # it removes something
    # the adaptive-norm ball's projection: self-adjoint in Σ u v / w2
    w2 = 0.5 + torch.rand(geo.w0.shape, generator=gen, dtype=torch.float64)
    qu, qv = space.proju_weighted(u, w2), space.proju_weighted(v, w2)
    assert float(((space.proju_weighted(qu, w2) - qu) ** 2 / w2).sum().sqrt()) <= 1e-12 * float(
        (qu**2 / w2).sum().sqrt())
    assert abs(float((qu * v / w2).sum() - (u * qv / w2).sum())) <= 1e-12 * float(
        (u * u / w2).sum().sqrt() * (v * v / w2).sum().sqrt())
    # a batch of problems is projected row by row
    both = space.proju(torch.stack([u, v]))
    assert torch.allclose(both, torch.stack([pu, pv]), rtol=0, atol=1e-14 * float(u.abs().max()))
    # the distance from the horizontal space, factor by factor, is that of the whole vector
    x = torch.randn(geo.space.D, generator=gen, dtype=torch.float64)
    x0 = x.clone()
    whole = float(geo.space.norm(geo.space.proju(x) - x))
    assert whole > 0.01 * float(geo.space.norm(x))
    assert float(geo.space.vertical_norm2(x).sqrt()) == pytest.approx(whole, rel=1e-12)
    assert torch.equal(x, x0)  # not written into


def test_conjugate_gradients_agree_with_the_explicit_gram_matrices(tiny):
    """The path for large coupled folds (conjugate gradients) on the same problem as the
    explicit Gram matrices of the small ones."""
    name, model, sym = tiny
    geo = _geometry(model, sym, 1e-2)
    dense = geo.translations
    cg = TranslationConstraint(dense.folds, geo.base, geo.entries, geo.w0.numel(), geo.dtype,
                               dense_limit=0)
    assert {c.kind for c in cg.components} <= {"diag", "cg"}
    assert "cg" in {c.kind for c in cg.components} or name == "gpt2"
    # the reader centrings take the gathered form v ⊙ θ[c] (no autodiff per product)
    readers = [t for t in cg.tangents if type(t.fold).__name__ == "ReaderCentringFold"]
    assert readers and all(t._columns_of is not None for t in readers)
    m = geo.adaptive_space.inv_c2
    u = torch.randn(geo.w0.shape, generator=torch.Generator().manual_seed(2),
                    dtype=torch.float64)
    a, b = dense.project(u, m), cg.project(u, m)
    assert float((a - b).norm()) <= 1e-10 * float(a.norm())
    assert float((cg.project(b, m) - b).norm()) <= 1e-10 * float(b.norm())


def test_weights_read_by_slices_and_in_place_projection_agree(tiny):
    """The space hands the constraint its 1/c^2 by slices (no stored vector of weights) and
    projects the gradient in place: the same values as the stored weights and a copy."""
    from quotient_manifolds.manifolds.constrained import SlicedInvC2

    name, model, sym = tiny
    geo = _geometry(model, sym, 1e-2)
    space, tc = geo.adaptive_space, geo.translations
    lazy = SlicedInvC2(space)
    assert "inv_c2" not in space.__dict__ and "c2" not in space.__dict__
    n = geo.w0.numel()
    assert torch.equal(lazy[3:n - 2], space.inv_c2[3:n - 2])
    u = torch.randn(geo.w0.shape, generator=torch.Generator().manual_seed(4),
                    dtype=torch.float64)
    a = tc.project(u, space.inv_c2)
    b = TranslationConstraint(tc.folds, geo.base, geo.entries, n, geo.dtype).project(
        u.clone(), SlicedInvC2(space), inplace=True)
    assert float((a - b).norm()) <= 1e-12 * float(a.norm())
    g = torch.randn(geo.w0.shape, generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64)
    out = torch.empty_like(g)
    r = space.egrad2rgrad(g, out=out)
    assert r.data_ptr() == out.data_ptr()  # written into the caller's buffer
    ref = tc.project(space.c2 * g, space.inv_c2, gradient=True)
    assert float((r - ref).norm()) <= 1e-12 * float(ref.norm())


class _Bound(torch.nn.Module):
    """`model` called with the parameters `params` (torch.func.functional_call)."""

    def __init__(self, model, params):
        super().__init__()
        self.model, self.params = model, params

    def forward(self, **kw):
        return torch.func.functional_call(self.model, self.params, kwargs=kw)


def test_gradients_skip_only_orbits_they_are_horizontal_to(tiny):
    """The engine's gradients skip the components whose orbit tangents are the same at every
    point: there the gradient of the invariant loss, at any point, is horizontal already."""
    name, model, sym = tiny
    geo = _geometry(model, sym, 1e-2)
    space, tc = geo.adaptive_space, geo.translations
    assert space.invariant_gradients
    assert any(c.fixed for c in tc.components)
    # a point the ascent can reach: every GL factor and adaptive entry moved, frozen ones not
    gen = torch.Generator().manual_seed(3)
    points = [p + 0.1 * p.abs().mean() * torch.randn(p.shape, generator=gen, dtype=p.dtype)
              for p in geo.gather(geo.base)]
    at = geo.to_params(points)
    with float64_internals():
        named = {n: t.detach().requires_grad_() for n, t in at.items()}
        loss = LOSS[name](_Bound(model, named), _ids())
    grads = dict(zip(named, torch.autograd.grad(loss, list(named.values()), allow_unused=True),
                     strict=True))
    u = space.c2 * geo.gather({n: g if g is not None else torch.zeros_like(named[n])
                               for n, g in grads.items()})[-1]
    m = space.inv_c2
    full, skipped = tc.project(u, m), tc.project(u, m, gradient=True)
    assert float((full - skipped).norm()) <= 1e-10 * float(u.norm())
    # a vector that is no gradient is not horizontal there: skipping would be wrong for it
    r = torch.randn(u.shape, generator=gen, dtype=torch.float64)
    assert float((tc.project(r, m) - tc.project(r, m, gradient=True)).norm()) > 1e-3 * float(
        r.norm())


def test_feasibility_check_rejects_a_vertical_component(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hf("gpt2")
    seen = _capture_maximiser(monkeypatch)
    sym = qm.discover(model, symmetry="complete", warn=False)
    qm.geodesic_sharpness(model, _lm_loss, [_ids()], rho=0.1, n_iter=2, geometry=_g(sym, 0.0))
    feasible, xi = seen[0]
    engine.check_feasible(feasible, xi, 0)
    geo = _geometry(model, sym, 0.0)
    _, V = next((f, V) for f, V in _orbit_tangents(geo) if type(f).__name__ == "CentringFold")
    bad = xi.clone()
    vert = V @ torch.ones(V.shape[1], dtype=torch.float64)
    part = feasible.space.split(bad)[-1]
    part += 1e-3 * 0.1 * vert / float(geo.adaptive_space.norm(vert))
    with pytest.raises(InfeasibleSolutionError, match="horizontal"):
        engine.check_feasible(feasible, bad, 0)


def test_llama_has_no_translation_orbit():
    """RMSNorm: no centring, one embedding table: the adaptive space is the plain one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hf("llama")
        geo = _geometry(model, qm.discover(model, symmetry="complete", warn=False), 0.0)
    assert geo.translations is None
    assert not isinstance(geo.adaptive_space, ConstrainedAdaptiveTangentSpace)


# -- invariance under translations written out by hand ---------------------------------------
def _translate_bert(model, gen):
    """Writer centring of the word, position and type tables and of the first FFN output,
    the word/position shift, the post-norm shift of the embedding LayerNorm, the reader
    centring of the first intermediate layer."""
    p = dict(model.named_parameters())
    e, L0 = "bert.embeddings.", "bert.encoder.layer.0."
    with torch.no_grad():
        for t in ("word", "position", "token_type"):
            E = p[e + f"{t}_embeddings.weight"]
            E += torch.randn(E.shape[0], 1, generator=gen, dtype=E.dtype)  # E + c 1ᵀ
        s = torch.randn(E.shape[1], generator=gen, dtype=E.dtype)
        p[e + "word_embeddings.weight"] += s  # (E_w + 1 sᵀ, E_p - 1 sᵀ)
        p[e + "position_embeddings.weight"] -= s
        t = torch.randn(E.shape[1], generator=gen, dtype=E.dtype)  # (β + t, b_j - W_j t, b_o - t)
        p[e + "LayerNorm.bias"] += t
        for j in ("query", "key", "value"):
            p[L0 + f"attention.self.{j}.bias"] -= p[L0 + f"attention.self.{j}.weight"] @ t
        p[L0 + "attention.output.dense.bias"] -= t
        W = p[L0 + "output.dense.weight"]  # writes into a LayerNorm: W + 1 uᵀ, b + c 1
        W += torch.randn(1, W.shape[1], generator=gen, dtype=W.dtype)
        p[L0 + "output.dense.bias"] += float(torch.randn(1, generator=gen, dtype=W.dtype))
        gam = p[L0 + "attention.output.LayerNorm.weight"]  # reads γ ⊙ x̂ + β
        beta = p[L0 + "attention.output.LayerNorm.bias"]
        u = torch.randn(p[L0 + "intermediate.dense.weight"].shape[0], generator=gen,
                        dtype=W.dtype)
        p[L0 + "intermediate.dense.weight"] += u[:, None] / gam[None, :]
        p[L0 + "intermediate.dense.bias"] -= u * float((beta / gam).sum())


def _translate_gpt2(model, gen):
    """Writer centring of `wpe` and of the first MLP's `c_proj` (a transposed Conv1D), reader
    centring of the first `c_fc` (it reads `ln_2`)."""
    p = dict(model.named_parameters())
    h = "transformer.h.0."
    with torch.no_grad():
        E = p["transformer.wpe.weight"]
        E += torch.randn(E.shape[0], 1, generator=gen, dtype=E.dtype)
        W = p[h + "mlp.c_proj.weight"]  # (in, out): every output moves by u·x + c
        W += torch.randn(W.shape[0], 1, generator=gen, dtype=W.dtype)
        p[h + "mlp.c_proj.bias"] += float(torch.randn(1, generator=gen, dtype=W.dtype))
        gam, beta = p[h + "ln_2.weight"], p[h + "ln_2.bias"]
        W = p[h + "mlp.c_fc.weight"]  # (d, 4d), z = y W + b
        u = torch.randn(W.shape[1], generator=gen, dtype=W.dtype)
        W += (1 / gam)[:, None] * u[None, :]
        p[h + "mlp.c_fc.bias"] -= u * float((beta / gam).sum())


@pytest.mark.parametrize("eps", [0.0, 1e-2])
def test_value_invariant_under_hand_written_translations(tiny, eps):
    import copy

    name, model, sym = tiny
    moved = copy.deepcopy(model)
    (_translate_bert if name == "bert" else _translate_gpt2)(moved, torch.Generator()
                                                            .manual_seed(3))
    ids = _ids()
    with torch.no_grad():
        y0, y1 = model(input_ids=ids).logits, moved(input_ids=ids).logits
    assert float((y1 - y0).abs().max() / y0.abs().max()) <= 1e-10
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), moved.parameters(),
                                                       strict=True))
    g = _g(sym, eps)  # the structure is the moved model's too: its canonical point is its own
    solver = qm.APGD(n_iter=4, restarts=1, seed=0)
    s0 = qm.geodesic_sharpness(model, LOSS[name], [ids], rho=0.1, geometry=g, solver=solver)
    s1 = qm.geodesic_sharpness(moved, LOSS[name], [ids], rho=0.1, geometry=g, solver=solver)
    print(f"\n{name} ε={eps}: S = {s0.value:.10g}, S(translated)/S - 1 = "
          f"{s1.value / s0.value - 1:.1e}")
    assert abs(s1.value / s0.value - 1) <= 1e-6


def _sliced_only(folds, base, frozen):
    return [], dict(frozen)


@pytest.mark.parametrize("solver", ["average", "restarts"])
def test_value_changes_where_the_radius_went_along_the_orbits(tiny, solver, monkeypatch):
    """Random perturbations (the average case's samples, Auto-PGD's random starts) spent part
    of their radius along the orbits before; now all of it goes elsewhere."""
    name, model, sym = tiny
    g = _g(sym, 1e-2)

    def run():
        sv = qm.Average(n=8, seed=0) if solver == "average" else qm.APGD(
            n_iter=4, restarts=2, seed=0)
        return qm.geodesic_sharpness(model, LOSS[name], [_ids()], rho=0.3, geometry=g,
                                     solver=sv).value

    new = run()
    monkeypatch.setattr(mg, "horizontal_translations", _sliced_only)
    old = run()
    print(f"\n{name} {solver}: horizontal {new:.6g}, before {old:.6g}, "
          f"ratio {new / old:.4f}")
    assert abs(new / old - 1) > 1e-3
