"""Data-parallel sharpness: 2 gloo processes on localhost against a single process.

One spawn runs every distributed case (spawning costs seconds of imports); the parent
compares each rank's result with the single-process one.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys

import pytest
import torch

import quotient_manifolds as qm
from quotient_manifolds.sharpness.distributed import default_split, resolve_shard

sys.path.insert(0, os.path.dirname(__file__))
from model_zoo import MHANet, ce_loss, mha_data  # noqa: E402

WORLD = 2
N_ITER = 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return MHANet().double().eval()


def _data(n_batches: int = 3, bs: int = 5) -> list:
    return [(x.double(), y) for x, y in mha_data(n_batches=n_batches, bs=bs)]


def _cases() -> dict[str, tuple]:
    """name -> (function, data, keyword arguments); the shard mode is added per run."""
    return {
        "geo_worst": (qm.geodesic_sharpness, _data(), dict(rho=0.2, metric="inv")),
        "geo_mix": (qm.geodesic_sharpness, _data(), dict(rho=0.2, metric="mix")),
        "geo_average": (qm.geodesic_sharpness, _data(), dict(rho=0.2,
                                                             solver=qm.Average(seed=3))),
        "ada_worst": (qm.adaptive_sharpness, _data(), dict(rho=0.2)),
        "one_example": (qm.geodesic_sharpness, _data(n_batches=1, bs=1), dict(rho=0.2)),
    }


def _run_all(shards: tuple[str, ...]) -> dict[str, dict]:
    model = _model()
    out = {}
    for name, (fn, data, kw) in _cases().items():
        for shard in shards:
            if name == "one_example" and shard == "batches":
                continue
            r = fn(model, ce_loss, data, n_iter=N_ITER, shard=shard, **kw)
            out[f"{name}/{shard}"] = r.to_dict()
    return out


def _worker(rank: int, port: int, outdir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        model = _model()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        res = _run_all(("batches", "within_batch"))
        # default: no sharding (no collective) even when a group of 2 is up
        res["default"] = qm.geodesic_sharpness(model, ce_loss, _data(), rho=0.2,
                                               n_iter=N_ITER).to_dict()
        # _run_all builds its own model; check restoration on a model used here too
        qm.geodesic_sharpness(model, ce_loss, _data(), rho=0.2, n_iter=N_ITER,
                              shard="within_batch")
        after = model.state_dict()
        res["restored"] = all(torch.equal(before[k], after[k]) for k in before)
        # ranks holding different weights are refused on every rank (one logit's bias moved:
        # not a symmetry; all of them would be the softmax shift, which the measure quotients)
        other = _model()
        with torch.no_grad():
            other.head.bias[0] += float(rank)
        try:
            qm.geodesic_sharpness(other, ce_loss, _data(), rho=0.2, n_iter=1, shard="batches")
            res["mismatch"] = "no error"
        except qm.DistributedError as e:
            res["mismatch"] = str(e)
        res.update(_failures(rank))
        torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
        return ("no error", "")
    except Exception as e:  # noqa: BLE001 - the test compares the type and message
        return (type(e).__name__, str(e))


_FAULTS = ("different_data", "nan_batch", "loss_fails_within", "loss_fails_batches")


def _failures(rank: int) -> dict:
    """Faults on one rank, which every rank must name instead of hanging or a gloo error."""
    model = _model()
    own = [(x.double(), y) for x, y in mha_data(n_batches=3, bs=5, seed=rank)]
    nan = _data()
    if rank == 1:  # batch 1 is rank 1's under shard="batches"
        nan[1] = (nan[1][0] * float("nan"), nan[1][1])

    def fails_on_rank1(m, b):
        if rank == 1 and torch.is_grad_enabled():  # the perturbed losses only
            raise ValueError("boom")
        return ce_loss(m, b)

    def run(data, loss=ce_loss, shard="batches"):
        return lambda: qm.geodesic_sharpness(model, loss, data, rho=0.2, n_iter=2, shard=shard)

    return {
        "different_data": _outcome(run(own)),
        "nan_batch": _outcome(run(nan)),
        "loss_fails_within": _outcome(run(_data(), fails_on_rank1, "within_batch")),
        "loss_fails_batches": _outcome(run(_data(), fails_on_rank1)),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    import torch.multiprocessing as mp

    outdir = str(tmp_path_factory.mktemp("dist"))
    mp.start_processes(_worker, args=(_free_port(), outdir), nprocs=WORLD, join=True,
                       start_method="spawn")
    return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)
            for r in range(WORLD)]


@pytest.fixture(scope="module")
def single() -> dict[str, dict]:
    torch.set_num_threads(1)
    return _run_all(("none",))


def _strip(d: dict) -> str:
    """Everything but settings and wall time, as canonical JSON (NaN compares equal)."""
    return json.dumps({k: v for k, v in d.items() if k not in ("settings", "elapsed_s")},
                      sort_keys=True)


def test_every_rank_returns_the_same_result(ranks):
    a, b = ranks
    assert a.keys() == b.keys()
    for k in a:
        if k in _FAULTS:  # each rank names its own fault (test_a_fault_on_one_rank_...)
            continue
        if k == "default":  # computed alone on each rank: its wall time is the rank's own
            assert _strip(a[k]) == _strip(b[k])
            continue
        assert json.dumps(a[k], sort_keys=True) == json.dumps(b[k], sort_keys=True), k


def test_batches_equal_single_process(ranks, single):
    for name in ("geo_worst", "geo_mix", "geo_average", "ada_worst"):
        got, want = ranks[0][f"{name}/batches"], single[f"{name}/none"]
        assert got["settings"]["shard"] == "batches" and got["settings"]["world_size"] == WORLD
        assert _strip(got) == _strip(want), name  # bit-identical per-batch values
    assert "shard" not in ranks[0]["default"]["settings"]  # ran alone on every rank
    assert ranks[0]["default"]["per_batch"] == single["geo_worst/none"]["per_batch"]


def test_within_batch_equals_single_process(ranks, single):
    for name in ("geo_worst", "geo_mix", "geo_average", "ada_worst", "one_example"):
        got, want = ranks[0][f"{name}/within_batch"], single[f"{name}/none"]
        assert got["settings"]["shard"] == "within_batch"
        assert got["n_evals"] == want["n_evals"]
        for key in ("per_batch", "base_loss", "max_loss", "perturbation_norm"):
            for x, y in zip(got[key], want[key], strict=True):
                same = (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-9,
                                                                          abs_tol=1e-12)
                assert same, (name, key, x, y)


def test_parameters_restored_and_mismatch_refused(ranks):
    for r in ranks:
        assert r["restored"] is True
        assert "different model" in r["mismatch"], r["mismatch"]


def test_without_a_group_every_mode_is_single_process():
    torch.set_num_threads(1)
    model, data = _model(), _data(n_batches=1)
    a = qm.geodesic_sharpness(model, ce_loss, data, rho=0.2, n_iter=2)
    b = qm.geodesic_sharpness(model, ce_loss, data, rho=0.2, n_iter=2, shard="within_batch")
    assert a.per_batch == b.per_batch and "shard" not in b.settings
    with pytest.raises(ValueError, match="shard must be one of"):
        resolve_shard("rows")
    with pytest.raises(ValueError, match="split_batch is only used"):
        resolve_shard("batches", split_batch=default_split)


def test_default_split_cuts_every_tensor_along_dim0():
    batch = {"x": torch.arange(10).view(5, 2), "y": torch.arange(5), "t": torch.tensor(1.0),
             "name": "b", "pair": (torch.zeros(5), [torch.ones(5, 3)])}
    parts = [default_split(batch, r, 2) for r in range(2)]
    assert [n for _, n in parts] == [3, 2]
    assert torch.equal(torch.cat([p["x"] for p, _ in parts]), batch["x"])
    assert parts[1][0]["pair"][1][0].shape == (2, 3) and parts[1][0]["name"] == "b"
    assert parts[0][0]["t"] is batch["t"]
    with pytest.raises(qm.DistributedError, match="split_batch"):
        default_split({"a": 1}, 0, 2)


def test_a_fault_on_one_rank_is_named_on_every_rank(ranks):
    r0, r1 = ranks
    assert r0["different_data"][0] == r1["different_data"][0] == "DistributedError"
    assert "different data" in r0["different_data"][1]
    assert r1["nan_batch"][0] == "NonFiniteError" and "batch 1" in r1["nan_batch"][1]
    assert r0["nan_batch"][0] == "DistributedError" and "rank 1" in r0["nan_batch"][1]
    for case in ("loss_fails_within", "loss_fails_batches"):
        assert r1[case][0] == "LossEvaluationError" and "boom" in r1[case][1], case
        assert r0[case][0] == "DistributedError" and "1" in r0[case][1], case
