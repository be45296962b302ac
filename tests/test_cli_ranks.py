"""`quotient-manifolds sharpness` under `torchrun`: 2 CPU ranks against one process.

The ranks split the (checkpoint, measure) pairs and append to one results file under a file
lock. Checked: the lines equal a single-process run's line for line, keyed by (checkpoint,
measure), with no duplicate or missing key; killing one rank loses no finished line, and a
re-run completes the file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import jsonl_lines, population_states

from quotient_manifolds.cli import main
from quotient_manifolds.experiments.population import assigned_pairs

N_CKPT = 6
MEASURES = ("adaptive", "geodesic-inv-full")
SHARP = ["sharpness", "--model", "popmod:make_model", "--data", "popmod:make_data",
         "--n-iter", "2", "--rho", "0.2", "--measures", ",".join(MEASURES), "--no-progress"]
INFO = ("elapsed_s", "rank", "world_size")  # what may differ between the runs


@pytest.fixture(scope="module")
def pop(tmp_path_factory):
    d = tmp_path_factory.mktemp("ranks")
    ckpts = []
    for i, sd in enumerate(population_states(d, N_CKPT)):
        torch.save(sd, d / f"m{i}.pt")
        ckpts.append(f"m{i}.pt")
    return d, ckpts


@pytest.fixture(scope="module")
def single(pop):
    """The single-process reference, through the same entry point."""
    d, ckpts = pop
    cwd = os.getcwd()
    os.chdir(d)
    sys.path.insert(0, str(d))
    try:
        assert main([*SHARP, "--out", "single.jsonl", *ckpts]) == 0
    finally:
        os.chdir(cwd)
        sys.path.remove(str(d))
        sys.modules.pop("popmod", None)
    return jsonl_lines(d / "single.jsonl")


def _torchrun(d, out, ckpts, env=None):
    e = {**os.environ, "PYTHONPATH": os.pathsep.join([str(d), os.getcwd()]), **(env or {})}
    e.pop("RANK", None), e.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "quotient_manifolds", *SHARP, "--out", out, *ckpts]
    return subprocess.Popen(cmd, cwd=d, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _by_pair(lines):
    out = {}
    for r in lines:
        pair = (r["checkpoint"], r["measure"])
        assert pair not in out, f"duplicate line for {pair}"
        out[pair] = {k: v for k, v in r.items() if k not in INFO}
    return out


def test_assignment_covers_every_pair_once():
    for n in range(1, 7):
        for m in range(1, 4):
            for w in range(1, 6):
                got = [p for r in range(w) for p in assigned_pairs(n, m, r, w)]
                assert sorted(got) == [(i, j) for i in range(n) for j in range(m)], (n, m, w)
                if n >= w:  # whole checkpoints per rank
                    for r in range(w):
                        assert {i for i, _ in assigned_pairs(n, m, r, w)} == set(
                            range(r, n, w))


def test_two_ranks_match_one_process(pop, single):
    d, ckpts = pop
    p = _torchrun(d, "ranks.jsonl", ckpts)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert "rank 0/2: " in out and "rank 1/2: " in out
    lines = jsonl_lines(d / "ranks.jsonl")
    assert len(lines) == N_CKPT * len(MEASURES)
    assert {r["rank"] for r in lines} == {0, 1} and {r["world_size"] for r in lines} == {2}
    for r in lines:  # checkpoint i on rank i mod 2
        assert r["rank"] == int(r["checkpoint"][1]) % 2
    assert _by_pair(lines) == _by_pair(single)  # values, per-batch values, keys: identical


@pytest.mark.slow
def test_killing_a_rank_loses_no_finished_line(pop, single, tmp_path):
    d, ckpts = pop
    out = d / "killed.jsonl"
    p = _torchrun(d, "killed.jsonl", ckpts, env={"POP_SLOW": "0.5", "POP_PIDS": str(tmp_path)})
    t0 = time.time()
    while (not out.exists() or out.read_bytes().count(b"\n") < 3) and time.time() - t0 < 120:
        assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.05)
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)  # rank 1 dies, no handler
    p.communicate(timeout=120)
    assert p.returncode != 0  # torchrun reports the failure and stops rank 0
    first = jsonl_lines(out)
    assert 3 <= len(first) < N_CKPT * len(MEASURES)
    want = _by_pair(single)
    assert all(want[k] == v for k, v in _by_pair(first).items())  # finished lines are intact
    # the re-run computes only the missing pairs and completes the file
    p = _torchrun(d, "killed.jsonl", ckpts)
    stdout, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    assert "already there, skipped" in err
    lines = jsonl_lines(out)
    assert lines[: len(first)] == first
    assert _by_pair(lines) == want
