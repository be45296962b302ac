"""The complete group on decoders and encoder-decoders: each new symmetry applied by an
independent construction written here (not the folds' `act`), on very small float64 models with
redrawn weights (tests/audit_zoo.py). The logits stay equal to 1e-12; the complete measure does
not move (1e-6); the full measure, blind to these symmetries, does. The audit then finds no
unexplained flat direction on OPT, GPT-2 with an untied head, OLMo, T5 and BART."""

from __future__ import annotations

import copy

import pytest
import torch
from audit_zoo import ZOO
from torch import nn

import quotient_manifolds as qm
from quotient_manifolds.models.audit import audit
from quotient_manifolds.models.precision import float64_internals

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore")


def _data(seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 16, (4, 6), generator=g)
    return [{"input_ids": ids, "labels": ids}]


def _loss(m, b):
    return m(**b).loss


def _value(model, data, symmetry, metric="inv"):
    with float64_internals():
        return qm.geodesic_sharpness(model, _loss, data, rho=0.05, n_iter=3,
                                     geometry=qm.Geometry(metric=metric, symmetry=symmetry)).value


def _logits(model, data):
    with torch.no_grad(), float64_internals():
        return model(**data[0]).logits


def _check(model, moved, data, logits_equal=True, metrics=("inv",)):
    """Logits equal (or, for a softmax shift, log-probabilities); complete measure unchanged
    under `metrics`; full measure moved."""
    a, b = _logits(model, data), _logits(moved, data)
    if logits_equal:
        assert (a - b).abs().max() < 1e-12 * a.abs().max()
    else:
        assert (a - b).abs().max() > 1e-3
        assert (a.log_softmax(-1) - b.log_softmax(-1)).abs().max() < 1e-12
    for metric in metrics:
        x, y = _value(model, data, "complete", metric), _value(moved, data, "complete", metric)
        assert abs(y / x - 1) < 1e-6, (metric, x, y)
    x, y = _value(model, data, "full"), _value(moved, data, "full")
    assert abs(y / x - 1) > 1e-4, (x, y)


def _edit(model):
    new = copy.deepcopy(model)
    return new, dict(new.named_parameters())


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64) * scale


def _haar_fixing_ones(d, seed):
    """A Haar rotation of 1^perp (Q 1 = 1), built from an orthonormal basis whose first vector
    is 1/sqrt(d)."""
    B, _ = torch.linalg.qr(torch.cat([torch.ones(d, 1, dtype=torch.float64),
                                      _randn(d, d - 1, seed=seed)], 1))
    Z, R = torch.linalg.qr(_randn(d - 1, d - 1, seed=seed + 1))
    R1 = torch.eye(d, dtype=torch.float64)
    R1[1:, 1:] = Z * torch.sign(torch.diagonal(R))
    return B @ R1 @ B.T


# -- a LayerNorm's shift against a head without bias (OPT, GPT-2 untied) -------------------------
def test_opt_final_shift_against_the_head_by_hand():
    """(W, beta) -> (W M, M^-1 beta), M = I + a (1/gamma)^T, on the final LayerNorm and the
    bias-free head: W M diag(gamma) x = W diag(gamma) x on centred x, and W M M^-1 beta = W beta."""
    model = ZOO["opt"]()
    moved, P = _edit(model)
    g, beta = P["model.decoder.final_layer_norm.weight"], P["model.decoder.final_layer_norm.bias"]
    v = 1 / g.detach()
    a = _randn(8, seed=1, scale=2.0 / float(v.norm()))
    M = torch.eye(8, dtype=torch.float64) + torch.outer(a, v)
    with torch.no_grad():
        P["lm_head.weight"].copy_(P["lm_head.weight"] @ M)
        beta.copy_(torch.linalg.solve(M, beta))
    _check(model, moved, _data(), metrics=("inv", "mix"))


def test_gpt2_untied_stream_rotation_by_hand():
    """Bring GPT-2 (untied head) to the gauge by hand (gains into the readers, the shifts into
    the readers' biases or, for the head, the shift to 1; writers and readers centred), then
    rotate the stream by a Haar rotation Q of 1^perp: E Q^T, W_out Q^T, Q b_out, Q W_in
    (Conv1D weights are (in, out)), W_head Q^T."""
    model = ZOO["gpt2_untied"]()
    moved, P = _edit(model)
    d = 8
    Pc = torch.eye(d, dtype=torch.float64) - torch.full((d, d), 1 / d, dtype=torch.float64)
    Q = _haar_fixing_ones(d, seed=60)
    with torch.no_grad():
        for i in range(2):
            h = f"transformer.h.{i}."
            for norm, lin in (("ln_1", "attn.c_attn"), ("ln_2", "mlp.c_fc")):
                g, beta = P[h + norm + ".weight"], P[h + norm + ".bias"]
                W, b = P[h + lin + ".weight"], P[h + lin + ".bias"]
                b.add_(beta @ W)
                W.copy_(Q @ Pc @ (g[:, None] * W))
                g.fill_(1.0)
                beta.zero_()
            for lin in ("attn.c_proj", "mlp.c_proj"):
                W, b = P[h + lin + ".weight"], P[h + lin + ".bias"]
                W.copy_(W @ Pc @ Q.T)
                b.copy_(Q @ Pc @ b)
        for e in ("transformer.wte.weight", "transformer.wpe.weight"):
            P[e].copy_(P[e] @ Pc @ Q.T)
        g, beta = P["transformer.ln_f.weight"], P["transformer.ln_f.bias"]
        W = P["lm_head.weight"] * g[None, :]
        c = W @ (beta / g)  # the head's constant: kept in the 1 column, the shift set to 1
        W = W @ Pc + torch.outer(c, torch.ones(d, dtype=torch.float64)) / d
        P["lm_head.weight"].copy_(W @ Q.T)
        g.fill_(1.0)
        beta.fill_(1.0)
    _check(model, moved, _data())


# -- OLMo: parameter-free LayerNorms ------------------------------------------------------------
def test_olmo_free_norm_translations_and_rotation_by_hand():
    """OLMo's LayerNorms have neither gain nor shift: every reader moved along 1 (W + u 1^T,
    no bias to compensate), every writer along 1 (W + 1 u^T, embedding rows + c 1^T), then the
    stream rotated by a Haar rotation Q of 1^perp (E Q^T, Q W_out, W_in Q^T)."""
    model = ZOO["olmo"]()
    moved, P = _edit(model)
    d, one = 8, torch.ones(8, dtype=torch.float64)
    Q = _haar_fixing_ones(d, seed=90)
    readers = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
               "mlp.up_proj")
    with torch.no_grad():
        k = 0
        for n, W in P.items():
            k += 1
            if n.endswith(tuple(r + ".weight" for r in readers)) or n == "lm_head.weight":
                W.add_(torch.outer(_randn(W.shape[0], seed=k, scale=3.0), one))
                W.copy_(W @ Q.T)
            elif n.endswith(("o_proj.weight", "down_proj.weight")):
                W.add_(torch.outer(one, _randn(W.shape[1], seed=k, scale=3.0)))
                W.copy_(Q @ W)
            elif n == "model.embed_tokens.weight":
                W.add_(torch.outer(_randn(W.shape[0], seed=k, scale=3.0), one))
                W.copy_(W @ Q.T)
    _check(model, moved, _data())


# -- T5: relative attention biases, the encoder's last norm -------------------------------------
def test_t5_score_bias_shift_and_encoder_norm_gain_by_hand():
    """A constant per head added to every relative-attention-bias table (a softmax shift of that
    head's scores); the encoder's final RMSNorm gain scaled by c and every cross-attention key
    and value projection's input columns by 1/c (the encoder's returned hidden state changes,
    the logits do not)."""
    model = ZOO["t5"]()
    moved, P = _edit(model)
    with torch.no_grad():
        for n, p in P.items():
            if n.endswith("relative_attention_bias.weight"):
                p.add_(_randn(1, p.shape[1], seed=len(n), scale=5.0))
        c = torch.exp(_randn(8, seed=70)) * torch.sign(_randn(8, seed=71))
        P["encoder.final_layer_norm.weight"].mul_(c)
        for n, p in P.items():
            if "EncDecAttention" in n and n.endswith((".k.weight", ".v.weight")):
                p.div_(c[None, :])
    data = _data()
    with torch.no_grad(), float64_internals():
        enc = [m(**data[0]).encoder_last_hidden_state for m in (model, moved)]
    assert (enc[0] - enc[1]).abs().max() > 1e-3  # a symmetry of the logits only
    _check(model, moved, data)


# -- BART: the encoder's last norm, the decoder's last norm against the head, the head --------
def test_bart_encoder_norm_fold_shift_reader_and_softmax_shift_by_hand():
    """The encoder's last (post-norm) LayerNorm: gain scaled by c and shift translated by t
    against every cross-attention key/value (W diag(1/c), b - W diag(1/c) t); the decoder's last
    LayerNorm against the bias-free head ((W M, M^-1 beta)); the head's columns shifted by a
    constant over the vocabulary (a softmax shift, logits added to final_logits_bias)."""
    model = ZOO["bart"]()
    moved, P = _edit(model)
    e = f"model.encoder.layers.{len(model.model.encoder.layers) - 1}.final_layer_norm."
    c = torch.exp(_randn(8, seed=80)) * torch.sign(_randn(8, seed=81))
    t = _randn(8, seed=82, scale=3.0)
    with torch.no_grad():
        P[e + "weight"].mul_(c)
        P[e + "bias"].mul_(c).add_(t)
        for n in list(P):
            if "encoder_attn." in n and n.endswith(("k_proj.weight", "v_proj.weight")):
                W = P[n]
                W.div_(c[None, :])
                P[n[:-len("weight")] + "bias"].sub_(W @ t)
        dn = f"model.decoder.layers.{len(model.model.decoder.layers) - 1}.final_layer_norm."
        v = 1 / P[dn + "weight"].detach()
        M = torch.eye(8, dtype=torch.float64) + torch.outer(
            _randn(8, seed=83, scale=2.0 / float(v.norm())), v)
        P["lm_head.weight"].copy_(P["lm_head.weight"] @ M)
        P[dn + "bias"].copy_(torch.linalg.solve(M, P[dn + "bias"]))
        P["lm_head.weight"].add_(torch.ones(16, 1, dtype=torch.float64)
                                 @ _randn(1, 8, seed=84, scale=5.0))
    _check(model, moved, _data(), logits_equal=False)


# -- the score-bias family claims score biases only ------------------------------------------
class _NarrowTable(nn.Module):
    """A narrow table projected into the stream: its columns are no softmax scores."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.narrow = nn.Embedding(16, 2)
        self.up = nn.Linear(2, 8, bias=False)
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids) + self.up(self.narrow(ids))))


def test_score_shift_not_claimed_where_it_is_no_symmetry():
    torch.manual_seed(0)
    model = _NarrowTable().double()
    ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(0))
    sym = qm.discover(model, symmetry="complete", warn=False, example_inputs=(ids,))
    assert "score_shift" not in {f.kind for f in sym.folds}
    t5 = qm.discover(ZOO["t5"](), symmetry="complete", warn=False)
    claimed = {f.module for f in t5.folds if f.kind == "score_shift"}
    assert len(claimed) == 2 and all(n.endswith("relative_attention_bias") for n in claimed)


# -- the audit -----------------------------------------------------------------------------------
def _audit_zero(name):
    r = audit(ZOO[name]())
    assert r.method == "exact" and r.violation < 1e-10, r.to_dict()
    assert r.gap[0] > 1e4 * r.gap[1], r.gap  # a clear spectral gap: the count is exact
    assert r.unexplained == 0 and r.flat == r.claimed + r.unused, r.to_dict()
    return r


def test_audit_opt_explains_every_flat_direction():
    r = _audit_zero("opt")
    assert r.by_kind.get("rotation", 0) == 21 and r.by_kind.get("shift_reader", 0) == 8


# -- parallel blocks: the attention's and the MLP's output biases are summed ---------------------
@pytest.mark.parametrize("name, attn, mlp", [
    ("gpt_neox", "gpt_neox.layers.{}.attention.dense", "gpt_neox.layers.{}.mlp.dense_4h_to_h"),
    ("phi", "model.layers.{}.self_attn.dense", "model.layers.{}.mlp.fc2")])
def test_parallel_block_summed_biases_by_hand(name, attn, mlp):
    """(b_A + t, b_M - t) in every parallel block, t of the size of the weights."""
    model = ZOO[name]()
    moved, P = _edit(model)
    with torch.no_grad():
        for i in range(2):
            t = _randn(8, seed=90 + i, scale=3.0)
            P[attn.format(i) + ".bias"].add_(t)
            P[mlp.format(i) + ".bias"].sub_(t)
    _check(model, moved, _data(), metrics=("inv", "mix"))


def test_stablelm_key_offsets_on_unrotated_coordinates_by_hand():
    """StableLM (partial rotary 0.5, head dim 4: coordinates 2 and 3 of each head unrotated,
    no key bias): W_K rows 2, 3, 6, 7 + u_r (1 / gamma)^T, gamma the input norm's gain."""
    model = ZOO["stablelm"]()
    moved, P = _edit(model)
    with torch.no_grad():
        for i in range(2):
            p = f"model.layers.{i}."
            v = 1.0 / P[p + "input_layernorm.weight"]
            W = P[p + "self_attn.k_proj.weight"]
            for j, r in enumerate((2, 3, 6, 7)):
                W[r] += float(_randn(1, seed=95 + 4 * i + j, scale=3.0)) * v
    _check(model, moved, _data(), metrics=("inv", "mix"))
    kinds = [f.kind for f in qm.discover(ZOO["llama"]()).folds]
    assert "key_offset" not in kinds  # full rotary: nothing is left unrotated


def test_sequential_blocks_claim_no_summed_biases():
    """BERT and OPT add their attention before a norm reads it: the probe rejects the pairs."""
    for name in ("bert", "opt"):
        kinds = {f.kind for f in qm.discover(ZOO[name]()).folds}
        assert "summed_bias" not in kinds, name
    assert "summed_bias" in {f.kind for f in qm.discover(ZOO["gpt_neox"]()).folds}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2_untied", "t5", "bart", "olmo", "gpt_neox"])
def test_audit_decoders_explain_every_flat_direction(name):
    _audit_zero(name)
