"""Models layer: block discovery on real model classes, the sanity test of every
mapping, declared blocks, fallbacks, ModelGeometry gather/scatter and reparametrize."""

from __future__ import annotations

import math

import pytest
import torch
from model_zoo import (
    MHANet,
    small_bert,
    small_hf_vit,
    small_timm_vit,
)
from torch import nn

import quotient_manifolds as qm
from quotient_manifolds.geometry import gl
from quotient_manifolds.models import gather_block


def _aug(X, rows):
    """``[X 1]`` when the factor has a bias row, else ``X``."""
    if rows == X.shape[-1] + 1:
        return torch.cat([X, torch.ones(*X.shape[:-1], 1)], dim=-1)
    assert rows == X.shape[-1]
    return X


def _by_kind(blocks, module):
    qk = [b for b in blocks if b.module == module and b.kind == "attention.qk"]
    vo = [b for b in blocks if b.module == module and b.kind == "attention.vo"]
    return (qk[0] if qk else None), (vo[0] if vo else None)


def _reconstruct(qk, vo, params, Xq, Xk, Xv, out_bias):
    """Spec §4.4: logits·√d_k = [X 1] G Hᵀ [X 1]ᵀ, output = Σ_i P_i [X 1] G^VO_i H^VO_iᵀ + b_o."""
    x = gather_block(qk, params)
    G, H = x[:, : qk.n], x[:, qk.n :]
    logits = _aug(Xq, qk.n) @ G @ H.transpose(-1, -2) @ _aug(Xk, qk.m).transpose(-1, -2)
    P = torch.softmax(logits / math.sqrt(qk.h), dim=-1)
    y = gather_block(vo, params)
    Gv, Hv = y[:, : vo.n], y[:, vo.n :]
    out = (P @ _aug(Xv, vo.n) @ Gv @ Hv.transpose(-1, -2)).sum(0)
    return (out + out_bias if out_bias is not None else out), P


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kv", [(None, None), (6, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_mha_mapping_reproduces_attention(batch_first, kv, bias):
    torch.manual_seed(0)
    d, heads = 8, 2
    mha = nn.MultiheadAttention(d, heads, bias=bias, batch_first=batch_first, kdim=kv[0],
                                vdim=kv[1])
    blocks = qm.discover_blocks(mha)
    assert [b.kind for b in blocks] == ["attention.qk", "attention.vo"]
    qk, vo = blocks
    assert (qk.heads, qk.h) == (heads, d // heads)
    assert qk.n == d + bias and qk.m == (kv[0] or d) + bias
    assert vo.n == (kv[1] or d) + bias and vo.m == d
    Xq, Xk, Xv = torch.randn(5, d), torch.randn(7, kv[0] or d), torch.randn(7, kv[1] or d)
    params = dict(mha.named_parameters())
    out, P = _reconstruct(qk, vo, params, Xq, Xk, Xv, mha.out_proj.bias)
    shape = (lambda t: t.unsqueeze(0)) if batch_first else (lambda t: t.unsqueeze(1))
    ref, w = mha(shape(Xq), shape(Xk), shape(Xv), need_weights=True,
                 average_attn_weights=False)
    ref = ref[0] if batch_first else ref[:, 0]
    torch.testing.assert_close(P, w[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_mha_bias_kv_rows():
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(8, 2, add_bias_kv=True)
    qk, vo = qm.discover_blocks(mha)
    assert qk.m == 8 + 1 + 1 and vo.n == 8 + 1 + 1  # weight rows, bias row, bias_k / bias_v
    assert qk.H[-1].param == "bias_k" and vo.G[-1].param == "bias_v"


def _hook_io(attn_module, out_linear, model, inputs):
    store = {}

    def pre(mod, args, kwargs):
        store["x"] = (args[0] if args else kwargs["hidden_states"]).detach()

    def post(mod, args, out):
        store["y"] = out.detach()

    h1 = attn_module.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = out_linear.register_forward_hook(post)
    try:
        with torch.no_grad():
            model(**inputs) if isinstance(inputs, dict) else model(inputs)
    finally:
        h1.remove()
        h2.remove()
    return store["x"], store["y"]


def test_bert_mapping_reproduces_attention():
    model = small_bert().eval()
    blocks = qm.discover_blocks(model)
    kinds = [(b.module, b.kind) for b in blocks]
    assert kinds == [(f"bert.encoder.layer.{i}.attention.self", k) for i in range(2)
                     for k in ("attention.qk", "attention.vo")]
    qk, vo = blocks[2], blocks[3]
    assert (qk.n, qk.m, qk.h, qk.heads) == (17, 17, 8, 2) and (vo.n, vo.m) == (17, 16)
    layer = model.bert.encoder.layer[1].attention
    ids = {"input_ids": torch.randint(0, 40, (1, 6))}
    x, y = _hook_io(layer.self, layer.output.dense, model, ids)
    out, _ = _reconstruct(qk, vo, dict(model.named_parameters()), x[0], x[0], x[0],
                          layer.output.dense.bias)
    torch.testing.assert_close(out, y[0], rtol=1e-9, atol=1e-10)


def test_hf_vit_mapping_reproduces_attention():
    model = small_hf_vit().eval()
    blocks = qm.discover_blocks(model)
    assert len(blocks) == 4 and {b.kind for b in blocks} == {"attention.qk", "attention.vo"}
    qk, vo = _by_kind(blocks, blocks[0].module)
    attn = model.get_submodule(qk.module)
    x, y = _hook_io(attn, attn.o_proj, model, torch.randn(1, 3, 8, 8))
    out, _ = _reconstruct(qk, vo, dict(model.named_parameters()), x[0], x[0], x[0],
                          attn.o_proj.bias)
    torch.testing.assert_close(out, y[0], rtol=1e-9, atol=1e-10)


def test_timm_attention_mapping():
    model = small_timm_vit().eval()
    blocks = qm.discover_blocks(model)
    assert [b.module for b in blocks] == ["blocks.0.attn"] * 2 + ["blocks.1.attn"] * 2
    qk, vo = blocks[:2]
    assert qk.G[0].offset == 0 and qk.H[0].offset == 16 and vo.G[0].offset == 32
    attn = model.blocks[0].attn
    x = torch.randn(1, 5, 16)
    with torch.no_grad():
        ref = attn(x)
    out, _ = _reconstruct(qk, vo, dict(model.named_parameters()), x[0], x[0], x[0],
                          attn.proj.bias)
    torch.testing.assert_close(out, ref[0], rtol=1e-9, atol=1e-10)


def test_timm_qk_norm_falls_back():
    from timm.layers import Attention

    attn = Attention(16, num_heads=2, qkv_bias=True, qk_norm=True, norm_layer=nn.LayerNorm)
    with pytest.warns(qm.SymmetryFallbackWarning, match="q/k normalisation"):
        blocks = qm.discover_blocks(attn)
    assert [b.kind for b in blocks] == ["attention.vo"]


def _lora_model():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return get_peft_model(net, LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"],
                                          init_lora_weights=False))


def test_peft_lora_mapping():
    model = _lora_model()
    blocks = qm.discover_blocks(model)
    assert [b.kind for b in blocks] == ["lora", "lora"]
    b = blocks[0]
    assert (b.n, b.m, b.h, b.heads) == (8, 6, 2, 1)
    layer = model.get_submodule(b.module)
    x = gather_block(b, dict(model.named_parameters()))[0]
    GHt = x[: b.n] @ x[b.n :].T
    torch.testing.assert_close(layer.scaling["default"] * GHt, layer.get_delta_weight("default"))


def test_peft_lora_default_init_is_rank_deficient():
    from peft import LoraConfig, get_peft_model

    net = get_peft_model(nn.Sequential(nn.Linear(6, 8)), LoraConfig(r=2, target_modules=["0"]))
    with pytest.raises(qm.RankDeficientError, match=r"lora at .*head 0"):
        qm.ModelGeometry(net)
    qm.ModelGeometry(net, qm.Geometry(eps=1e-3))  # the ε relaxation fixes it


def test_declared_two_layer_block_and_diagonal():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 4))
    spec = qm.declare_block(G="1.weight", H=[("0.weight", "rows"), ("0.bias", "bias")])
    with pytest.warns(qm.NoBlocksWarning):
        assert qm.discover_blocks(net, symmetry="full") == []
    # the complete group quotients the units between the two maps one by one (GL(1) each); the
    # declared GL(3) block over the same weights takes precedence
    units = qm.discover_blocks(net, example_inputs=(torch.randn(2, 5),), warn=False)
    assert units and all(u.h == 1 for u in units)
    (b,) = qm.discover_blocks(net, declared=[spec], example_inputs=(torch.randn(2, 5),),
                              warn=False)
    assert (b.n, b.m, b.h, b.kind) == (4, 6, 3, "custom")
    x = gather_block(b, dict(net.named_parameters()))[0]
    torch.testing.assert_close(x[:4], net[1].weight)
    torch.testing.assert_close(x[4:], torch.cat([net[0].weight.T, net[0].bias[None]]))
    net2 = qm.reparametrize(net, a=3.0, generator=torch.Generator().manual_seed(1), blocks=[spec])
    inp = torch.randn(7, 5)
    assert not torch.allclose(net2[1].weight, net[1].weight)
    torch.testing.assert_close(net2(inp), net(inp))

    class Diag(nn.Module):
        def __init__(self):
            super().__init__()
            self.u = nn.Parameter(torch.randn(6))
            self.v = nn.Parameter(torch.randn(6))

        def forward(self, X):
            return X @ (self.u * self.v)

    dnet = Diag()
    dspec = qm.declare_block(G=[("u", "elem")], H=[("v", "elem")], heads=6, kind="diagonal")
    (db,) = qm.ModelGeometry(dnet, qm.Geometry(blocks=[dspec])).blocks
    assert (db.n, db.m, db.h, db.heads) == (1, 1, 1, 6)
    X = torch.randn(4, 6)
    torch.testing.assert_close(qm.reparametrize(
        dnet, a=2.0, generator=torch.Generator().manual_seed(0), blocks=[dspec])(X), dnet(X))


def test_declared_block_errors():
    net = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 4))
    with pytest.raises(qm.BlockSpecError, match="does not have"):
        qm.ModelGeometry(net, qm.Geometry(blocks=[qm.declare_block(G="nope.weight", H="0.weight")]))
    spec = qm.declare_block(G="1.weight", H=[("0.weight", "rows")])
    with pytest.raises(qm.BlockSpecError, match="same entries"):
        qm.ModelGeometry(net, qm.Geometry(blocks=[spec, spec]))


def _llama(kv_heads):
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, intermediate_size=32, vocab_size=50)
    return LlamaModel(cfg)


def test_llama_gqa_and_rotary_paper_mode_falls_back_per_module():
    """The paper's measure (GL(h) blocks only) has no block for grouped or rotary heads; each
    attention module warns once, naming itself."""
    with pytest.warns(qm.NoBlocksWarning), pytest.warns(
        qm.SymmetryFallbackWarning, match="grouped K/V heads"
    ) as rec:
        sym = qm.discover(_llama(2), symmetry="paper")
    msgs = [str(w.message) for w in rec if w.category is qm.SymmetryFallbackWarning]
    assert len(msgs) == 2 and all(f"layers.{i}.self_attn" in msgs[i] for i in (0, 1))
    assert sym.blocks == ()
    assert {(f.module, f.kind) for f in sym.fallbacks} >= {
        (f"layers.{i}.self_attn", k) for i in (0, 1) for k in ("attention.qk", "attention.vo")}
    with pytest.warns(qm.SymmetryFallbackWarning, match="rotary"):
        blocks = qm.discover_blocks(_llama(4), symmetry="paper")
    assert [b.kind for b in blocks] == ["attention.vo", "attention.vo"]
    full = qm.discover(_llama(2), symmetry="full")
    assert [(b.kind, b.heads, b.group is not None) for b in full.blocks] == [
        ("attention.qk", 2, True), ("attention.vo", 2, False)] * 2


def test_model_without_blocks_warns_and_records():
    """Under the full group (the complete one quotients its ReLU units)."""
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.warns(qm.NoBlocksWarning, match="declare_block"):
        geo = qm.ModelGeometry(net, qm.Geometry(symmetry="full"))
    assert geo.groups == [] and geo.fallbacks[-1].kind == "all"
    assert geo.w0.numel() == sum(p.numel() for p in net.parameters())


@pytest.mark.parametrize("factory", [lambda: MHANet(), small_bert, small_timm_vit, small_hf_vit])
def test_model_geometry_gather_scatter_and_grad(factory):
    model = factory()
    geo = qm.ModelGeometry(model, warn=False)
    assert geo.groups, "no block found"
    # batching: all same-shaped heads of all layers in one tensor
    assert sum(g.x0.shape[0] for g in geo.groups) == sum(b.heads for b in geo.blocks)
    rebuilt = geo.to_params(geo.gather(geo.base))  # the base point: the canonical parameters
    for n, _ in model.named_parameters():
        assert torch.equal(rebuilt[n], geo.base[n]), n
    zero = geo.params_at(geo.zeros())
    assert all(torch.equal(zero[n], geo.base[n]) for n, _ in model.named_parameters())
    xi = torch.randn(geo.D).mul_(1e-3).requires_grad_()
    new = geo.params_at(xi)
    s = sum((t.double() ** 2).sum() for t in new.values())
    (grad,) = torch.autograd.grad(s, xi)
    assert all(g.abs().sum() > 0 for g in geo.space.split(grad))


def test_model_geometry_is_the_product_of_the_manifolds_tangent_spaces():
    """Under the full group (under the complete one the adaptive part is also projected off the
    translation orbits: tests/test_horizontal_translations.py)."""
    model = small_bert()
    geo = qm.ModelGeometry(model, qm.Geometry(symmetry="full"))
    u = geo.space.proju(torch.randn(geo.D, dtype=geo.dtype))
    parts = geo.space.split(u)
    live = geo.w0 != 0  # zero weights (untrained biases) are frozen: no metric term
    assert geo.n_masked_zeros == int((~live).sum()) > 0
    total = (parts[-1] ** 2 / geo.w0**2)[live].sum()
    for g, ug in zip(geo.groups, parts, strict=False):
        torch.testing.assert_close(g.manifold.proju(g.x0, ug), ug)  # Π is idempotent
        total = total + g.manifold.inner(g.x0, ug).sum()
        res = gl.horizontal_residual(g.G, g.H, ug[:, : g.n], ug[:, g.n :], g.grams, "inv")
        assert res.abs().max() < 1e-9
    torch.testing.assert_close(geo.space.norm(u) ** 2, total)
    egrad = torch.randn(geo.D, dtype=geo.dtype)
    r = geo.space.split(geo.space.egrad2rgrad(egrad))
    for g, rg, eg in zip(geo.groups, r, geo.space.split(egrad), strict=False):
        torch.testing.assert_close(rg, g.manifold.egrad2rgrad(g.x0, eg))
    torch.testing.assert_close(r[-1], geo.c2 * geo.space.split(egrad)[-1])


def test_zero_weights_are_masked_and_half_is_rejected():
    net = MHANet()
    with torch.no_grad():
        net.head.bias.zero_()
    geo = qm.ModelGeometry(net)
    assert geo.n_masked_zeros >= 3
    assert qm.ModelGeometry(net, qm.Geometry(adaptive_eps=1e-4)).n_masked_zeros == 0
    with pytest.raises(qm.PrecisionError, match=r"model.float\(\)"):
        qm.ModelGeometry(MHANet().half())
    geo16 = qm.ModelGeometry(MHANet().to(torch.bfloat16), qm.Geometry(half="float32"))
    assert geo16.dtype == torch.float32 and geo16.groups[0].grams.P.dtype == torch.float64


def test_reparametrize_changes_weights_not_outputs():
    model = small_bert().eval()
    ids = {"input_ids": torch.randint(0, 40, (2, 6))}
    ref = model(**ids).logits
    for a in (1e-2, 1.0, 1e2):
        new = qm.reparametrize(model, a=a, generator=torch.Generator().manual_seed(3))
        q0 = model.bert.encoder.layer[0].attention.self.query.weight
        q1 = new.bert.encoder.layer[0].attention.self.query.weight
        assert not torch.allclose(q0, q1)
        torch.testing.assert_close(new(**ids).logits, ref, rtol=1e-7, atol=1e-9)
    paper = qm.reparametrize(model, generator=torch.Generator().manual_seed(5), symmetry="paper")
    torch.testing.assert_close(paper.bert.pooler.dense.weight,
                               model.bert.pooler.dense.weight)  # non-block weights untouched


def test_tiny_float32_weights_are_masked_like_zeros():
    """|w| < 1e-22 squares to 0 in float32; such weights must not enter ξ²/w² (MiniLM has 4)."""
    lin = torch.nn.Linear(3, 2).float()
    with torch.no_grad():
        lin.weight[0, 0] = 1e-30
        lin.weight[1, 1] = 0.0
    with pytest.warns(qm.NoBlocksWarning):
        geo = qm.ModelGeometry(lin)
    assert geo.n_masked_zeros == 2
    # they stay in the flat vector, frozen: no metric term, zero gradient, never moved
    assert int((geo.c2 == 0).sum()) == 2 and bool(torch.isfinite(geo.adaptive_space.inv_c2).all())
    g = torch.ones(geo.D)
    assert int((geo.space.egrad2rgrad(g) == 0).sum()) == 2
