"""The encoder architectures under the complete group: each new symmetry applied by an
independent construction written here (not the folds' or blocks' own action), on very small
float64 models with redrawn weights. The outputs stay equal to 1e-12; the complete measure does
not move (1e-6); the full measure does. The near-flat scalings of the post-norm LayerNorms'
inputs are checked to be exact at eps = 0 and broken by eps alone, and the audit counts them
apart from the unexplained directions."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from audit_zoo import ZOO, torch_encoder, torch_inputs
from torch import nn

import quotient_manifolds as qm
from quotient_manifolds.models.audit import audit
from quotient_manifolds.models.near_flat import StreamNearFlat, near_flat
from quotient_manifolds.models.precision import float64_internals
from quotient_manifolds.models.prober import Prober

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore")


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64) * scale


def _edit(model):
    new = copy.deepcopy(model)
    return new, dict(new.named_parameters())


def _value(model, data, loss, symmetry, metric="inv"):
    with float64_internals():
        return qm.geodesic_sharpness(model, loss, data, rho=0.05, n_iter=3,
                                     geometry=qm.Geometry(metric=metric, symmetry=symmetry)).value


def _hf_loss(m, b):
    return m(**b).loss


def _hf_out(m, b):
    return m(**{k: v for k, v in b.items() if k != "labels"}).logits


def _torch_loss(m, b):
    return nn.functional.cross_entropy(m(b[0]), b[1])


def _torch_out(m, b):
    return m(b[0])


def _check(model, moved, data, loss, out, metrics=("inv",), full_moves=True):
    """Outputs equal (1e-12); the complete measure unchanged (1e-6); the full one moved."""
    with torch.no_grad(), float64_internals():
        assert (out(model, data[0]) - out(moved, data[0])).abs().max() < 1e-12
    for metric in metrics:
        a, b = (_value(x, data, loss, "complete", metric) for x in (model, moved))
        assert abs(b / a - 1) < 1e-6, (metric, a, b)
    if full_moves:
        a, b = (_value(x, data, loss, "full") for x in (model, moved))
        assert abs(b / a - 1) > 1e-4, (a, b)


def _cls_data(low=3, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(low, 16, (4, 6), generator=g),
             "labels": torch.randint(0, 3, (4,), generator=g)}]


def _torch_data(seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 16, (4, 6), generator=g), torch.randint(0, 3, (4,), generator=g))]


# -- DistilBERT: the ReLU between pre_classifier and classifier ------------------------------------
def test_distilbert_head_relu_scaling_by_hand():
    """pre_classifier rows and bias times lambda > 0, classifier columns over lambda (the ReLU
    is applied functionally in the model's forward, not an MLP module). The full measure's
    elementwise metric is blind to unit scalings already (it spends radius on them), so only
    the complete measure is compared; that the complete group claims them is checked below."""
    model = ZOO["distilbert"]()
    moved, P = _edit(model)
    lam = torch.exp(_randn(8, seed=60, scale=1.5))
    with torch.no_grad():
        P["pre_classifier.weight"].mul_(lam[:, None])
        P["pre_classifier.bias"].mul_(lam)
        P["classifier.weight"].div_(lam[None, :])
    _check(model, moved, _cls_data(), _hf_loss, _hf_out, full_moves=False)


def test_distilbert_head_scaling_is_discovered_and_negative_is_not():
    """The block is claimed with positive scalings only: a negative one breaks the ReLU."""
    model = ZOO["distilbert"]()
    sym = qm.discover(model, symmetry="complete", warn=False)
    heads = [b for b in sym.blocks if "pre_classifier.weight" in b.params]
    assert len(heads) == 1 and heads[0].connected and heads[0].heads == 8
    moved, P = _edit(model)
    with torch.no_grad():
        P["pre_classifier.weight"][0].mul_(-1.0)
        P["pre_classifier.bias"][0].mul_(-1.0)
        P["classifier.weight"][:, 0].mul_(-1.0)
    b = _cls_data()[0]
    with torch.no_grad(), float64_internals():
        assert (_hf_out(model, b) - _hf_out(moved, b)).abs().max() > 1e-3


# -- nn.TransformerEncoder: the head reads the last norm through a mean pooling ------------------
@pytest.mark.parametrize("norm_first", [False, True])
def test_mean_pooled_reader_centring_by_hand(norm_first):
    """head: W + u (1/gamma)^T, b - u (beta/gamma)^T 1, where the head reads the mean over the
    sequence of the last LayerNorm's output (gamma, beta redrawn: not at the canonical point)."""
    model = torch_encoder(norm_first)
    moved, P = _edit(model)
    norm = "norm." if norm_first else "encoder.layers.1.norm2."
    with torch.no_grad():
        g, beta = P[norm + "weight"], P[norm + "bias"]
        u = _randn(3, seed=61, scale=10 / math.sqrt(8))
        P["head.weight"].add_(torch.outer(u, 1 / g))
        P["head.bias"].sub_(u * (beta / g).sum())
    _check(model, moved, _torch_data(), _torch_loss, _torch_out)


def test_mean_pooled_norm_gain_by_hand():
    """The last norm's gain and shift times c (per unit), the head's columns over c: the head
    reads the norm through the mean over the sequence (the complete group's norm gains see
    through it). A unit scaling, to which the full measure's elementwise metric is blind
    already: only the complete measure is compared."""
    model = torch_encoder(False)
    moved, P = _edit(model)
    c = torch.exp(_randn(8, seed=65)) * torch.sign(_randn(8, seed=66))
    with torch.no_grad():
        P["encoder.layers.1.norm2.weight"].mul_(c)
        P["encoder.layers.1.norm2.bias"].mul_(c)
        P["head.weight"].div_(c[None, :])
    _check(model, moved, _torch_data(), _torch_loss, _torch_out, full_moves=False)
    sym = qm.discover(model, symmetry="complete", warn=False, example_inputs=torch_inputs())
    assert any(f.kind == "norm_gain" and f.module == "encoder.layers.1.norm2" for f in sym.folds)


def test_post_norm_embedding_table_shift_by_hand():
    """The token table read directly by the first post-norm block: (E + 1 t^T, in_proj biases
    - W t, out_proj bias - t) keeps the first norm's input (the analogue of the post-norm
    shift, with the table in place of a norm's shift)."""
    model = torch_encoder(False)
    moved, P = _edit(model)
    t = _randn(8, seed=67, scale=3.0)
    a = "encoder.layers.0.self_attn."
    with torch.no_grad():
        P["emb.weight"].add_(t)
        P[a + "in_proj_bias"].sub_(P[a + "in_proj_weight"] @ t)
        P[a + "out_proj.bias"].sub_(t)
    _check(model, moved, _torch_data(), _torch_loss, _torch_out)


def _shear(P, T):
    """E -> E T^T, the first attention's input projection -> W T^{-1} (by hand)."""
    a = "encoder.layers.0.self_attn."
    with torch.no_grad():
        P["emb.weight"].copy_(P["emb.weight"] @ T.T)
        P[a + "in_proj_weight"].copy_(P[a + "in_proj_weight"] @ torch.linalg.inv(T))


def test_post_norm_first_stream_shear_by_hand():
    """The token table read directly by the first post-norm block: the shear T = I + 1 a^T
    moves each token's row by the constant a.x, which the first LayerNorm removes, and the
    in_proj undoes it (W T^{-1}). Claimed, canonicalised to the same point from the sheared
    model; a near miss (I + v a^T, v not along 1) moves the outputs."""
    model = torch_encoder(False)
    moved, P = _edit(model)
    a = _randn(8, seed=68)
    one = torch.ones(8, 1, dtype=torch.float64)
    _shear(P, torch.eye(8, dtype=torch.float64) + one * a[None])
    _check(model, moved, _torch_data(), _torch_loss, _torch_out)
    sym = qm.discover(model, symmetry="complete", warn=False, example_inputs=torch_inputs())
    assert [f.table for f in sym.folds if f.kind == "input_shear"] == ["emb.weight"]
    c0, _ = sym.canonicalize({n: x.detach() for n, x in model.named_parameters()})
    c1, _ = sym.canonicalize({n: x.detach() for n, x in moved.named_parameters()})
    assert max(float((c0[n] - c1[n]).abs().max()) for n in c0) < 1e-10
    near, Q = _edit(model)
    v = one[:, 0] + _randn(8, seed=69, scale=0.3)
    _shear(Q, torch.eye(8, dtype=torch.float64) + v[:, None] * a[None])
    with torch.no_grad():
        y, z = model(_torch_data()[0][0]), near(_torch_data()[0][0])
    assert (y - z).abs().max() > 1e-3 * y.abs().max()


def test_prenorm_claims_no_first_stream_shear():
    """In a pre-norm model the table is read by a LayerNorm first: no shear is proposed (its
    mean is free there, the writer centring's case)."""
    sym = qm.discover(torch_encoder(True), symmetry="complete", warn=False,
                      example_inputs=torch_inputs())
    assert not [f for f in sym.folds if f.kind == "input_shear"]


@pytest.mark.slow
def test_audit_post_norm_encoder_explains_every_flat_direction():
    """With the input shears (d = 8) the post-norm encoder has no unexplained flat direction."""
    r = audit(torch_encoder(False), inputs=torch_inputs())
    assert r.violation < 1e-10 and r.gap[0] > 1e4 * r.gap[1], r.to_dict()
    assert r.by_kind.get("input_shear") == 8, r.by_kind
    assert r.unexplained == 0 and r.flat == r.claimed + r.unused, r.to_dict()


# -- RoBERTa: the padding pair ---------------------------------------------------------------------
def test_roberta_padding_pair_shift_by_hand():
    """word[pad] + s, position[pad] - s: a token sits at position pad exactly when it is the pad
    token (RoBERTa counts positions from the padding index). The batch holds pad tokens. The
    tables' padding_idx is cleared (the rows then get gradients, as the audit reads them):
    with it, torch zeroes the padding rows' gradients and no measure sees them at all."""
    model = ZOO["roberta"]()
    pad = model.config.pad_token_id
    model.roberta.embeddings.word_embeddings.padding_idx = None
    model.roberta.embeddings.position_embeddings.padding_idx = None
    moved, P = _edit(model)
    s = _randn(8, seed=62, scale=10.0)
    with torch.no_grad():
        P["roberta.embeddings.word_embeddings.weight"][pad].add_(s)
        P["roberta.embeddings.position_embeddings.weight"][pad].sub_(s)
    data = _cls_data(low=3)
    data[0]["input_ids"][:, -2:] = pad  # right padding, attended to (no mask)
    _check(model, moved, data, _hf_loss, _hf_out)


def test_roberta_padding_token_input_scaling_is_near_flat_only():
    """The one flat direction the audit leaves on RoBERTa: the padding token's input to the
    embeddings' LayerNorm, e = word[pad] + position[pad] + type[0], scaled through the word
    row (word[pad] + 0.7 e). Exact once that LayerNorm's eps is 0, moved by eps alone: no
    symmetry, so nothing claims it; the near-flat search builds it (the same rows, exact at
    eps = 0)."""
    model = ZOO["roberta"]()
    pad = model.config.pad_token_id
    e = "roberta.embeddings."
    moved, P = _edit(model)
    with torch.no_grad():
        x = sum(P[e + t][pad if t != "token_type_embeddings.weight" else 0] for t in (
            "word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight"))
        P[e + "word_embeddings.weight"][pad].add_(0.7 * x)
    data = _cls_data(low=3)
    data[0]["input_ids"][:, -2:] = pad

    def change(eps):
        for m in (model, moved):
            m.roberta.embeddings.LayerNorm.eps = eps
        with torch.no_grad(), float64_internals():
            a, b = _hf_out(model, data[0]), _hf_out(moved, data[0])
        return float((a - b).abs().max() / a.abs().max())

    assert change(0.0) < 1e-12
    assert change(1e-5) > 1e-7
    model.roberta.embeddings.LayerNorm.eps = 1e-12
    work = copy.deepcopy(model)
    for m in work.modules():
        if isinstance(m, nn.Embedding):
            m.padding_idx = None
    p = Prober(work, {"input_ids": data[0]["input_ids"]})
    rows = [f for f in near_flat(p, p.params) if hasattr(f, "rows")]
    assert [f.rows for f in rows] == [((e + "word_embeddings.weight", pad),
                                      (e + "position_embeddings.weight", pad),
                                      (e + "token_type_embeddings.weight", 0))]
    assert rows[0].exact < 1e-10


def test_roberta_whole_table_shift_fixes_the_first_read_row():
    """The shift of the whole position table is fixed by row pad + 1 (the first position a
    token is read at), the padding pair by row pad: both rows are zero at the canonical point,
    and the canonical point is the same after both shifts applied by hand."""
    model = ZOO["roberta"]()
    pad = model.config.pad_token_id
    sym = qm.discover(model, symmetry="complete", warn=False)
    e = "roberta.embeddings."
    w, p = e + "word_embeddings.weight", e + "position_embeddings.weight"
    moved, P = _edit(model)
    with torch.no_grad():
        t, s = _randn(8, seed=63, scale=2.0), _randn(8, seed=64, scale=2.0)
        P[w].add_(t)
        P[p].sub_(t)
        P[w][pad].add_(s)
        P[p][pad].sub_(s)
    a, _ = sym.canonicalize({n: x.detach() for n, x in model.named_parameters()})
    b, _ = sym.canonicalize({n: x.detach() for n, x in moved.named_parameters()})
    assert a[p][pad].abs().max() == 0 and a[p][pad + 1].abs().max() == 0
    for n in (w, p):
        assert (a[n] - b[n]).abs().max() < 1e-12, n


def test_padding_pair_needs_positions_counted_from_the_padding_index():
    """BERT counts positions from 0: a padding_idx on its position table pairs nothing (the
    check on padded inputs sees row 0 read by every first token), so no pad shift is claimed."""
    model = ZOO["bert"]()
    model.bert.embeddings.position_embeddings.padding_idx = 0
    sym = qm.discover(model, symmetry="complete", warn=False)
    assert not [f for f in sym.folds if f.kind == "pad_shift"]
    shifts = [f for f in sym.folds if f.kind == "embedding_shift"]
    assert shifts and all(f.row == 0 for f in shifts)


# -- ViT: the class token, patch convolution and positions as writers ------------------------------
def test_vit_token_shifts_and_writer_centring_by_hand():
    """(cls + t, P_0 - t), (patch bias + s, P_1: - s), and the translations along 1 of every
    writer into the pre-norm stream that is a parameter or a convolution: the patch kernel
    (one constant per input channel and offset), its bias, the class token, each position
    row."""
    model = ZOO["vit"]()
    moved, P = _edit(model)
    e = "vit.embeddings."
    cls, pos = P[e + "cls_token"], P[e + "position_embeddings"]
    W, b = P[e + "patch_embeddings.projection.weight"], P[e + "patch_embeddings.projection.bias"]
    t, s = _randn(8, seed=70, scale=3.0), _randn(8, seed=71, scale=3.0)
    with torch.no_grad():
        cls.add_(t)
        pos[0, 0].sub_(t)
        b.add_(s)
        pos[0, 1:].sub_(s)
        W.add_(_randn(1, *W.shape[1:], seed=72, scale=10 / math.sqrt(W[0].numel())))
        b.add_(2.0)
        cls.add_(-1.5)
        pos.add_(_randn(1, pos.shape[1], 1, seed=73, scale=3.0))
    g = torch.Generator().manual_seed(5)
    data = [{"pixel_values": torch.randn(4, 1, 4, 4, generator=g, dtype=torch.float64),
             "labels": torch.randint(0, 3, (4,), generator=g)}]
    _check(model, moved, data, _hf_loss, _hf_out)


# -- residual rotations of LayerNorm streams (O(d - 1) on 1^perp) ---------------------------------
def _rotation_fixing_ones(d, seed):
    """B diag(1, R) B^T: a Haar rotation of the complement of 1, B's first column 1/sqrt(d)."""
    one = torch.full((d, 1), 1 / math.sqrt(d), dtype=torch.float64)
    B = torch.linalg.qr(torch.cat([one, torch.eye(d, dtype=torch.float64)], 1))[0][:, :d]
    B[:, 0] = one[:, 0]
    R, T = torch.linalg.qr(_randn(d - 1, d - 1, seed=seed))
    R = R * torch.sign(torch.diagonal(T))
    full = torch.eye(d, dtype=torch.float64)
    full[1:, 1:] = R
    return B @ full @ B.T


def _fold_layernorm(P, norm, readers):
    """gamma and beta into the readers by hand: W diag(gamma), b + W beta; gamma = 1, beta = 0."""
    g, beta = P[norm + ".weight"], P[norm + ".bias"]
    for w, b in readers:
        P[b].add_(P[w] @ beta)
        P[w].mul_(g[None, :])
    g.fill_(1.0)
    beta.zero_()


def _rotate(P, Q, writers=(), writer_biases=(), rows=(), readers=()):
    """Q W (writers' output axis first: linear maps, a convolution), Q b, E Q^T (the stream on
    the last axis: tables, a class token, positions), W Q^T (readers)."""
    for w in writers:
        P[w].copy_(torch.einsum("ij,j...->i...", Q, P[w]))
    for b in writer_biases:
        P[b].copy_(Q @ P[b])
    for e in rows:
        P[e].copy_(P[e] @ Q.T)
    for w in readers:
        P[w].copy_(P[w] @ Q.T)


def test_vit_residual_rotation_by_hand():
    """HF ViT, LayerNorm gains and shifts folded by hand, the stream rotated by a Haar rotation
    of 1^perp: the patch kernel and every output projection Q W, their biases Q b, the class
    token and positions E Q^T, every reader W Q^T (the classifier reads the last norm at the
    class token)."""
    model = ZOO["vit"]()
    moved, P = _edit(model)
    Q = _rotation_fixing_ones(8, seed=80)
    readers = {"layernorm_before": ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
               "layernorm_after": ("mlp.fc1",)}
    with torch.no_grad():
        lins, outs = ["classifier"], []
        for i in range(2):
            p = f"vit.layers.{i}."
            for norm, rd in readers.items():
                _fold_layernorm(P, p + norm, [(p + r + ".weight", p + r + ".bias") for r in rd])
                lins += [p + r for r in rd]
            outs += [p + "attention.o_proj", p + "mlp.fc2"]
        _fold_layernorm(P, "vit.layernorm", [("classifier.weight", "classifier.bias")])
        e = "vit.embeddings."
        _rotate(P, Q, writers=[e + "patch_embeddings.projection.weight"]
                + [o + ".weight" for o in outs],
                writer_biases=[e + "patch_embeddings.projection.bias"]
                + [o + ".bias" for o in outs],
                rows=[e + "cls_token", e + "position_embeddings"],
                readers=[r + ".weight" for r in lins])
    g = torch.Generator().manual_seed(5)
    data = [{"pixel_values": torch.randn(4, 1, 4, 4, generator=g, dtype=torch.float64),
             "labels": torch.randint(0, 3, (4,), generator=g)}]
    _check(model, moved, data, _hf_loss, _hf_out, metrics=("inv", "mix"))


def test_prenorm_encoder_residual_rotation_by_hand():
    """`nn.TransformerEncoder(norm_first=True)` over token embeddings, mean-pooled: the last
    norm is read by the head through the mean over the sequence, which commutes with Q."""
    model = torch_encoder(True)
    moved, P = _edit(model)
    Q = _rotation_fixing_ones(8, seed=81)
    with torch.no_grad():
        readers, writers, biases = ["head.weight"], [], []
        for i in range(2):
            p = f"encoder.layers.{i}."
            _fold_layernorm(P, p + "norm1", [(p + "self_attn.in_proj_weight",
                                              p + "self_attn.in_proj_bias")])
            _fold_layernorm(P, p + "norm2", [(p + "linear1.weight", p + "linear1.bias")])
            readers += [p + "self_attn.in_proj_weight", p + "linear1.weight"]
            writers += [p + "self_attn.out_proj.weight", p + "linear2.weight"]
            biases += [p + "self_attn.out_proj.bias", p + "linear2.bias"]
        _fold_layernorm(P, "norm", [("head.weight", "head.bias")])
        _rotate(P, Q, writers=writers, writer_biases=biases, rows=["emb.weight"],
                readers=readers)
    _check(model, moved, _torch_data(), _torch_loss, _torch_out, metrics=("inv", "mix"))


def test_prenorm_stream_scaling_is_near_flat_only():
    """ViT (eps = 1e-12): every writer of the stream times lambda scales the input of every
    norm; the audit's near-flat search builds it, exact at eps = 0 only."""
    model = ZOO["vit"]()
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 1, 4, 4, generator=g, dtype=torch.float64),)
    p = Prober(model, x)
    found = [f for f in near_flat(p, p.params) if isinstance(f, StreamNearFlat)]
    assert len(found) == 1, found
    f = found[0]
    assert len(f.norms) == 5 and "vit.embeddings.cls_token" in f.up
    assert "vit.layers.0.attention.q_proj.weight" not in f.up  # a reader, not a writer
    assert f.exact < 1e-10 and 10 * f.exact < f.change < 1e-9


# -- the near-flat scalings of post-norm LayerNorm inputs ------------------------------------------
def _outputs_eps(model, eps, batch):
    m = copy.deepcopy(model)
    for x in m.modules():
        if isinstance(x, nn.LayerNorm):
            x.eps = eps
    with torch.no_grad(), float64_internals():
        return _hf_out(m, batch)


def test_bert_layernorm_input_scaling_is_flat_only_at_eps_zero():
    """By hand: the input of layer 0's attention LayerNorm times lambda (the embedding
    LayerNorm's gain and shift and the attention output times lambda, the queries, keys and
    values over lambda). Exact at eps = 0; a change of order eps otherwise, and not small at
    eps = 1e-3: no symmetry. near_flat finds the same parameters, for every LayerNorm."""
    model = ZOO["bert"]()
    moved, P = _edit(model)
    lam = 1.9
    e, a = "bert.embeddings.LayerNorm.", "bert.encoder.layer.0.attention."
    with torch.no_grad():
        for n in (e + "weight", e + "bias", a + "output.dense.weight", a + "output.dense.bias"):
            P[n].mul_(lam)
        for r in ("query", "key", "value"):
            P[a + f"self.{r}.weight"].div_(lam)
    b = _cls_data()[0]
    ref0, new0 = _outputs_eps(model, 0.0, b), _outputs_eps(moved, 0.0, b)
    assert (ref0 - new0).abs().max() < 1e-12 * ref0.abs().max()
    small = (_outputs_eps(model, 1e-12, b) - _outputs_eps(moved, 1e-12, b)).abs().max()
    large = (_outputs_eps(model, 1e-3, b) - _outputs_eps(moved, 1e-3, b)).abs().max()
    assert small < 1e-10 and large > 1e3 * max(float(small), 1e-16)
    p = Prober(model)
    found = {f.norm: f for f in near_flat(p, p.params)}
    assert len(found) == 5  # the embedding LayerNorm and two per layer
    f = found["bert.encoder.layer.0.attention.output.LayerNorm"]
    assert set(f.up) == {e + "weight", e + "bias", a + "output.dense.weight",
                         a + "output.dense.bias"}
    assert {c.weight for c in f.down} == {a + f"self.{r}.weight" for r in ("query", "key",
                                                                           "value")}
    assert all(g.exact < 1e-10 for g in found.values())


def test_prenorm_stream_writer_is_no_near_flat_scaling():
    """In a pre-norm model the last writer alone does not make a norm's input: scaling it is
    not exact at eps = 0, so nothing is reported but the scaling of the whole stream."""
    model = torch_encoder(True)
    p = Prober(model, torch_inputs())
    found = near_flat(p, p.params)
    assert [type(f) for f in found] == [StreamNearFlat]
    assert found[0].eps == 1e-5 and found[0].change > 1e-9  # not flat at this eps


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "electra", "distilbert", "roberta"])
def test_audit_encoders(name):
    """No unexplained flat direction; the near-flat ones lie in the measured kernel."""
    kw = {"inputs": torch_inputs()} if name.startswith("torch") else {}
    r = audit(ZOO[name](), **kw)
    assert r.violation < 1e-10 and r.gap[0] > 1e4 * r.gap[1], r.to_dict()
    assert r.unexplained == 0, r.to_dict()
    assert r.flat == r.claimed + r.unused + r.near_flat, r.to_dict()
    assert all(x["in_kernel"] and x["exact"] < 1e-10 for x in r.near_flat_reasons)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit", "torch_encoder_prenorm"])
def test_audit_prenorm_layernorm_streams(name):
    """The stream rotations claimed (ViT: with the patch kernel, class token and positions as
    writers; the pre-norm encoder: the head reading the last norm through a mean): nothing
    unexplained; ViT's stream scaling is near-flat (eps = 1e-12), the encoder's is not in the
    kernel (eps = 1e-5)."""
    kw = {"inputs": torch_inputs()} if name.startswith("torch") else {}
    r = audit(ZOO[name](), **kw)
    assert r.violation < 1e-10 and r.gap[0] > 1e4 * r.gap[1], r.to_dict()
    assert r.unexplained == 0 and r.flat == r.claimed + r.unused + r.near_flat, r.to_dict()
    assert r.near_flat == (1 if name == "vit" else 0)
