"""`quotient-manifolds sharpness` on Hugging Face checkpoint folders and a batches file.

Three tiny BERT classifiers saved with `save_pretrained` (weights redrawn at a larger scale
than HF's 0.02 init, so that attention is not uniform) and one safetensors file of batches are
measured with one command, through the same `main(argv)` as the console script; the values
must be those of the measure table called directly on the models loaded by hand.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from scipy.stats import kendalltau

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from quotient_manifolds.cli import main  # noqa: E402
from quotient_manifolds.experiments.hf_checkpoints import load_batches, logits_loss  # noqa: E402
from quotient_manifolds.experiments.population import read_jsonl  # noqa: E402
from quotient_manifolds.sharpness.measures import MEASURES  # noqa: E402

VOCAB, LABELS, ROWS, SEQ = 30, 3, 10, 6


def _bert(seed: int, scale: float):
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16, num_labels=LABELS,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, scale)
    return model


@pytest.fixture
def hf_pop(tmp_path, monkeypatch):
    """`ckpts/m0..m2` (save_pretrained) and `batches.safetensors` (10 rows) in `tmp_path`."""
    quiet = transformers.utils.logging
    quiet.disable_progress_bar()
    for i in range(3):
        _bert(i, 0.3 * (i + 1)).save_pretrained(tmp_path / "ckpts" / f"m{i}")
    quiet.enable_progress_bar()
    g = torch.Generator().manual_seed(0)
    save_file({"input_ids": torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
               "attention_mask": torch.ones(ROWS, SEQ, dtype=torch.long),
               "labels": torch.randint(0, LABELS, (ROWS,), generator=g)},
              str(tmp_path / "batches.safetensors"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


ARGS = ["sharpness", "--batches", "batches.safetensors", "--batch-size", "4", "--n-iter", "2",
        "--rho", "0.2", "--measures", "adaptive,geodesic-inv-full", "--no-progress"]


def test_three_checkpoint_folders_one_command(hf_pop, capsys):
    ckpts = [f"ckpts/m{i}" for i in range(3)]
    assert main([*ARGS, "--out", "r.jsonl", *ckpts]) == 0, capsys.readouterr().err
    recs = read_jsonl(hf_pop / "r.jsonl")
    assert sorted((r["checkpoint"], r["measure"]) for r in recs) == sorted(
        (c, m) for c in ckpts for m in ("adaptive", "geodesic-inv-full"))
    batches = load_batches(hf_pop / "batches.safetensors", 4)
    assert [len(b["labels"]) for b in batches] == [4, 4, 2]  # stored order, remainder last
    for r in recs:
        assert r["n_batches"] == 3 and r["model"] == "hf" and r["stem"] == r["checkpoint"][-2:]
        assert r["architecture"] == "BertForSequenceClassification"
        assert r["n_blocks"] == (2 if r["measure"] == "geodesic-inv-full" else 0)  # QK and VO
        model = transformers.BertForSequenceClassification.from_pretrained(
            r["checkpoint"], attn_implementation="eager")
        assert model.config._attn_implementation == "eager"
        want = MEASURES[r["measure"]].run(model, logits_loss, batches, rho=0.2, n_iter=2,
                                          seed=0)
        assert r["per_batch"] == want.per_batch  # the same computation, bit for bit
        assert r["value"] > 0
    # the loss is the model's own .loss
    m0 = transformers.BertForSequenceClassification.from_pretrained("ckpts/m0")
    with torch.no_grad():
        own = m0(**batches[0]).loss
        ce = torch.nn.functional.cross_entropy(m0(input_ids=batches[0]["input_ids"],
                                                  attention_mask=batches[0]["attention_mask"])
                                               .logits, batches[0]["labels"])
    assert logits_loss(m0, batches[0]) == own and torch.allclose(own, ce)

    # a re-run computes nothing; correlate keys checkpoints by folder name or path
    assert main([*ARGS, "--out", "r.jsonl", *ckpts]) == 0
    assert "6 skipped" in capsys.readouterr().out
    geo = {r["checkpoint"]: r["value"] for r in recs if r["measure"] == "geodesic-inv-full"}
    gap = {c: float(i) ** 2 - geo[c] for i, c in enumerate(ckpts)}
    names = ["m0", "ckpts/m1/", str(hf_pop / "ckpts" / "m2")]
    (hf_pop / "gaps.csv").write_text("checkpoint,gap\n" + "".join(
        f"{n},{gap[c]!r}\n" for n, c in zip(names, ckpts)))
    assert main(["correlate", "r.jsonl", "gaps.csv", "--no-plots", "--n-boot", "50"]) == 0
    blob = json.loads((hf_pop / "correlation.json").read_text())
    assert blob["n_members"] == 3 and blob["unmatched"] == []
    by = {r["measure"]: r for r in blob["rows"]}
    want_tau = kendalltau([geo[c] for c in ckpts], [gap[c] for c in ckpts]).statistic
    assert by["geodesic-inv-full"]["tau"] == pytest.approx(want_tau)


def _err(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


def test_input_errors_name_the_folder_and_what_is_missing(hf_pop, capsys):
    d = hf_pop / "ckpts"
    run = [*ARGS, "--out", "e.jsonl"]
    shutil.copytree(d / "m0", d / "noconfig")
    (d / "noconfig" / "config.json").unlink()
    line = _err(capsys, [*run, "ckpts/noconfig"])
    assert "checkpoint folder ckpts/noconfig has no config.json" in line
    shutil.copytree(d / "m0", d / "noweights")
    (d / "noweights" / "model.safetensors").unlink()
    assert "ckpts/noweights has config.json but no weights (model.safetensors)" in _err(
        capsys, [*run, "ckpts/noweights"])
    (d / "noweights" / "pytorch_model.bin").write_bytes(b"")
    assert "holds only pytorch_model.bin" in _err(capsys, [*run, "ckpts/noweights"])
    shutil.copytree(d / "m0", d / "alien")
    cfg = json.loads((d / "alien" / "config.json").read_text())
    cfg["architectures"] = ["BertForTeaMaking"]
    (d / "alien" / "config.json").write_text(json.dumps(cfg))
    line = _err(capsys, [*run, "ckpts/alien"])
    assert "ckpts/alien: unknown architecture 'BertForTeaMaking'" in line
    shutil.copytree(d / "m0", d / "partial")
    sd = load_file(str(d / "partial" / "model.safetensors"))
    sd.pop("classifier.weight")
    save_file(sd, str(d / "partial" / "model.safetensors"), metadata={"format": "pt"})
    line = _err(capsys, [*run, "ckpts/partial"])
    assert "ckpts/partial: the weights do not fit BertForSequenceClassification" in line
    assert "missing keys classifier.weight" in line
    assert "is a file, not a Hugging Face checkpoint folder" in _err(
        capsys, [*run, "batches.safetensors"])
    assert "checkpoint nowhere does not exist" in _err(capsys, [*run, "nowhere"])
    assert not (hf_pop / "e.jsonl").exists()  # every folder is checked before any work


def test_batches_file_errors(hf_pop, capsys):
    b = load_file("batches.safetensors")
    base = ["sharpness", "--batch-size", "4", "--no-progress", "--out", "e.jsonl"]

    def bad(name, tensors):
        save_file(tensors, name)
        return _err(capsys, [*base, "--batches", name, "ckpts/m0"])

    line = bad("nolabels.safetensors", {k: v for k, v in b.items() if k != "labels"})
    assert "batches file nolabels.safetensors has no 'labels'" in line
    line = bad("noinput.safetensors", {"labels": b["labels"]})
    assert "holds labels but no model input (input_ids or pixel_values)" in line
    line = bad("ragged.safetensors", {**b, "labels": b["labels"][:7]})
    assert "ragged.safetensors: shape mismatch" in line and "labels (7,)" in line
    line = bad("vocab.safetensors", {**b, "input_ids": b["input_ids"] + VOCAB})
    assert "checkpoint ckpts/m0 cannot evaluate the loss on the first batch of " \
           "vocab.safetensors (IndexError" in line
    line = bad("extra.safetensors", {**b, "pixel_values": torch.zeros(ROWS, 3)})
    assert "BertForSequenceClassification.forward takes no argument 'pixel_values'" in line
    (hf_pop / "junk.safetensors").write_bytes(b"junk")
    assert "not a readable safetensors file" in _err(
        capsys, [*base, "--batches", "junk.safetensors", "ckpts/m0"])
    assert "--batches needs --batch-size N" in _err(
        capsys, ["sharpness", "--batches", "batches.safetensors", "ckpts/m0"])
    with pytest.raises(SystemExit) as e:  # argparse: --batches or --data, exit status 2
        main(["sharpness", "ckpts/m0"])
    assert e.value.code == 2
    assert "one of the arguments --batches --data is required" in capsys.readouterr().err
    assert not os.path.exists("e.jsonl")


def test_image_classifier_folder_with_pixel_values(tmp_path, monkeypatch, capsys):
    cfg = transformers.ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=16, image_size=8, patch_size=4,
                                 num_channels=3, num_labels=3)
    torch.manual_seed(0)
    vit = transformers.ViTForImageClassification(cfg).float()
    with torch.no_grad():
        for p in vit.parameters():
            p.normal_(0.0, 0.3)
    transformers.utils.logging.disable_progress_bar()
    vit.save_pretrained(tmp_path / "vit")
    transformers.utils.logging.enable_progress_bar()
    g = torch.Generator().manual_seed(1)
    save_file({"pixel_values": torch.randn(5, 3, 8, 8, generator=g, dtype=torch.float64),
               "labels": torch.randint(0, 3, (5,), generator=g)}, str(tmp_path / "img.st"))
    monkeypatch.chdir(tmp_path)
    assert main(["sharpness", "--batches", "img.st", "--batch-size", "3", "--n-iter", "2",
                 "--measures", "geodesic-mix-full", "--no-progress", "vit"]) == 0, \
        capsys.readouterr().err
    (rec,) = read_jsonl("results.jsonl")
    # float64 pixels are cast to the float32 model; 2 batches (3 + 2 rows)
    assert rec["n_batches"] == 2 and rec["n_blocks"] == 2 and rec["value"] > 0
    assert rec["architecture"] == "ViTForImageClassification"


def test_the_documented_example_runs(tmp_path, monkeypatch, capsys):
    """docs/cli.md: the Python block makes the population, the bash block measures it."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    sec = text[text.index("### Hugging Face checkpoints, no code"):]
    script = re.search(r"```python\n(.*?)```", sec, re.S).group(1)
    commands = re.search(r"```bash\n(.*?)```", sec, re.S).group(1).replace("\\\n", " ")
    monkeypatch.chdir(tmp_path)
    transformers.utils.logging.disable_progress_bar()
    exec(compile(script, "make_population.py", "exec"), {})
    transformers.utils.logging.enable_progress_bar()
    ran = 0
    for line in commands.splitlines():
        if line.startswith("quotient-manifolds "):
            assert main([*shlex.split(line)[1:], "--no-progress"] if "sharpness" in line
                        else shlex.split(line)[1:]) == 0, capsys.readouterr().err
            ran += 1
    assert ran == 2
    recs = read_jsonl("results.jsonl")
    assert len(recs) == 9 and len({r["key"] for r in recs}) == 9  # 3 checkpoints x 3 measures
    assert "3 checkpoints with a gap" in capsys.readouterr().out
