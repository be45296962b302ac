"""Optional packages are imported lazily; without one, the user gets a named one-line error.

A subprocess blocks every optional package with a meta-path finder (as if none were
installed), imports every module of the library, and drives the command line where an
optional package is needed: `reproduce diagonal` (what `make demo` runs), `sharpness` on a
Hugging Face folder, and `correlate` with its plots.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from quotient_manifolds._deps import OPTIONAL, MissingDependencyError, available, require

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys

    BLOCKED = set(sys.argv[1].split(","))

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
    import quotient_manifolds

    mods = [m.name for m in pkgutil.walk_packages(quotient_manifolds.__path__,
                                                  "quotient_manifolds.")
            if not m.name.endswith("__main__")]
    for m in mods:
        importlib.import_module(m)
    leaked = sorted(n for n in sys.modules if n.partition(".")[0] in BLOCKED)
    from quotient_manifolds.cli import main

    codes = {}
    for name, argv in json.loads(sys.argv[2]).items():
        codes[name] = main(argv)
        print("@@", name, file=sys.stderr)
    print(json.dumps({"modules": len(mods), "leaked": leaked, "codes": codes}))
    """
)


def test_every_module_imports_without_optional_packages_and_errors_are_named(tmp_path):
    hf = tmp_path / "ckpt"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "bert",
                                                "architectures": ["BertForMaskedLM"]}))
    (hf / "model.safetensors").write_bytes(b"")
    (tmp_path / "r.jsonl").write_text("".join(
        json.dumps({"checkpoint": f"m{i}", "path": f"/m{i}", "stem": f"m{i}",
                    "measure": "adaptive", "rho": 0.1, "value": float(i)}) + "\n"
        for i in range(3)))
    (tmp_path / "gaps.csv").write_text("checkpoint,gap\nm0,1\nm1,0\nm2,2\n")
    runs = {
        "demo": ["reproduce", "diagonal", "--quick", "--out", str(tmp_path / "runs")],
        "hf": ["sharpness", "--batches", str(tmp_path / "b.safetensors"), "--batch-size", "2",
               "--out", str(tmp_path / "s.jsonl"), "--no-progress", str(hf)],
        "plots": ["correlate", str(tmp_path / "r.jsonl"), str(tmp_path / "gaps.csv"),
                  "--n-boot", "10"],
    }
    p = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(OPTIONAL), json.dumps(runs)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["modules"] > 30 and out["leaked"] == []
    assert out["codes"] == {"demo": 2, "hf": 2, "plots": 2}
    assert "Traceback" not in p.stderr
    msgs = dict(zip(("demo", "hf", "plots"), p.stderr.split("@@")))
    for name, text in msgs.items():
        lines = [x for x in text.strip().splitlines()[1 if name != "demo" else 0:] if x]
        assert len(lines) == 1, (name, text)
    assert ("reproduce: error: experiment 'diagonal' needs safetensors, matplotlib, which are "
            "not installed; pip install 'quotient-manifolds[hf]'") in msgs["demo"]
    assert "pip install 'quotient-manifolds[plots]'" in msgs["demo"]
    assert ("sharpness: error: loading Hugging Face checkpoints needs the package "
            "'transformers', which is not installed; pip install 'quotient-manifolds[hf]'"
            ) in msgs["hf"]
    assert ("correlate: error: the scatter plots of correlate (or pass --no-plots) needs the "
            "package 'matplotlib'") in msgs["plots"]
    assert not (tmp_path / "runs" / "diagonal" / "members").exists()  # failed before any work


def test_require_names_the_package_and_the_extra(monkeypatch):
    importlib.import_module("sklearn.datasets")  # as after an earlier test in this worker
    for mod in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]:
        monkeypatch.setitem(sys.modules, mod, None)
    assert not available("sklearn.datasets") and available("torch")
    try:
        require("sklearn.datasets", "the digits data")
    except MissingDependencyError as e:
        assert str(e).startswith("the digits data needs the package 'scikit-learn', which is "
                                 "not installed; pip install 'quotient-manifolds[vision]'")
        assert e.name == "sklearn" and isinstance(e, ImportError)
    else:
        raise AssertionError("no error")


def test_extras_agree_with_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for name, opt in OPTIONAL.items():
        if opt.extra is not None:
            assert opt.distribution in extras[opt.extra], (name, opt)
