"""The command line refuses bad settings and inputs with one line and exit status 2.

Each check runs through the same `main(argv)` as the console script, in-process, on the tiny
attention classifier of `helpers.POP_FACTORY`. Bad flag values are refused before any checkpoint
is loaded or measured; the hypothesis tests throw generated values at the flags.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from helpers import population_states

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
