"""The command line refuses bad settings and inputs with one line and exit status 2.

Each check runs through the same `main(argv)` as the console script, in-process, on the tiny
attention classifier of `helpers.POP_FACTORY`. Bad flag values are refused before any checkpoint
is loaded or measured; the hypothesis tests throw generated values at the flags.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from helpers import population_states
from hypothesis import given, settings

from quotient_manifolds.cli import main
from quotient_manifolds.errors import NonFiniteWeightError
from quotient_manifolds.experiments.population import read_jsonl

SHARP = ["sharpness", "--model", "popmod:make_model", "--data", "popmod:make_data",
         "--n-iter", "2", "--no-progress"]


@pytest.fixture
def pop(tmp_path, monkeypatch):
    """`popmod.py` and three `state_dict` files `m0.pt`, `m1.pt`, `m2.pt` in the working
    folder."""
    torch.set_num_threads(1)
    for i, sd in enumerate(population_states(tmp_path, 3)):
        torch.save(sd, tmp_path / f"m{i}.pt")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("popmod", None)


def _err(capsys, argv: list[str]) -> str:
    """The one line that `main(argv)` prints on standard error, exiting with status 2."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


# -- non-finite weights ------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_non_finite_weight_names_checkpoint_and_parameter(pop, capsys, suffix):
    from safetensors.torch import save_file

    sd = torch.load(pop / "m1.pt", weights_only=True)
    sd["head.weight"][0, 0] = math.nan
    sd["attn.in_proj_bias"][:2] = math.inf
    bad = pop / f"bad{suffix}"
    if suffix == ".pt":
        torch.save(sd, bad)
    else:
        save_file({k: v.contiguous() for k, v in sd.items()}, str(bad))
    line = _err(capsys, [*SHARP, "--out", "r.jsonl", "m0.pt", bad.name])
    assert line.startswith(f"quotient-manifolds sharpness: error: checkpoint {bad.name} holds "
                           "non-finite weights:")
    assert "head.weight (1 NaN of 24 values)" in line
    assert "attn.in_proj_bias (2 Inf of 24 values)" in line
    assert "drop it from the population" in line
    assert not (pop / "r.jsonl").exists() or read_jsonl(pop / "r.jsonl") == []  # before any work


def test_non_finite_weight_error_is_a_population_input_and_non_finite_error(pop):
    from quotient_manifolds.errors import NonFiniteError, PopulationInputError
    from quotient_manifolds.experiments.population.inputs import load_checkpoint

    sd = torch.load(pop / "m0.pt", weights_only=True)
    sd["head.bias"][1] = -math.inf
    torch.save({"state_dict": sd}, pop / "wrapped.pt")
    with pytest.raises(NonFiniteWeightError, match=r"head\.bias \(1 Inf of 3 values\)") as e:
        load_checkpoint(pop / "wrapped.pt")
    assert isinstance(e.value, PopulationInputError) and isinstance(e.value, NonFiniteError)
    assert str(pop / "wrapped.pt") in str(e.value)


def test_non_finite_weight_in_a_hugging_face_folder(tmp_path, monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    cfg = transformers.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=16,
                                  max_position_embeddings=16, num_labels=3)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg)
    with torch.no_grad():
        model.classifier.weight[0, 0] = math.nan
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(tmp_path / "m0")
    transformers.utils.logging.enable_progress_bar()
    g = torch.Generator().manual_seed(0)
    save_file({"input_ids": torch.randint(0, 30, (4, 6), generator=g),
               "attention_mask": torch.ones(4, 6, dtype=torch.long),
               "labels": torch.randint(0, 3, (4,), generator=g)}, str(tmp_path / "b.safetensors"))
    monkeypatch.chdir(tmp_path)
    line = _err(capsys, ["sharpness", "--batches", "b.safetensors", "--batch-size", "2",
                         "--measures", "adaptive", "--n-iter", "2", "--no-progress", "m0"])
    assert "checkpoint m0 holds non-finite weights: classifier.weight (1 NaN of 24 values)" in line


# -- the results file --------------------------------------------------------------------------
def test_results_record_each_measures_own_kind(pop, capsys):
    code = main([*SHARP, "--measures", "adaptive,adaptive-average,geodesic-inv-full-average",
                 "--out", "r.jsonl", "m0.pt"])
    assert code == 0, capsys.readouterr().err
    kinds = {r["measure"]: r["kind"] for r in read_jsonl(pop / "r.jsonl")}
    assert kinds == {"adaptive": "worst", "adaptive-average": "average",
                     "geodesic-inv-full-average": "average"}


# -- correlate ---------------------------------------------------------------------------------
def _results(folder, values: dict[str, float]) -> None:
    """A results file of one measure at one radius, written by hand (nothing is measured)."""
    lines = [json.dumps({"checkpoint": f"{c}.pt", "path": str(folder / f"{c}.pt"), "stem": c,
                         "measure": "adaptive", "rho": 0.1, "value": v}) for c, v in values.items()]
    (folder / "res.jsonl").write_text("\n".join(lines) + "\n")


def test_correlate_counts_only_members_with_a_finite_gap(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _results(tmp_path, {f"m{i}": float(i) for i in range(6)})
    (tmp_path / "gaps.csv").write_text(
        "checkpoint,gap\nm0,0.1\nm1,0.2\nm2,nan\nm3,0.4\nm4,inf\nm5,0.6\n")
    assert main(["correlate", "res.jsonl", "gaps.csv", "--no-plots", "--n-boot", "50"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "4 checkpoints with a gap, 2 dropped: gap NaN (m2.pt), gap Inf (m4.pt)"
    assert out[2].split()[:3] == ["adaptive", "0.1", "4"]  # measure, rho, n
    blob = json.loads((tmp_path / "correlation.json").read_text())
    assert blob["n_members"] == len(blob["members"]) == blob["rows"][0]["n"] == 4
    assert blob["dropped"] == [{"checkpoint": "m2.pt", "reason": "gap NaN"},
                               {"checkpoint": "m4.pt", "reason": "gap Inf"}]
    assert blob["rows"][0]["tau"] == pytest.approx(1.0)


def test_correlate_reports_members_without_a_finite_sharpness(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _results(tmp_path, {"m0": 0.0, "m1": 1.0, "m2": math.nan, "m3": 3.0})
    (tmp_path / "gaps.csv").write_text("checkpoint,gap\nm0,0.1\nm1,0.2\nm2,0.3\nm3,0.4\n")
    assert main(["correlate", "res.jsonl", "gaps.csv", "--no-plots", "--n-boot", "50"]) == 0
    out = capsys.readouterr().out
    assert "adaptive at rho 0.1: 1 dropped (no finite sharpness)" in out


def test_correlate_with_too_few_finite_gaps_says_which_were_dropped(tmp_path, monkeypatch,
                                                                    capsys):
    monkeypatch.chdir(tmp_path)
    _results(tmp_path, {f"m{i}": float(i) for i in range(3)})
    (tmp_path / "gaps.csv").write_text("checkpoint,gap\nm0,0.1\nm1,nan\nm2,0.3\n")
    line = _err(capsys, ["correlate", "res.jsonl", "gaps.csv", "--no-plots"])
    assert "only 2 checkpoint(s) of res.jsonl have a gap in gaps.csv (1 dropped: gap NaN " \
           "(m1.pt)); τ needs at least 3 finite gaps" in line


# -- settings: refused at parse time, in one line naming the flag --------------------------------
@pytest.mark.parametrize("argv, expect", [
    (["--threads", "-1"], "argument --threads: '-1' is not a positive integer; pass 1 to 1024"),
    (["--threads", "0"], "argument --threads: '0' is not a positive integer; pass 1 to 1024"),
    (["--threads", "4096"], "argument --threads: '4096' is not a positive integer"),
    (["--seed", str(2**70)], f"argument --seed: '{2**70}' is not a seed; pass an integer from 0 "
                             f"to 2**63-1 = {2**63 - 1}"),
    (["--seed", "-1"], "argument --seed: '-1' is not a seed"),
    (["--seed", "1.5"], "argument --seed: '1.5' is not a seed"),
    (["--n-iter", "0"], "argument --n-iter: '0' is not a positive integer; pass 1 or more"),
    (["--rho", "nan"], "argument --rho: 'nan' is not a positive number"),
])
def test_bad_sharpness_settings_are_refused_before_any_work(pop, capsys, argv, expect):
    # the checkpoint does not exist: the setting is refused before it is looked for
    line = _err(capsys, [*SHARP, *argv, "--measures", "adaptive-average", "missing.pt"])
    assert line.startswith("quotient-manifolds sharpness: error: ")
    assert expect in line and "missing.pt" not in line
    assert line.endswith("; see quotient-manifolds sharpness --help")


@pytest.mark.parametrize("n_boot", ["0", "-5", "ten"])
def test_bad_n_boot_is_refused(tmp_path, monkeypatch, capsys, n_boot):
    monkeypatch.chdir(tmp_path)
    line = _err(capsys, ["correlate", "res.jsonl", "gaps.csv", "--n-boot", n_boot])
    assert line.startswith(f"quotient-manifolds correlate: error: argument --n-boot: "
                           f"'{n_boot}' is not a positive integer; pass 1 or more")


def test_library_refuses_bad_n_boot_and_seed(tmp_path):
    from quotient_manifolds.errors import InvalidArgumentError, PopulationInputError
    from quotient_manifolds.experiments.population import SEED_MAX, MeasureSettings, correlate
    from quotient_manifolds.experiments.stats import kendall_tau

    for bad in (0, -1, 2.5, True):
        with pytest.raises(InvalidArgumentError, match=rf"n_boot={bad!r} must be a positive "):
            kendall_tau([1, 2, 3, 4], [1, 3, 2, 4], n_boot=bad)
    with pytest.raises(InvalidArgumentError, match="n_boot=0"):  # before reading any file
        correlate(tmp_path / "missing.jsonl", tmp_path / "missing.csv", n_boot=0)
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4], n_boot=1)["ci95"][0] <= 1
    for bad in (-1, SEED_MAX + 1, 2**70, 1.0):
        with pytest.raises(PopulationInputError, match=r"seed=.* must be an integer from 0 to "):
            MeasureSettings(seed=bad)
    with pytest.raises(PopulationInputError, match=r"n_iter=2\.5 must be at least 1"):
        MeasureSettings(n_iter=2.5)
    assert MeasureSettings(seed=SEED_MAX).seed == SEED_MAX


def test_huge_seed_through_the_entry_point(pop):
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pop), str(root)])}
    p = subprocess.run([sys.executable, "-m", "quotient_manifolds", *SHARP, "--measures",
                        "adaptive-average", "--seed", str(2**70), "m0.pt"], cwd=pop, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "argument --seed:" in p.stderr and "Traceback" not in p.stderr


# -- generated bad values --------------------------------------------------------------------
def _int_in(text: str, lo: int, hi: float) -> bool:
    try:
        return lo <= int(text) <= hi
    except ValueError:
        return False


def _positive_float(text: str) -> bool:
    try:
        v = float(text)
    except ValueError:
        return False
    return v > 0 and math.isfinite(v)


def _bad_ints(lo: int, hi: float) -> st.SearchStrategy[str]:
    """Text that is not an integer from `lo` to `hi`: integers outside, numbers, words."""
    outside = st.integers(max_value=lo - 1)
    if hi != math.inf:
        outside = outside | st.integers(min_value=int(hi) + 1)
    other = st.text(max_size=8) | st.floats().map(repr)
    return outside.map(str) | other.filter(lambda t: not _int_in(t, lo, hi))


_BAD = {
    "--threads": _bad_ints(1, 1024),
    "--seed": _bad_ints(0, 2**63 - 1),
    "--n-iter": _bad_ints(1, math.inf),
    "--batch-size": _bad_ints(1, math.inf),
    "--rho": (st.floats(max_value=0.0) | st.sampled_from([math.nan, math.inf])).map(repr)
    | st.text(max_size=8).filter(lambda t: not _positive_float(t)),
}


def _parse_error(argv: list[str]) -> str:
    """The standard error of `main(argv)`, which must exit with status 2 while parsing."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2, err.getvalue()
    return err.getvalue()


@settings(max_examples=25)
@given(flag=st.sampled_from(sorted(_BAD)), data=st.data())
def test_generated_bad_sharpness_flags_are_one_line_naming_the_flag(flag, data):
    value = data.draw(_BAD[flag], label="value")
    # no such checkpoint and no such factory: only the parser may answer
    err = _parse_error(["sharpness", "--data", "nomod:nofn", "--no-progress", f"{flag}={value}",
                        "missing.pt"])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"quotient-manifolds sharpness: error: argument {flag}: ")


@settings(max_examples=15)
@given(value=_bad_ints(1, math.inf))
def test_generated_bad_n_boot_is_one_line_naming_the_flag(value):
    err = _parse_error(["correlate", "missing.jsonl", "missing.csv", f"--n-boot={value}"])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("quotient-manifolds correlate: error: argument --n-boot: ")
    assert "pass 1 or more" in lines[0]


@settings(max_examples=25)
@given(seed=st.integers() | st.floats(allow_nan=True) | st.booleans())
def test_measure_settings_accept_exactly_the_generator_seeds(seed):
    from quotient_manifolds.errors import PopulationInputError
    from quotient_manifolds.experiments.population import MeasureSettings

    ok = isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= 2**63 - 1
    if ok:
        assert MeasureSettings(measures=("adaptive",), seed=seed).seed == seed
    else:
        with pytest.raises(PopulationInputError, match="seed="):
            MeasureSettings(measures=("adaptive",), seed=seed)


# -- --out: checked before any work ------------------------------------------------------------
_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0  # root writes to read-only folders
_SYS = Path("/sys")  # sysfs: no file can be created there, not even by root


@pytest.fixture
def marked(pop):
    """`marker:make_data`, popmod's data, leaving `data-called` behind when it is called."""
    (pop / "marker.py").write_text(
        "import pathlib, popmod\n"
        "def make_data():\n"
        "    pathlib.Path('data-called').touch()\n"
        "    return popmod.make_data()\n")
    yield pop
    sys.modules.pop("marker", None)


def _out_err(capsys, folder, out: str) -> str:
    line = _err(capsys, [*SHARP[:4], "marker:make_data", *SHARP[5:], "--measures", "adaptive",
                         "--out", out, "m0.pt", "m1.pt"])
    assert not (folder / "data-called").exists()  # refused before any measurement
    return line


def test_out_in_place_of_a_folder_is_a_file(marked, capsys):
    (marked / "afile").write_text("x")
    line = _out_err(capsys, marked, "afile/r.jsonl")
    assert line == ("quotient-manifolds sharpness: error: --out afile/r.jsonl: afile is a file, "
                    "not a folder; pass a path in a folder you can write to")


def test_out_is_a_folder(marked, capsys):
    (marked / "adir").mkdir()
    assert "error: --out adir is a folder; pass a file name, e.g. adir/results.jsonl" in \
        _out_err(capsys, marked, "adir")


@pytest.mark.skipif(not (_SYS / "kernel").is_dir(), reason="needs Linux sysfs")
def test_out_in_a_folder_where_no_file_can_be_created(marked, capsys):
    line = _out_err(capsys, marked, str(_SYS / "r.jsonl"))
    assert "error: --out /sys/r.jsonl: no file can be created in folder /sys (" in line
    assert line.endswith("); pass a path in a folder you can write to")


@pytest.mark.skipif(_ROOT, reason="root writes to read-only folders and files")
def test_out_read_only_folder_and_file(marked, capsys):
    ro = marked / "ro"
    ro.mkdir()
    (ro / "old.jsonl").write_text("")
    (marked / "rofile.jsonl").write_text("")
    (marked / "rofile.jsonl").chmod(0o444)
    ro.chmod(0o555)
    try:
        line = _out_err(capsys, marked, "ro/r.jsonl")
        assert "--out ro/r.jsonl: no file can be created in folder ro (Permission denied)" in line
        line = _out_err(capsys, marked, "rofile.jsonl")
        assert "--out rofile.jsonl cannot be written (Permission denied)" in line
    finally:
        ro.chmod(0o755)


def test_correlate_out_is_checked_before_the_inputs_are_read(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _results(tmp_path, {f"m{i}": float(i) for i in range(3)})
    (tmp_path / "afile").write_text("x")
    # the gaps file does not exist: --out is refused first
    base = ["correlate", "res.jsonl", "missing.csv", "--no-plots", "--out"]
    assert _err(capsys, [*base, "afile"]) == \
        "quotient-manifolds correlate: error: --out afile is a file; pass a folder"
    assert _err(capsys, [*base, "afile/figs/x"]) == (
        "quotient-manifolds correlate: error: --out afile/figs/x cannot be created: afile is a "
        "file, not a folder; pass another folder")
    if (_SYS / "kernel").is_dir():
        line = _err(capsys, [*base, "/sys/qm-figs"])
        assert "--out /sys/qm-figs cannot be created in /sys (" in line
    # a folder that does not exist yet is fine: it is made when the table is written
    (tmp_path / "gaps.csv").write_text("checkpoint,gap\nm0,0.1\nm1,0.2\nm2,0.3\n")
    assert main(["correlate", "res.jsonl", "gaps.csv", "--no-plots", "--n-boot", "20", "--out",
                 "new/figs"]) == 0
    assert (tmp_path / "new" / "figs" / "correlation.json").is_file()
