"""Model-parallel sharpness: FSDP2 (`fully_shard`) on 2 gloo processes against one process.

One spawn runs every case on a tiny Llama and a tiny BERT (float64, redrawn weights), each
sharded layer by layer over a 1-D mesh of 2 ranks; the parent computes the unsharded values
in the meantime and compares. A second spawn (4 ranks, a 2 x 2 mesh data x model) checks the
composition with data parallelism.
"""

from __future__ import annotations

import math
import os
import socket
import sys

import pytest
import torch

import quotient_manifolds as qm
from quotient_manifolds.errors import ShardedModelError
from quotient_manifolds.models.precision import float64_internals
from quotient_manifolds.sharpness import measure

sys.path.insert(0, os.path.dirname(__file__))
from model_zoo import redraw_, zoo_bert, zoo_llama  # noqa: E402

N_ITER = 4
KEYS = ("per_batch", "base_loss", "max_loss", "perturbation_norm")


def _loss(model, batch):
    """A mean over the examples (and positions) of a non-trivial function of the outputs."""
    h = model(**batch).last_hidden_state
    return (h[..., :5].sum(-1).sin() + h[..., 5:9].pow(2).sum(-1)).mean()


def _data(seed: int, bert: bool, n_batches: int = 2, bs: int = 2, seq: int = 6) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(0, 40, (bs, seq), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)} if bert
                   else {"input_ids": ids})
    return out


def llama_cut():
    """3 heads of 8 and one key/value head on 2 ranks: FSDP's dim-0 shards of W_Q (24 rows),
    W_K and W_V (8 rows) cut a head's rows between the ranks."""
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
                      num_key_value_heads=1, intermediate_size=48, vocab_size=40,
                      max_position_embeddings=32, attn_implementation="eager")
    return redraw_(LlamaModel(cfg).double().eval(), seed=3)


MODELS = {"llama": (zoo_llama, lambda m: list(m.layers), False),
          "bert": (zoo_bert, lambda m: list(m.encoder.layer), True),
          "llama_cut": (llama_cut, lambda m: list(m.layers), False)}
ONLY = {"llama_cut": ("inv/worst", "mix/average")}  # the other cases run on the others


def _cases(sym: qm.models.Symmetries | None = None) -> dict[str, dict]:
    """name -> keyword arguments of geodesic_sharpness (the complete measures)."""
    out = {}
    for metric in ("inv", "mix"):
        g = measure(f"geodesic-{metric}-complete").geometry
        if sym is not None:
            g = g.replace(symmetries=sym)
        out[f"{metric}/worst"] = dict(geometry=g, solver=qm.APGD(n_iter=N_ITER))
        out[f"{metric}/average"] = dict(geometry=g, solver=qm.Average(n=3, seed=5))
    return out


def _run(model, name: str, sym, shard=None) -> dict[str, dict]:
    bert = MODELS[name][2]
    out = {}
    with float64_internals():
        for case, kw in _cases(sym).items():
            if case not in ONLY.get(name, (case,)):
                continue
            out[case] = qm.geodesic_sharpness(model, _loss, _data(1, bert), rho=0.1,
                                              shard=shard, **kw).to_dict()
    return out


def _bf16(model=None, mesh=None) -> dict:
    """The tiny Llama in bfloat16 with a float32 ascent state (the wire dtype of the gather
    is the weights'): one worst-case call."""
    model = zoo_llama().to(torch.bfloat16) if model is None else model
    if mesh is not None:
        model = _shard(model, list(model.layers), mesh)
    return qm.geodesic_sharpness(model, _loss, _data(1, False), rho=0.1, n_iter=3,
                                 geometry=qm.Geometry(half="float32")).to_dict()


def _symmetries(model, name: str):
    g = measure("geodesic-inv-complete").geometry
    with float64_internals():
        return qm.symmetries_of(model, _loss, _data(1, MODELS[name][2]), geometry=g)


def _shard(model, layers, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _sym_key(sym) -> str:
    return repr((sym.blocks, sym.fallbacks, sym.folds, sym.layout, sym.symmetry))


def _local(model) -> dict[str, torch.Tensor]:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _faults(model, name: str, mesh) -> dict[str, str]:
    """Bad input on a sharded model: each must give a named error."""
    bert = MODELS[name][2]

    def outcome(fn) -> str:
        try:
            fn()
            return "no error"
        except ShardedModelError as e:
            return f"ShardedModelError: {e}"
        except Exception as e:  # noqa: BLE001 - the test reads the type
            return f"{type(e).__name__}: {e}"

    data = _data(1, bert)
    return {
        "adaptive": outcome(lambda: qm.adaptive_sharpness(model, _loss, data, rho=0.1,
                                                          n_iter=1)),
        "batches_1d": outcome(lambda: qm.geodesic_sharpness(model, _loss, data, rho=0.1,
                                                            n_iter=1, shard="batches")),
        "geoopt": outcome(lambda: qm.geodesic_sharpness(
            model, _loss, data, rho=0.1,
            solver=qm.GeooptSolver(lambda ps: torch.optim.SGD(ps, lr=0.1)))),
    }


def _written_detected(model) -> str:
    """A write to this rank's shard inside `preserved` is named (and then undone here)."""
    from quotient_manifolds.state import preserved

    p = next(iter(model.parameters()))
    saved = p.to_local().detach().clone()
    try:
        with preserved(model):
            with torch.no_grad():
                p.to_local().add_(1.0)
        return "no error"
    except qm.errors.ModelStateError as e:
        return str(e)
    finally:
        with torch.no_grad():
            p.to_local().copy_(saved)


def _worker(rank: int, port: int, outdir: str, world: int, mesh_shape: tuple) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        names = ("data", "model") if len(mesh_shape) == 2 else None  # HSDP needs the names
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        res: dict = {}
        for name, (make, layers, _) in MODELS.items():
            if len(mesh_shape) == 2 and name != "llama":
                continue
            model = make()
            model = _shard(model, layers(model), mesh)
            before = _local(model)
            attn = model.layers[0].self_attn if name != "bert" else None
            if attn is not None:
                res[f"{name}/rows"] = {k: getattr(attn, k).weight.to_local().shape[0]
                                       for k in ("q_proj", "k_proj", "v_proj")}
            if len(mesh_shape) == 1:
                sym = _symmetries(model, name)
                res[f"{name}/sym"] = _sym_key(sym)
                res[f"{name}/run"] = _run(model, name, sym)
                with float64_internals():  # discovery inside the call, on the sharded model
                    res[f"{name}/discovered"] = qm.geodesic_sharpness(
                        model, _loss, _data(1, MODELS[name][2]), rho=0.1,
                        geometry=measure("geodesic-inv-complete").geometry,
                        n_iter=N_ITER).to_dict()
                res[f"{name}/faults"] = _faults(model, name, mesh)
                res[f"{name}/written"] = _written_detected(model)
            else:
                sym = _symmetries(model, name)
                for shard in ("within_batch", "batches"):
                    res[f"{name}/{shard}"] = _run(model, name, sym, shard=shard)
            after = _local(model)
            res[f"{name}/restored"] = all(torch.equal(before[k], after[k]) for k in before)
            res[f"{name}/grads"] = all(p.grad is None for p in model.parameters())
        if len(mesh_shape) == 1:
            res["bf16"] = _bf16(zoo_llama().to(torch.bfloat16), mesh)
        torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single(names: tuple[str, ...]) -> dict:
    """The unsharded values (one process), computed while the ranks run."""
    torch.set_num_threads(1)
    out = {}
    for name in names:
        model = MODELS[name][0]()
        sym = _symmetries(model, name)
        out[f"{name}/sym"] = _sym_key(sym)
        out[f"{name}/run"] = _run(model, name, sym)
    if "bert" in names:  # the 2-rank run
        out["bf16"] = _bf16()
    return out


def _spawn(tmp, world: int, mesh_shape: tuple, names: tuple[str, ...]
           ) -> tuple[list[dict], dict]:
    import torch.multiprocessing as mp

    outdir = str(tmp)
    ctx = mp.start_processes(_worker, args=(_free_port(), outdir, world, mesh_shape),
                             nprocs=world, join=False, start_method="spawn")
    try:
        single = _single(names)
    finally:
        while not ctx.join():
            pass
    return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)
            for r in range(world)], single


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[list[dict], dict]:
    return _spawn(tmp_path_factory.mktemp("fsdp2"), 2, (2,), tuple(MODELS))


def _close(got: dict, want: dict, what: str) -> None:
    assert got["n_evals"] == want["n_evals"], what
    for key in KEYS:
        for x, y in zip(got[key], want[key], strict=True):
            assert (math.isnan(x) and math.isnan(y)) or abs(x - y) <= 1e-10 * max(1.0, abs(y)), (
                what, key, x, y)
    assert abs(got["value"] - want["value"]) <= 1e-10 * max(1.0, abs(want["value"])), what


@pytest.mark.parametrize("name", list(MODELS))
def test_sharded_equals_one_process(two, name):
    ranks, single = two
    for case in ONLY.get(name, tuple(_cases())):
        want = single[f"{name}/run"][case]
        assert want["per_batch"] and all(abs(v) > 1e-6 for v in want["per_batch"]), case
        for r, res in enumerate(ranks):
            got = res[f"{name}/run"][case]
            assert got["settings"]["model_parallel"] == 2
            _close(got, want, f"{name} {case} rank {r}")
            assert got["blocks"] == want["blocks"]


@pytest.mark.parametrize("name", list(MODELS))
def test_discovery_on_the_sharded_model(two, name):
    ranks, single = two
    for res in ranks:
        assert res[f"{name}/sym"] == single[f"{name}/sym"]
    # discovered inside the call: the same value as with the symmetries passed in
    for res in ranks:
        _close(res[f"{name}/discovered"], single[f"{name}/run"]["inv/worst"], name)
    assert "(BlockSpec(kind='attention.qk'" in single[f"{name}/sym"]  # GL blocks found


def test_heads_cut_by_fsdp_rows(two):
    """FSDP put rows of one head's W_Q / W_K on different ranks; the heads of the geometry are
    whole on one rank each, and the value is one process's."""
    ranks, single = two
    for r in ranks:  # 12 of W_Q's 24 rows (head 1: rows 8..15), 4 of W_K's 8 on each rank
        assert r["llama_cut/rows"] == {"q_proj": 12, "k_proj": 4, "v_proj": 4}
    for case in ONLY["llama_cut"]:
        for r in ranks:
            _close(r["llama_cut/run"][case], single["llama_cut/run"][case], case)


@pytest.mark.parametrize("name", list(MODELS))
def test_state_and_bad_input(two, name):
    ranks, _ = two
    for res in ranks:
        assert res[f"{name}/restored"] is True and res[f"{name}/grads"] is True
        assert "written in place" in res[f"{name}/written"], res[f"{name}/written"]
        faults = res[f"{name}/faults"]
        assert faults["adaptive"].startswith("ShardedModelError: a model-parallel call "
                                             "measures in the metric ball"), faults
        assert faults["batches_1d"].startswith("ShardedModelError: shard='batches' with a "
                                               "model sharded over a 1-D mesh"), faults
        assert faults["geoopt"].startswith("ShardedModelError: a model-parallel call runs "
                                           "APGD or Average"), faults


def test_bfloat16_weights_float32_state(two):
    ranks, single = two
    want = single["bf16"]
    for r in ranks:
        got = r["bf16"]
        assert got["settings"]["model_parallel"] == 2
        for key in KEYS:
            for x, y in zip(got[key], want[key], strict=True):
                assert math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6), (key, x, y)


@pytest.mark.slow
def test_data_times_model_mesh(tmp_path_factory):
    """4 ranks, mesh (data 2) x (model 2): shard="within_batch" and "batches" over the data
    dimension, the perturbation split over the model dimension."""
    ranks, single = _spawn(tmp_path_factory.mktemp("fsdp4"), 4, (2, 2), ("llama",))
    for r, res in enumerate(ranks):
        assert res["llama/restored"] is True
        for shard in ("within_batch", "batches"):
            for case, want in single["llama/run"].items():
                got = res[f"llama/{shard}"][case]
                assert got["settings"]["shard"] == shard
                assert got["settings"]["world_size"] == 2
                assert got["settings"]["model_parallel"] == 2
                _close(got, want, f"{shard} {case} rank {r}")


def test_unsharded_model_is_not_model_parallel():
    """No DTensor parameter: the seam yields nothing and the call is the plain one."""
    from quotient_manifolds.sharpness.sharded import model_parallel, sharded_parameters

    model = zoo_bert()
    assert sharded_parameters(model) == []
    with model_parallel(model) as mp:
        assert mp is None
