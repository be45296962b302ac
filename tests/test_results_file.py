"""The JSON-lines results file shared by several writers (`ResultsFile`)."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from quotient_manifolds.errors import PopulationInputError
from quotient_manifolds.experiments.population import ResultsFile, read_jsonl


def _writer(path: str, tag: str, n: int) -> None:
    rf = ResultsFile(path)
    for i in range(n):
        rf.append({"key": f"{tag}{i}", "pad": "x" * (i * 37 % 5000)})


def test_concurrent_writers_never_interleave(tmp_path):
    path = tmp_path / "r.jsonl"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(path), t, 150)) for t in "abc"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    raw = path.read_bytes()
    lines = [json.loads(line) for line in raw.decode().splitlines()]  # every line is whole
    assert raw.endswith(b"\n") and len(lines) == 450
    assert sorted(r["key"] for r in lines) == sorted(f"{t}{i}" for t in "abc" for i in range(150))
    for t in "abc":  # each writer's lines keep their order
        mine = [int(r["key"][1:]) for r in lines if r["key"][0] == t]
        assert mine == list(range(150))


def test_a_key_is_written_once_and_a_torn_tail_is_cut(tmp_path):
    path = tmp_path / "r.jsonl"
    a, b = ResultsFile(path), ResultsFile(path)
    assert b.refresh() == []  # b's view is now stale
    assert a.append({"key": "k1", "value": 1.0}) is True
    assert b.append({"key": "k1", "value": 2.0}) is False  # written by a meanwhile
    assert b.append({"key": "k1", "value": 2.0}, once=False) is True
    with path.open("ab") as f:
        f.write(b'{"key": "k2", "val')  # a writer killed inside write()
    assert [r["value"] for r in read_jsonl(path)] == [1.0, 2.0]  # the torn tail is ignored
    assert a.append({"key": "k3", "value": 3.0}) is True  # ... and cut by the next writer
    assert [r["key"] for r in read_jsonl(path)] == ["k1", "k1", "k3"]
    assert b'"k2"' not in path.read_bytes()
    assert b.refresh()[-1] == {"key": "k3", "value": 3.0} and b.keys == {"k1", "k3"}


def test_malformed_line_is_named(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"key": "a"}\n\n[1, 2]\n')
    with pytest.raises(PopulationInputError, match=r"r.jsonl line 3 is not a JSON object"):
        ResultsFile(path).refresh()
