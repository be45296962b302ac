"""``quotient-manifolds sharpness`` / ``correlate`` driven as a user would.

The end-to-end runs go through ``subprocess`` (``python -m quotient_manifolds ...``) with a
tiny attention classifier and its data in a module written to ``tmp_path``. Each subprocess
pays about 4 s for importing torch, so the full matrix of one-line input errors runs through
the same ``main(argv)`` the console script calls, in-process; two of them also run through
``subprocess`` to check the exit status and the absence of a traceback on the real entry point.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import jsonl_lines, population_states
from scipy.stats import kendalltau

import quotient_manifolds as qm
from quotient_manifolds.cli import main
from quotient_manifolds.experiments.population import read_jsonl

N_CKPT = 5
ROOT = Path(__file__).resolve().parents[1]


class Evil:
    """Pickled inside a checkpoint: loading it would need unsafe unpickling."""


@pytest.fixture
def pop(tmp_path):
    """A folder with the factory module and ``N_CKPT`` checkpoints (safetensors and torch)."""
    from safetensors.torch import save_file

    ckpts = []
    for i, sd in enumerate(population_states(tmp_path, N_CKPT)):
        if i % 2:
            p = tmp_path / f"m{i}.pt"
            torch.save(sd, p)
        else:
            p = tmp_path / f"m{i}.safetensors"
            save_file({k: v.contiguous() for k, v in sd.items()}, str(p))
        ckpts.append(p.name)
    return tmp_path, ckpts


def _default_sigint() -> None:
    # a test run started in the background of a shell inherits SIGINT ignored, and so would the
    # CLI (Python installs its Ctrl-C handler only where SIGINT is not ignored)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(cwd, *args, env=None, **kw):
    # the factory module's folder, then this checkout (not another install of the package)
    e = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), str(ROOT)]), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "quotient_manifolds", *args], cwd=cwd,
                            env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint, **kw)


def _run(cwd, *args, env=None, timeout=120):
    p = _cli(cwd, *args, env=env)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


SHARP = ["sharpness", "--model", "popmod:make_model", "--data", "popmod:make_data",
         "--n-iter", "3", "--rho", "0.2", "--threads", "1", "--no-progress"]


def test_interrupt_resume_and_correlate(pop):
    d, ckpts = pop
    out = d / "results.jsonl"
    # 1. Ctrl-C in the middle: finished lines stay, the process says how to resume
    p = _cli(d, *SHARP, "--measures", "geodesic-inv-full", "--out", "results.jsonl", *ckpts,
             env={"POP_SLOW": "0.4"})
    t0 = time.time()
    while (not out.exists() or not out.read_bytes().count(b"\n")) and time.time() - t0 < 90:
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "run the same command again to resume" in err and "Traceback" not in err
    first = jsonl_lines(out)
    assert 1 <= len(first) < N_CKPT

    # 2. a torn trailing line (the writer died inside write) is cut off on the next run,
    #    which computes only what is missing, for a larger set of measures
    with out.open("ab") as f:
        f.write(b'{"checkpoint": "m9.pt", "val')
    code, stdout, err = _run(d, *SHARP, "--measures", "geodesic-inv-full,adaptive", "--out",
                             "results.jsonl", *ckpts)
    assert code == 0, err
    assert f"{len(first)} result(s) already there, skipped" in err
    lines = jsonl_lines(out)
    assert lines[: len(first)] == first  # finished results are not rewritten
    assert len(lines) == 2 * N_CKPT
    assert len({r["key"] for r in lines}) == 2 * N_CKPT
    assert {(r["checkpoint"], r["measure"]) for r in lines} == {
        (c, m) for c in ckpts for m in ("geodesic-inv-full", "adaptive")}
    for r in lines:
        assert r["rho"] == 0.2 and r["n_iter"] == 3 and r["n_batches"] == 2
        assert math.isfinite(r["value"]) and r["value"] >= 0
        assert r["value"] == pytest.approx(sum(r["per_batch"]) / 2)
        assert r["n_blocks"] == (2 if r["measure"] == "geodesic-inv-full" else 0)  # QK and VO specs

    # 3. correlate against gaps built from the measured values: the CLI's τ must be the one
    #    scipy gives on the same pairs; gaps name checkpoints by stem and by path
    geo = {r["checkpoint"]: r["value"] for r in lines if r["measure"] == "geodesic-inv-full"}
    ada = {r["checkpoint"]: r["value"] for r in lines if r["measure"] == "adaptive"}
    gap = {c: -geo[c] for c in ckpts}  # perfectly anti-ordered with geodesic-inv
    rows = ["checkpoint,gap"] + [f"{c if i % 2 else c.rsplit('.', 1)[0]},{gap[c]!r}"
                                 for i, c in enumerate(ckpts)]
    (d / "gaps.csv").write_text("\n".join(rows) + "\n")
    code, stdout, err = _run(d, "correlate", "results.jsonl", "gaps.csv", "--out", "corr",
                             "--n-boot", "200")
    assert code == 0, err
    blob = json.loads((d / "corr" / "correlation.json").read_text())
    by = {r["measure"]: r for r in blob["rows"]}
    assert by["geodesic-inv-full"]["tau"] == pytest.approx(-1.0)
    want = kendalltau([ada[c] for c in ckpts], [gap[c] for c in ckpts]).statistic
    assert by["adaptive"]["tau"] == pytest.approx(want)
    lo, hi = by["adaptive"]["ci95"]
    assert lo - 1e-9 <= by["adaptive"]["tau"] <= hi + 1e-9
    assert blob["n_members"] == N_CKPT and blob["unmatched"] == []
    assert "geodesic-inv-full" in stdout and f"{by['adaptive']['tau']:.3f}" in stdout
    for m in ("geodesic-inv-full", "adaptive"):
        png = d / "corr" / f"scatter_{m}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kill_leaves_valid_jsonl(pop):
    d, ckpts = pop
    out = d / "r.jsonl"
    p = _cli(d, *SHARP, "--measures", "adaptive", "--out", "r.jsonl", *ckpts,
             env={"POP_SLOW": "0.4"})
    t0 = time.time()
    while (not out.exists() or out.read_bytes().count(b"\n") < 2) and time.time() - t0 < 90:
        time.sleep(0.02)
    p.kill()  # a crash: no handler runs
    p.communicate(timeout=30)
    lines = jsonl_lines(out)
    assert 2 <= len(lines) < N_CKPT
    assert all(r["measure"] == "adaptive" and math.isfinite(r["value"]) for r in lines)


def test_bad_input_through_the_entry_point(pop):
    d, ckpts = pop
    code, _, err = _run(d, *SHARP[:2], "popmod:other_model", *SHARP[3:], "--out", "r.jsonl",
                        ckpts[0])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "does not fit the model" in err and "missing keys weight, bias" in err
    assert "unexpected keys attn." in err and "(+" in err
    assert not (d / "r.jsonl").exists() or (d / "r.jsonl").read_text() == ""


# -- every input error, in-process (same main() as the console script) ------------------------
@pytest.fixture
def inproc(pop, monkeypatch):
    d, ckpts = pop
    monkeypatch.chdir(d)
    monkeypatch.syspath_prepend(str(d))
    yield d, ckpts
    sys.modules.pop("popmod", None)


def _err(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize("factory, expect", [
    ("nosuchmod:make_model", "cannot import module 'nosuchmod'; run from the folder"),
    ("popmod:nope", "module popmod has no attribute 'nope' (callables there:"),
    ("popmod", "is not of the form module:function"),
    ("nofile.py:make_model", "file nofile.py does not exist"),
])
def test_factory_errors(inproc, capsys, factory, expect):
    _, ckpts = inproc
    line = _err(capsys, ["sharpness", "--model", factory, "--data", "popmod:make_data",
                         "--no-progress", ckpts[0]])
    assert expect in line


def test_factory_by_file_path_and_custom_loss(inproc, capsys):
    d, ckpts = inproc
    code = main(["sharpness", "--model", f"{d / 'popmod.py'}:make_model", "--data",
                 "popmod:make_data", "--loss", "popmod:mse_loss", "--measures", "geodesic-mix-full",
                 "--n-iter", "2", "--no-progress", "--out", "f.jsonl", "--dtype", "float64",
                 *ckpts[:2]])
    assert code == 0, capsys.readouterr().err
    recs = read_jsonl(d / "f.jsonl")
    assert [r["loss"] for r in recs] == ["popmod:mse_loss"] * 2
    assert all(r["dtype"] == "float64" and r["value"] >= 0 for r in recs)


def test_checkpoint_errors(inproc, capsys):
    d, ckpts = inproc
    assert _err(capsys, [*SHARP, ckpts[0], "missing.pt"]) == (
        "quotient-manifolds sharpness: error: checkpoint missing.pt does not exist; check the "
        "path")

    torch.save({"w": Evil()}, d / "evil.pt")
    (d / "junk.safetensors").write_bytes(b"not a safetensors file")
    torch.save([torch.zeros(2)], d / "list.pt")
    base = ["sharpness", "--model", "popmod:make_model", "--data", "popmod:make_data",
            "--no-progress"]
    line = _err(capsys, [*base, "evil.pt"])
    assert "cannot be read with torch.load(weights_only=True)" in line
    assert "torch.save(model.state_dict(), path)" in line
    line = _err(capsys, [*base, "junk.safetensors"])
    assert "not a readable safetensors file" in line and "save_file" in line
    line = _err(capsys, [*base, "list.pt"])
    assert "holds a list, not a state_dict" in line
    sd = torch.load(d / ckpts[1], weights_only=True)
    sd["head.weight"] = torch.zeros(4, 8)
    torch.save(sd, d / "shape.pt")
    line = _err(capsys, [*base, "shape.pt"])
    assert "shape mismatch head.weight (4, 8) vs (3, 8)" in line


def test_other_input_errors(inproc, capsys):
    d, ckpts = inproc
    base = ["sharpness", "--model", "popmod:make_model", "--data", "popmod:make_data",
            "--no-progress"]
    (d / "dict_data.py").write_text("import torch\n"
                                    "def make():\n    return [{'x': torch.zeros(1)}]\n"
                                    "def boom():\n    raise RuntimeError('no data here')\n")
    line = _err(capsys, [*base[:4], "dict_data:make", *base[5:], ckpts[0]])
    assert "a dict batch without 'labels' has no default loss" in line and "--loss" in line
    line = _err(capsys, [*base[:4], "dict_data:boom", *base[5:], ckpts[0]])
    assert "raised RuntimeError: no data here" in line
    (d / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    line = _err(capsys, [*base, "--out", "bad.jsonl", ckpts[0]])
    assert "bad.jsonl line 2 is not a JSON object; delete that line" in line
    with pytest.raises(SystemExit) as e:  # argparse: exit status 2 as well
        main([*base, "--measures", "adaptive,sam", ckpts[0]])
    assert e.value.code == 2 and "unknown measure(s) sam" in capsys.readouterr().err


def test_library_errors_name_parameters_and_the_command_line_its_flags(inproc, capsys):
    """The library's messages speak its parameter names; the command line prints its flags."""
    from quotient_manifolds.errors import PopulationInputError
    from quotient_manifolds.experiments.population import (
        MeasureSettings,
        default_loss,
        evaluate_population,
    )

    _, ckpts = inproc
    with pytest.raises(PopulationInputError, match=r"rho=-1 must be a positive number, e\.g\. rho"):
        MeasureSettings(rho=-1)
    with pytest.raises(PopulationInputError, match="n_iter=0 must be at least 1"):
        MeasureSettings(n_iter=0)
    with pytest.raises(PopulationInputError) as e:
        evaluate_population(ckpts[:1], out="r.jsonl", data="popmod:make_data", model="popmod")
    assert str(e.value).startswith("model='popmod' is not of the form module:function")
    with pytest.raises(PopulationInputError) as e:
        default_loss(torch.nn.Identity(), {"x": torch.zeros(1)})
    assert "pass loss=module:function" in str(e.value)
    with pytest.raises(PopulationInputError) as e:
        evaluate_population(ckpts[:1], out="nowhere/r.jsonl", data="popmod:make_data",
                            model="popmod:make_model")
    assert str(e.value).startswith("out=nowhere/r.jsonl: folder nowhere does not exist")
    line = _err(capsys, ["sharpness", "--model", "popmod", "--data", "popmod:make_data",
                         ckpts[0]])
    assert "error: --model 'popmod' is not of the form module:function; pass e.g. --model " in line
    line = _err(capsys, ["sharpness", "--model", "popmod:make_model", "--data",
                         "popmod:make_data", "--out", "nowhere/r.jsonl", ckpts[0]])
    assert "error: --out nowhere/r.jsonl: folder nowhere does not exist" in line


def test_folder_and_results_file_errors_keep_their_command_line_wording(inproc, capsys):
    d, _ = inproc
    (d / "afolder").mkdir()
    assert _err(capsys, [*SHARP, "afolder"]) == (
        "quotient-manifolds sharpness: error: checkpoint afolder is a folder; with --model pass "
        "state_dict files, or drop --model to load Hugging Face checkpoint folders")
    (d / "gaps.csv").write_text("checkpoint,gap\nm0,1\n")
    assert _err(capsys, ["correlate", "missing.jsonl", "gaps.csv", "--no-plots"]) == (
        "quotient-manifolds correlate: error: results file missing.jsonl does not exist; run "
        "'quotient-manifolds sharpness ... --out FILE' first")
    (d / "empty.jsonl").write_text("")
    assert _err(capsys, ["correlate", "empty.jsonl", "gaps.csv", "--no-plots"]) == (
        "quotient-manifolds correlate: error: results file empty.jsonl has no sharpness line; "
        "run 'quotient-manifolds sharpness' first")


@pytest.mark.parametrize("text, expect", [
    ("name,value\nm0,1\n", "has columns name, value; the file needs a header line"),
    ("checkpoint,gap\nm0,abc\n", "line 2: gap 'abc' is not a number"),
    ("checkpoint,gap\nm0,1\nm0,2\n", "line 3: checkpoint 'm0' appears twice"),
    ("checkpoint,gap\nm0\n", "line 2 has 1 column(s)"),
    ("", "is empty"),
    ("checkpoint,gap\nzz,1\nyy,2\nxx,3\n", "only 0 checkpoint(s)"),
])
def test_malformed_gaps(inproc, capsys, text, expect):
    d, _ = inproc
    rec = {"checkpoint": "m0.safetensors", "path": str(d / "m0.safetensors"), "stem": "m0",
           "measure": "adaptive", "rho": 0.1, "value": 1.0}
    (d / "res.jsonl").write_text(json.dumps(rec) + "\n")
    (d / "gaps.csv").write_text(text)
    line = _err(capsys, ["correlate", "res.jsonl", "gaps.csv", "--no-plots"])
    assert line.startswith("quotient-manifolds correlate: error: gaps file gaps.csv" if
                           "only" not in expect else "quotient-manifolds correlate: error: only")
    assert expect in line
    assert "missing.csv does not exist" in _err(capsys, ["correlate", "res.jsonl",
                                                         "missing.csv"])


def test_default_measures_are_the_complete_group_and_documented():
    """The default measures quotient out every recognised symmetry (the library default, that of
    `Geometry()`), in both metrics; the command synopsis in docs/cli.md shows them."""
    from quotient_manifolds.experiments.population import DEFAULT_MEASURES as MEASURES
    from quotient_manifolds.sharpness.measures import measure

    assert qm.Geometry().symmetry == "complete"
    geodesic = [measure(n).geometry for n in MEASURES if n != "adaptive"]
    assert {g.metric for g in geodesic} == {"inv", "mix"}
    assert all(g.symmetry == qm.Geometry().symmetry for g in geodesic)
    cli_md = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    assert f"[--measures {','.join(MEASURES)}]" in cli_md
