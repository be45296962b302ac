r"""The user's inputs of a population run: factories, `state_dict` checkpoints, the default loss.

Factories are named `module:function` (or `path/to/file.py:function`) and called with no
arguments. Checkpoint files are `.safetensors`, or files that `torch.load(path,
weights_only=True)` reads: nothing is unpickled unsafely. Every problem raises
[`PopulationInputError`][quotient_manifolds.errors.PopulationInputError], whose message names
the parameter (`model=…`, `data=…`, `loss=…`) and what to do; a checkpoint with a NaN or
Inf weight raises [`NonFiniteWeightError`][quotient_manifolds.errors.NonFiniteWeightError].
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..._deps import require
from ...errors import PopulationInputError
from ..hf_checkpoints import check_finite_weights, logits_loss

__all__ = ["call_factory", "check_fits", "check_out_file", "check_out_folder", "default_loss",
           "load_checkpoint", "load_factory"]


def load_factory(spec: str, parameter: str) -> Callable:
    """Import `module:function` or `path/to/file.py:function` and return the callable.

    The current directory is searched first, as `python -m` does. `parameter` is the name
    under which `spec` was given (`"model"`, `"data"`, `"loss"`); the error messages use it.
    """
    mod_name, sep, attr = spec.rpartition(":")
    given = f"{parameter}={spec!r}"
    if not sep or not mod_name or not attr:
        raise PopulationInputError(
            f"{given} is not of the form module:function; pass e.g. "
            f"{parameter}=mypackage.models:make_{parameter}"
        )
    try:
        if mod_name.endswith(".py"):
            module = _module_from_file(Path(mod_name), given)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(mod_name)
    except PopulationInputError:
        raise
    except ModuleNotFoundError as e:
        raise PopulationInputError(
            f"{given}: cannot import module {e.name!r}; run from the folder that holds it or "
            "add that folder to PYTHONPATH"
        ) from None
    except Exception as e:  # noqa: BLE001 - user code: report, never a traceback
        raise PopulationInputError(
            f"{given}: importing {mod_name} raised {type(e).__name__}: {e}; fix that module"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        names = sorted(n for n in dir(module) if not n.startswith("_")
                       and callable(getattr(module, n)))[:6]
        raise PopulationInputError(
            f"{given}: module {mod_name} has no attribute {attr!r} "
            f"(callables there: {', '.join(names) or 'none'}); fix the name after the colon"
        )
    if not callable(fn):
        raise PopulationInputError(f"{given}: {attr} is not callable; pass a function")
    return fn


def _module_from_file(path: Path, given: str) -> Any:
    if not path.is_file():
        raise PopulationInputError(f"{given}: file {path} does not exist; check the path")
    name = f"_qm_factory_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PopulationInputError(
            f"{given}: {path} cannot be loaded as a Python module; pass a .py file"
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def call_factory(fn: Callable, spec: str, parameter: str) -> Any:
    """`fn()`, with an exception of the user's code reported as an input error."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - user code
        raise PopulationInputError(
            f"{parameter}={spec!r} raised {type(e).__name__}: {e}; fix the factory (it is "
            "called with no arguments)"
        ) from None


def load_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The `state_dict` in `path`: safetensors, or `torch.load(weights_only=True)`.

    A dict holding the state under `"state_dict"` or `"model"` (a training checkpoint) is
    unwrapped. Files that need unsafe unpickling are refused, and so are NaN or Inf weights
    ([`NonFiniteWeightError`][quotient_manifolds.errors.NonFiniteWeightError], naming `path`
    and the tensor).
    """
    p = Path(path)
    if not p.is_file():
        raise PopulationInputError(f"checkpoint {path} does not exist; check the path")
    with p.open("rb") as f:
        head = f.read(16)
    if p.suffix == ".safetensors" or (len(head) >= 9 and head[8:9] == b"{"):
        safetensors = require("safetensors", "reading .safetensors checkpoints")
        st = require("safetensors.torch", "reading .safetensors checkpoints")
        try:
            state = st.load_file(str(p))
        except (safetensors.SafetensorError, OSError, ValueError) as e:
            raise PopulationInputError(
                f"checkpoint {path} is not a readable safetensors file ({e}); re-save it with "
                "safetensors.torch.save_file(model.state_dict(), path)"
            ) from None
        check_finite_weights(state.items(), path)
        return state
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError, RuntimeError, EOFError, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PopulationInputError(
            f"checkpoint {path} cannot be read with torch.load(weights_only=True) "
            f"({first[:160]}); save only tensors: torch.save(model.state_dict(), path) or "
            "safetensors.torch.save_file"
        ) from None
    if isinstance(obj, Mapping):
        for k in ("state_dict", "model"):
            if isinstance(obj.get(k), Mapping):
                obj = obj[k]
                break
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise PopulationInputError(
            f"checkpoint {path} holds a {type(obj).__name__}, not a state_dict of tensors; "
            "save it with torch.save(model.state_dict(), path)"
        )
    check_finite_weights(obj.items(), path)
    return dict(obj)


def check_fits(model: nn.Module, state: Mapping[str, torch.Tensor], path: str,
               spec: str) -> None:
    """Every key and shape of `state` (read from `path`) must match `model` (built by the
    factory `spec`)."""
    ref = model.state_dict()
    missing = [k for k in ref if k not in state]
    unexpected = [k for k in state if k not in ref]
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in ref.items()
              if k in state and tuple(state[k].shape) != tuple(v.shape)]

    def few(xs: list[str]) -> str:
        return ", ".join(xs[:3]) + (f" (+{len(xs) - 3} more)" if len(xs) > 3 else "")

    parts = []
    if missing:
        parts.append(f"missing keys {few(missing)}")
    if unexpected:
        parts.append(f"unexpected keys {few(unexpected)}")
    if shapes:
        parts.append(f"shape mismatch {few(shapes)}")
    if parts:
        raise PopulationInputError(
            f"checkpoint {path} does not fit the model of model={spec}: {'; '.join(parts)}; "
            "pass the model factory that built these checkpoints"
        )


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    r"""The loss used when no `loss` factory is given.

    * dict batches with `labels`: the model's own `model(**batch).loss`, or the cross-entropy
      of its `.logits` against `labels` when it returns no loss
      ([`logits_loss`][quotient_manifolds.experiments.hf_checkpoints.logits_loss]);
    * `(x, y)` batches: `F.cross_entropy(model(x), y)`.
    """
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise PopulationInputError(
                "a dict batch without 'labels' has no default loss; add labels to the batches "
                "or pass loss=module:function (loss_fn(model, batch) -> scalar tensor)"
            )
        return logits_loss(model, batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)
    raise PopulationInputError(
        f"batches of type {type(batch).__name__} have no default loss (expected a dict with "
        "'labels' or an (x, y) pair); pass loss=module:function"
    )


# -- outputs: checked before any work, so that no measurement is lost to an unwritable path ---
_WRITE_FIX = "pass a path in a folder you can write to"


def _probe_folder(folder: Path) -> str | None:
    """Why a file cannot be created in `folder` (None: it can): a temporary file is made and
    removed, as the results are written."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".qm-write-probe.", suffix=".tmp")
    except OSError as e:
        return e.strerror or type(e).__name__
    os.close(fd)
    os.unlink(tmp)
    return None


def check_out_file(path: str | os.PathLike) -> Path:
    """`path` as a file that results can be appended to: not a folder, in an existing folder
    where a file can be created (or an existing file that can be opened for appending).

    Raises
    ------
    PopulationInputError
        Naming `out=` and what to do.
    """
    out = Path(path)
    if out.is_dir():
        raise PopulationInputError(f"out={out} is a folder; pass a file name, e.g. "
                                   f"{out / 'results.jsonl'}")
    parent = out.parent
    if not parent.exists():
        raise PopulationInputError(f"out={out}: folder {parent} does not exist; create it")
    if not parent.is_dir():
        raise PopulationInputError(f"out={out}: {parent} is a file, not a folder; {_WRITE_FIX}")
    if out.exists():
        try:
            with open(out, "a"):  # opened for appending, not written
                pass
        except OSError as e:
            raise PopulationInputError(
                f"out={out} cannot be written ({e.strerror}); {_WRITE_FIX}, or make the file "
                "writable") from None
    elif (why := _probe_folder(parent)) is not None:
        raise PopulationInputError(
            f"out={out}: no file can be created in folder {parent} ({why}); {_WRITE_FIX}")
    return out


def check_out_folder(path: str | os.PathLike) -> Path:
    """`path` as a folder that files can be written to: an existing writable folder, or one
    that can be created (its nearest existing ancestor is a writable folder). Nothing is
    created.

    Raises
    ------
    PopulationInputError
        Naming `out=` and what to do.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise PopulationInputError(f"out={out} is a file; pass a folder")
    base = out
    while not base.exists():  # the folder and its missing parents are made when writing
        base = base.parent
    if not base.is_dir():
        raise PopulationInputError(
            f"out={out} cannot be created: {base} is a file, not a folder; pass another folder")
    if (why := _probe_folder(base)) is not None:
        what = "cannot be written" if base == out else f"cannot be created in {base}"
        raise PopulationInputError(f"out={out} {what} ({why}); pass a folder you can write to")
    return out
