"""The complete group (symmetry="complete"): every new family's symmetry applied by an
independent construction written here (not the folds' `act`), on very small float64 models with
redrawn weights. The outputs stay equal to 1e-12; the complete measure does not move (1e-6);
the full measure, blind to these symmetries, does. And the audit finds no flat direction left
unexplained on the models where the complete group is the whole story."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from audit_zoo import ZOO, torch_encoder, torch_inputs
from torch import nn

import quotient_manifolds as qm
from quotient_manifolds.models.audit import audit
from quotient_manifolds.models.precision import float64_internals

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore")


def _lm_data(seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 16, (4, 6), generator=g)
    return [{"input_ids": ids, "labels": ids}]


def _cls_data(seed=5):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 16, (4, 6), generator=g),
             "labels": torch.randint(0, 3, (4,), generator=g)}]


def _hf_loss(m, b):
    return m(**b).loss


def _value(model, data, loss, symmetry, metric="inv"):
    with float64_internals():
        return qm.geodesic_sharpness(model, loss, data, rho=0.05, n_iter=3,
                                     geometry=qm.Geometry(metric=metric, symmetry=symmetry)).value


def _outputs(model, data):
    with torch.no_grad(), float64_internals():
        b = {k: v for k, v in data[0].items() if k != "labels"}
        return model(**b).logits


def _check(model, moved, data, loss=_hf_loss, full_moves=True):
    """Outputs equal; complete measure (both metrics) unchanged; full measure moved."""
    assert (_outputs(model, data) - _outputs(moved, data)).abs().max() < 1e-12
    for metric in ("inv", "mix"):
        a, b = _value(model, data, loss, "complete", metric), _value(moved, data, loss,
                                                                      "complete", metric)
        assert abs(b / a - 1) < 1e-6, (metric, a, b)
    if full_moves:
        a, b = _value(model, data, loss, "full"), _value(moved, data, loss, "full")
        assert abs(b / a - 1) > 1e-4, (a, b)


def _edit(model):
    new = copy.deepcopy(model)
    return new, dict(new.named_parameters())


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64) * scale


# -- LayerNorm translations, post-norm (BERT) ------------------------------------------------------
def test_bert_writer_centring_by_hand():
    """Every sublayer output and embedding row written into a post-norm LayerNorm moved along 1,
    entries 10/sqrt(fan_in)."""
    model = ZOO["bert"]()
    moved, P = _edit(model)
    with torch.no_grad():
        for n, p in P.items():
            if n.endswith(("attention.output.dense.weight", "output.dense.weight")) and (
                    "intermediate" not in n):
                p.add_(torch.ones(p.shape[0], 1, dtype=p.dtype)
                       @ _randn(1, p.shape[1], seed=1, scale=10 / math.sqrt(p.shape[1])))
            elif n.endswith(("attention.output.dense.bias", "output.dense.bias")):
                p.add_(_randn(1, seed=2, scale=10.0))
            elif "embeddings" in n and n.endswith("embeddings.weight"):
                p.add_(_randn(p.shape[0], 1, seed=3, scale=10.0))  # one constant per row
    _check(model, moved, _cls_data())


def test_bert_norm_shift_and_embedding_shift_by_hand():
    """(beta + t, readers' biases - W t, residual bias - t) on the embedding LayerNorm, and
    (word + s, position - s)."""
    model = ZOO["bert"]()
    moved, P = _edit(model)
    t, s = _randn(8, seed=4, scale=3.0), _randn(8, seed=5, scale=3.0)
    e, a = "bert.embeddings.", "bert.encoder.layer.0.attention."
    with torch.no_grad():
        P[e + "LayerNorm.bias"].add_(t)
        for r in ("self.query", "self.key", "self.value"):
            P[a + r + ".bias"].sub_(P[a + r + ".weight"] @ t)
        P[a + "output.dense.bias"].sub_(t)
        P[e + "word_embeddings.weight"].add_(s)
        P[e + "position_embeddings.weight"].sub_(s)
    _check(model, moved, _cls_data())


def test_classifier_softmax_shift_by_hand():
    model = ZOO["bert"]()
    moved, P = _edit(model)
    with torch.no_grad():
        P["classifier.weight"].add_(torch.ones(3, 1, dtype=torch.float64)
                                    @ _randn(1, 8, seed=6, scale=5.0))
        P["classifier.bias"].add_(2.0)
    data = _cls_data()
    with torch.no_grad():  # the logits move, the log-probabilities do not
        assert (_outputs(model, data) - _outputs(moved, data)).abs().max() > 1e-3
    for metric in ("inv", "mix"):
        a, b = (_value(x, data, _hf_loss, "complete", metric) for x in (model, moved))
        assert abs(b / a - 1) < 1e-6, (metric, a, b)


# -- LayerNorm readers, pre-norm (GPT-2, tied head) ----------------------------------------------
def test_gpt2_reader_and_writer_centring_by_hand():
    """c_attn/c_fc read ln_1/ln_2: W + (1/gamma) u^T with the bias compensated; c_proj and wpe
    write into the stream: + 1 u^T (Conv1D weights are (in, out))."""
    model = ZOO["gpt2"]()
    moved, P = _edit(model)
    with torch.no_grad():
        for i in range(2):
            h = f"transformer.h.{i}."
            for norm, lin in (("ln_1", "attn.c_attn"), ("ln_2", "mlp.c_fc")):
                g, beta = P[h + norm + ".weight"], P[h + norm + ".bias"]
                W, b = P[h + lin + ".weight"], P[h + lin + ".bias"]  # (in, out)
                u = _randn(W.shape[1], seed=10 + i, scale=10 / math.sqrt(W.shape[0]))
                W.add_(torch.outer(1 / g, u))
                b.sub_(u * (beta / g).sum())
            for lin in ("attn.c_proj", "mlp.c_proj"):
                W = P[h + lin + ".weight"]
                W.add_(_randn(W.shape[0], 1, seed=20 + i, scale=10 / math.sqrt(W.shape[0])))
                P[h + lin + ".bias"].add_(3.0)
        P["transformer.wpe.weight"].add_(_randn(8, 1, seed=30, scale=5.0))
    _check(model, moved, _lm_data())


# -- MLP neurons ---------------------------------------------------------------------------------
def test_relu_neuron_scaling_by_hand():
    model = torch_encoder(False)
    moved, P = _edit(model)
    lam = torch.exp(_randn(16, seed=40))  # positive
    with torch.no_grad():
        for i in range(2):
            p = f"encoder.layers.{i}."
            P[p + "linear1.weight"].mul_(lam[:, None])
            P[p + "linear1.bias"].mul_(lam)
            P[p + "linear2.weight"].div_(lam[None, :])
    g = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, 16, (4, 6), generator=g), torch.randint(0, 3, (4,), generator=g))]

    def loss(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])

    def out(m):
        with torch.no_grad():
            return m(data[0][0])

    assert (out(model) - out(moved)).abs().max() < 1e-12
    for metric in ("inv", "mix"):
        a, b = (_value(x, data, loss, "complete", metric) for x in (model, moved))
        assert abs(b / a - 1) < 1e-6, (metric, a, b)


def test_swiglu_linear_branch_scaling_by_hand():
    """The linear branch of a gated MLP scales with any non-zero factor, negative included."""
    model = ZOO["llama"]()
    moved, P = _edit(model)
    lam = _randn(16, seed=41) * 3
    with torch.no_grad():
        for i in range(2):
            p = f"model.layers.{i}.mlp."
            P[p + "up_proj.weight"].mul_(lam[:, None])
            P[p + "down_proj.weight"].div_(lam[None, :])
    _check(model, moved, _lm_data(), full_moves=False)  # the full measure's metric is
    # elementwise, hence blind to unit scalings already (it spends radius on them)


# -- residual rotations ---------------------------------------------------------------------------
def test_llama_residual_rotation_by_hand():
    """Fold every RMSNorm gain into its readers by hand, then rotate the stream by a Haar Q:
    E Q^T, Q W_out, W_in Q^T."""
    model = ZOO["llama"]()
    moved, P = _edit(model)
    Q, R = torch.linalg.qr(_randn(8, 8, seed=50))
    Q = Q * torch.sign(torch.diagonal(R))
    readers = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}
    with torch.no_grad():
        for i in range(2):
            p = f"model.layers.{i}."
            for norm, lins in readers.items():
                g = P[p + norm + ".weight"]
                for lin in lins:
                    P[p + lin + ".weight"].mul_(g[None, :])
                g.fill_(1.0)
                for lin in lins:
                    P[p + lin + ".weight"].copy_(P[p + lin + ".weight"] @ Q.T)
            for lin in ("self_attn.o_proj", "mlp.down_proj"):
                P[p + lin + ".weight"].copy_(Q @ P[p + lin + ".weight"])
        g = P["model.norm.weight"]
        P["lm_head.weight"].mul_(g[None, :])
        g.fill_(1.0)
        P["lm_head.weight"].copy_(P["lm_head.weight"] @ Q.T)
        P["model.embed_tokens.weight"].copy_(P["model.embed_tokens.weight"] @ Q.T)
    _check(model, moved, _lm_data())


# -- the audit -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_audit_explains_every_flat_direction(name):
    r = audit(ZOO[name]())
    assert r.method == "exact" and r.violation < 1e-12
    assert r.gap[0] > 1e4 * r.gap[1], r.gap  # a clear spectral gap: the count is exact
    assert r.unexplained == 0 and r.flat == r.claimed + r.unused, r.to_dict()
    assert r.flat > 100


def test_audit_finds_what_the_full_group_leaves():
    """Under the full group the MLP neurons (2 x 16), the residual rotations (28) and the
    softmax shift (8) of the Llama are flat and unexplained, and attributed to their weights."""
    r = audit(ZOO["llama"](), symmetry="full")
    assert r.unexplained == 2 * 16 + 28 + 8, r.to_dict()
    assert {"model.layers.0.mlp.up_proj.weight", "lm_head.weight"} <= set(r.by_parameter)
    assert abs(sum(r.by_parameter.values()) - r.unexplained) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_audit_zoo(name):
    """The audit on every very small architecture: the claimed orbit directions are flat; the
    count is exact (a spectral gap)."""
    kw = {"inputs": torch_inputs()} if name.startswith("torch") else {}
    if name == "bloom":  # its fused attention is an autograd.Function torch.func cannot take
        with pytest.raises(qm.errors.UnsupportedModelError, match="setup_context"):
            audit(ZOO[name](), **kw)
        return
    r = audit(ZOO[name](), **kw)
    assert r.violation < 1e-10 and r.gap[0] > 1e4 * r.gap[1], r.to_dict()


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "qwen3", "vit", "opt"])
def test_reparametrize_draws_the_complete_group(name):
    """reparametrize(symmetry="complete") moves the parameters of every family (not only the
    blocks), keeps the function, and the complete measure does not move."""
    model = ZOO[name]()
    data = _lm_data() if name not in ("bert", "vit") else None
    if name == "bert":
        data = _cls_data()
    if name == "vit":
        g = torch.Generator().manual_seed(5)
        data = [{"pixel_values": torch.randn(4, 1, 4, 4, generator=g, dtype=torch.float64),
                 "labels": torch.randint(0, 3, (4,), generator=g)}]
    moved = qm.reparametrize(model, a=1.0, symmetry="complete",
                             generator=torch.Generator().manual_seed(3))
    sym = qm.discover(model, symmetry="complete", warn=False)
    new_kinds = {f.kind for f in sym.folds} - {"norm_gain", "key_bias", "value_bias", "qk_norm"}
    assert new_kinds, "no fold of the complete group claimed"
    moved_params = dict(moved.named_parameters())
    for f in sym.folds:
        if f.kind in new_kinds:
            assert any(not torch.equal(moved_params[n], dict(model.named_parameters())[n])
                       for n in f.params), f.kind
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for metric in ("inv", "mix"):
            a, b = (_value(x, data, _hf_loss, "complete", metric) for x in (model, moved))
            assert abs(b / a - 1) < 1e-6, (metric, a, b)
