"""APGD on the adaptive rows whose gradient has ever been non-zero gives the iterates of the full
packing: the same sharpness value and the same maximiser (expanded to the full packing), for
every feasible set, metric and retraction; rows that come alive later are added."""

from __future__ import annotations

import warnings

import pytest
import torch
from model_zoo import hf_loss, redraw_
from torch import nn

import quotient_manifolds as qm
from quotient_manifolds.models import ModelGeometry
from quotient_manifolds.models.row_layout import RowLayout
from quotient_manifolds.sharpness.apgd import apgd
from quotient_manifolds.sharpness.engine import _BatchProblem, _Evaluator
from quotient_manifolds.sharpness.feasible import make_feasible
from quotient_manifolds.sharpness.solvers import APGD

torch.set_num_threads(1)

RHO = 0.1
N_ITER = 10
VOCAB, READ = 600, 40  # the batches read token ids < READ only


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=64,
                     num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     attn_implementation="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = BertForSequenceClassification(cfg)
    return redraw_(model.double().eval())


def _bert_data(n_batches: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, READ, (3, 6), generator=g),
             "attention_mask": torch.ones(3, 6, dtype=torch.long),
             "labels": torch.randint(0, 3, (3,), generator=g)} for _ in range(n_batches)]


@pytest.fixture(scope="module")
def bert() -> nn.Module:
    return _bert()


def _problem(model: nn.Module, loss_fn, batch, geometry: qm.Geometry, rho: float = RHO):
    geo = ModelGeometry(model, geometry, warn=False)
    feasible = make_feasible(geometry.ball, geo.space, rho,
                             w2=None if geometry.ball == "metric" else geo.w2(),
                             horizontal=bool(geo.groups))
    ev = _Evaluator(model, loss_fn)
    with torch.no_grad():
        base = float(ev(geo.base, batch))
    return geo, feasible, _BatchProblem(geo, ev, batch, 0), base


def _both(model: nn.Module, loss_fn, batch, geometry: qm.Geometry, momentum_form="reference",
          rho: float = RHO):
    """(full-packing result, active-row result, its maximiser in the full packing, the
    active-row objective, its geometry)."""
    geo, feasible, prob, base = _problem(model, loss_fn, batch, geometry, rho)
    full = apgd(prob.loss_and_grad, feasible, base, n_iter=N_ITER, momentum_form=momentum_form)
    geo2, feasible2, prob2, _ = _problem(model, loss_fn, batch, geometry, rho)
    act = prob2.active(feasible2)
    assert act is not None
    res = apgd(act, feasible2, base, n_iter=N_ITER, momentum_form=momentum_form, layout=act)
    return full, res, act.expand(res.best_xi), act, geo2


MEASURES = ["adaptive", "adaptive-linf", "adaptive-metric", "geodesic-inv", "geodesic-mix",
            "geodesic-inv-first-order", "geodesic-mix-first-order", "geodesic-inv-adaptive-norm",
            "geodesic-mix-adaptive-norm", "geodesic-inv-full", "geodesic-mix-full",
            "geodesic-inv-complete", "geodesic-mix-complete"]


@pytest.mark.parametrize("name", MEASURES)
def test_same_iterates_as_full_packing(bert: nn.Module, name: str) -> None:
    batch = _bert_data(1)[0]
    full, res, xi, act, geo = _both(bert, hf_loss, batch, qm.MEASURES[name].geometry)
    # the restriction ran: the word embedding kept only the rows of the tokens read
    assert act.layout is not None and act.layout.D < 0.6 * geo.D
    kept = {geo.entries[i].name: r for i, r in act.layout.rows.items()}
    word = "bert.embeddings.word_embeddings.weight"
    assert set(kept[word].tolist()) == set(batch["input_ids"].unique().tolist())
    if name.endswith("-complete"):  # horizontal to the translation orbits on the active rows
        assert geo.translations is not None and geo.translations.active(gradient=True)
    assert len(res.losses) == len(full.losses) == N_ITER
    torch.testing.assert_close(torch.stack(res.losses), torch.stack(full.losses),
                               rtol=1e-12, atol=1e-12)
    assert abs(float(res.best_loss) - float(full.best_loss)) <= 1e-12
    assert float(full.best_loss) > float(full.losses[0])  # the ascent moved
    assert xi.shape == full.best_xi.shape
    torch.testing.assert_close(xi, full.best_xi, rtol=0, atol=1e-12)
    # the rows not kept are exactly 0 in the full run too
    drop = torch.ones(geo.D, dtype=torch.bool)
    drop[act.layout.put(torch.ones(act.layout.D, dtype=geo.dtype)) != 0] = False
    assert bool(drop.any()) and bool((full.best_xi[drop] == 0).all())


def test_apgd_momentum_form(bert: nn.Module) -> None:
    full, res, xi, _, _ = _both(bert, hf_loss, _bert_data(1)[0],
                                qm.MEASURES["geodesic-inv"].geometry, momentum_form="apgd")
    assert abs(float(res.best_loss) - float(full.best_loss)) <= 1e-12
    torch.testing.assert_close(xi, full.best_xi, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["geodesic-inv", "adaptive", "geodesic-mix-adaptive-norm"])
def test_public_api_same_value(bert: nn.Module, name: str) -> None:
    data = _bert_data(2)
    geo = qm.MEASURES[name].geometry
    on = qm.geodesic_sharpness(bert, hf_loss, data, rho=RHO, geometry=geo,
                               solver=APGD(n_iter=N_ITER))
    off = qm.geodesic_sharpness(bert, hf_loss, data, rho=RHO, geometry=geo,
                                solver=APGD(n_iter=N_ITER, active_set=False))
    assert on.value == pytest.approx(off.value, abs=1e-12)
    for a, b in zip(on.norms, off.norms, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], abs=1e-12)


def test_layout_round_trip_and_pack(bert: nn.Module) -> None:
    batch = _bert_data(1)[0]
    geo, _, prob, _ = _problem(bert, hf_loss, batch, qm.MEASURES["geodesic-inv"].geometry)
    xi0 = geo.zeros()
    params, leaves = geo.params_and_leaves(xi0)
    grads = torch.autograd.grad(prob.ev(params, batch), leaves, allow_unused=True)
    g_full = geo.pack_grads(leaves, grads).clone()
    layout = geo.row_layout(grads)
    assert isinstance(layout, RowLayout)
    # the gradient is 0 off the kept entries, so put(take(g)) == g and pack == take(g)
    torch.testing.assert_close(layout.put(layout.take(g_full)), g_full, rtol=0, atol=0)
    torch.testing.assert_close(layout.pack(grads), layout.take(g_full), rtol=0, atol=0)
    # a random vector of the layout: the perturbed parameters are those of its expansion
    v = torch.randn(layout.D, generator=torch.Generator().manual_seed(0), dtype=geo.dtype)
    v = v * 1e-2
    p_layout, _ = geo.params_and_leaves(v, layout)
    p_layout = {k: t.detach().clone() for k, t in p_layout.items()}
    p_full, _ = geo.params_and_leaves(layout.put(v))
    for k in p_full:
        torch.testing.assert_close(p_layout[k], p_full[k].detach(), rtol=0, atol=0)
    # and after the full call, the layout's point buffer is rewritten from w
    p_again, _ = geo.params_and_leaves(v, layout)
    for k in p_full:
        torch.testing.assert_close(p_again[k].detach(), p_layout[k], rtol=0, atol=0)


def test_no_restriction_where_not_proven(bert: nn.Module) -> None:
    batch = _bert_data(1)[0]
    geometry = qm.MEASURES["geodesic-inv"].geometry.replace(adaptive_retraction="second_order")
    _, feasible, prob, _ = _problem(bert, hf_loss, batch, geometry)
    assert prob.active(feasible) is None


# -- rows that come alive later -------------------------------------------------------------
class _Net(nn.Module):
    """Linear → ReLU → Linear → ReLU → Linear, most second-layer units dead on the data and a
    few just below the threshold, so that the ascent wakes some of them."""

    def __init__(self, x: torch.Tensor, dead: int = 52, edge: int = 8, margin: float = 1e-3
                 ) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.l1 = nn.Linear(4, 8).double()
        self.l2 = nn.Linear(8, 64).double()
        self.l3 = nn.Linear(64, 3).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
            h = torch.relu(self.l1(x))
            pre = h @ self.l2.weight.T  # (batch, 64)
            top = pre.amax(0)
            self.l2.bias[:dead] = -top[:dead] - 10.0  # dead for good
            self.l2.bias[dead : dead + edge] = -top[dead : dead + edge] - margin * top[
                dead : dead + edge].abs().clamp_min(1.0)  # just dead
            self.l2.bias[dead + edge :] = -pre[:, dead + edge :].amin(0) + 0.5  # alive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def _ce(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("name", ["adaptive", "adaptive-linf", "adaptive-metric"])
def test_rows_coming_alive_are_added(name: str) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (16,), generator=g)
    net = _Net(x).eval()
    full, res, xi, act, geo = _both(net, _ce, (x, y), qm.MEASURES[name].geometry, rho=0.3)
    assert act.layout is not None
    # the first layout was grown at least once: some row became live during the ascent
    assert act.version >= 2
    grown = act.layout.rows[[e.name for e in geo.entries].index("l2.weight")]
    assert 4 < grown.numel() < 64  # 4 units alive at w, a few of the 8 just dead woke up
    assert abs(float(res.best_loss) - float(full.best_loss)) <= 1e-12
    torch.testing.assert_close(xi, full.best_xi, rtol=0, atol=1e-12)


def test_full_packing_vectors_are_freed_once_the_rows_are_restricted(bert: nn.Module) -> None:
    """After the first call has chosen the rows, no vector of the full packing is kept alive
    for the rest of the ascent (a loop variable once kept the zero start: 4 B per parameter)."""
    import weakref

    geo, feasible, prob, base = _problem(bert, hf_loss, _bert_data(1)[0],
                                         qm.MEASURES["geodesic-inv-complete"].geometry)
    act = prob.active(feasible)
    assert act is not None
    starts: list[weakref.ref] = []
    zeros = feasible.zeros

    def recorded():
        z = zeros()
        starts.append(weakref.ref(z))
        return z

    feasible.zeros = recorded  # type: ignore[method-assign]
    alive_later: list[bool] = []

    def objective(xi):
        if act.layout is not None:
            alive_later.append(starts[0]() is not None)
        return act(xi)

    apgd(objective, feasible, base, n_iter=4, layout=act)
    assert act.layout is not None and len(starts) == 1
    assert alive_later == [False, False, False]
