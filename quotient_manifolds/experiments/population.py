r"""Sharpness of a population of checkpoints, and its rank correlation with a gap.

The work behind two subcommands of `quotient-manifolds` (user guide: the
[command line](../cli.md) and [distributed](../distributed.md) pages).

**sharpness**: every (checkpoint, measure) pair appends one JSON line to a results file.

* Checkpoints are Hugging Face folders (`config.json` + `model.safetensors`, as
  `save_pretrained` writes them; [`hf_checkpoints`][quotient_manifolds.experiments.hf_checkpoints]),
  or, with a model factory (`model="module:function"`), `state_dict` files: `.safetensors`,
  or files that `torch.load(path, weights_only=True)` reads. Nothing is unpickled unsafely.
* Data is a safetensors file of fixed batches (`batches=`, cut into `batch_size` rows in
  stored order), or a factory returning an iterable of batches (`data="module:function"`).
* Lines are written by [`ResultsFile`][quotient_manifolds.experiments.population.ResultsFile]:
  one `write` + `fsync` under an exclusive file lock, so several processes can append to one
  file, a crash or Ctrl-C loses no finished line, and a torn trailing line (a writer killed
  inside `write`, power loss) is cut off by the next writer. A re-run with the same settings
  skips every pair already in the file (the key hashes the checkpoint path and content, the
  measure and every setting).
* Under `torchrun` (the environment variables `RANK` and `WORLD_SIZE`), each rank takes its
  share of the pairs
  ([`assigned_pairs`][quotient_manifolds.experiments.population.assigned_pairs]); no process
  group is created, and the sharpness engine runs on each rank alone.

**correlate**: Kendall τ-b of each measure (and radius) against the gap, with a
percentile-bootstrap 95 % interval and the p-value of τ = 0
([`kendall_tau`][quotient_manifolds.experiments.stats.kendall_tau]), written to
`DIR/correlation.json`, with one scatter PNG per measure (`DIR/scatter_<measure>.png`). The
gaps file is a CSV with the columns `checkpoint` and `gap`; `checkpoint` is the path as given
to `sharpness`, an absolute path, a path relative to the CSV's folder, or the file stem (the
folder name, for a checkpoint folder).

Bad input (a missing file, a factory that cannot be imported, a checkpoint that does not fit
the model, a malformed gaps file) raises
[`PopulationInputError`][quotient_manifolds.errors.PopulationInputError]; the command line
prints its one-line message and exits with status 2.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import importlib
import importlib.util
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._deps import require
from ..errors import PopulationInputError
from .hf_checkpoints import (
    check_batch_keys,
    check_hf_checkpoint,
    checkpoint_sha256,
    load_batches,
    load_hf_model,
    logits_loss,
)

__all__ = [
    "MEASURES",
    "PopulationInputError",
    "ResultsFile",
    "append_jsonl",
    "assigned_pairs",
    "correlate",
    "default_loss",
    "distributed_rank",
    "evaluate_population",
    "format_table",
    "load_checkpoint",
    "load_factory",
    "measure_names",
    "read_gaps",
    "read_jsonl",
]

MEASURES = ("adaptive", "geodesic-inv-full", "geodesic-mix-full")
"""The default measures: adaptive sharpness (Eq. 1, ℓ2 ball, reference algorithm) and
geodesic sharpness (Eq. 4) with the `inv` or `mix` metric, the second-order retraction
(Eq. 5) and every symmetry the library recognises (the library's default; `geodesic-inv` and
`geodesic-mix` are the paper's measure, GL(h) per head). Any name of the measure table
(`quotient_manifolds.sharpness.measures.MEASURES`) may be asked for."""


def measure_names() -> list[str]:
    """Every measure the command line accepts: the names of the engine's measure table."""
    from ..sharpness.measures import MEASURES as TABLE

    return list(TABLE)


# -- inputs ---------------------------------------------------------------------------------
def load_factory(spec: str, what: str) -> Callable:
    """Import `module:function` or `path/to/file.py:function` and return the callable.

    The current directory is searched first, as ``python -m`` does.
    """
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise PopulationInputError(
            f"--{what} {spec!r} is not of the form module:function; pass e.g. "
            f"--{what} mypackage.models:make_{what}"
        )
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.is_file():
                raise PopulationInputError(
                    f"--{what} {spec!r}: file {mod_name} does not exist; check the path"
                )
            name = f"_qm_factory_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}"
            spec_ = importlib.util.spec_from_file_location(name, path)
            if spec_ is None or spec_.loader is None:
                raise PopulationInputError(
                    f"--{what} {spec!r}: {mod_name} cannot be loaded as a Python module; "
                    "pass a .py file"
                )
            module = importlib.util.module_from_spec(spec_)
            sys.modules[name] = module
            spec_.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(mod_name)
    except PopulationInputError:
        raise
    except ModuleNotFoundError as e:
        raise PopulationInputError(
            f"--{what} {spec!r}: cannot import module {e.name!r}; run from the folder that "
            f"holds it or add that folder to PYTHONPATH"
        ) from None
    except Exception as e:  # noqa: BLE001 - user code: report, never a traceback
        raise PopulationInputError(
            f"--{what} {spec!r}: importing {mod_name} raised {type(e).__name__}: {e}; "
            f"fix that module"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        names = sorted(n for n in dir(module) if not n.startswith("_")
                       and callable(getattr(module, n)))[:6]
        raise PopulationInputError(
            f"--{what} {spec!r}: module {mod_name} has no attribute {attr!r} "
            f"(callables there: {', '.join(names) or 'none'}); fix the name after the colon"
        )
    if not callable(fn):
        raise PopulationInputError(f"--{what} {spec!r}: {attr} is not callable; pass a function")
    return fn


def _call_factory(fn: Callable, spec: str, what: str) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - user code
        raise PopulationInputError(
            f"--{what} {spec!r} raised {type(e).__name__}: {e}; fix the factory (it is called "
            "with no arguments)"
        ) from None


def load_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The `state_dict` in `path`: safetensors, or `torch.load(weights_only=True)`.

    A dict holding the state under `"state_dict"` or `"model"` (a training checkpoint) is
    unwrapped. Files that need unsafe unpickling are refused.
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
            return st.load_file(str(p))
        except (safetensors.SafetensorError, OSError, ValueError) as e:
            raise PopulationInputError(
                f"checkpoint {path} is not a readable safetensors file ({e}); re-save it with "
                "safetensors.torch.save_file(model.state_dict(), path)"
            ) from None
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
    return dict(obj)


def _check_fits(
    model: nn.Module, state: Mapping[str, torch.Tensor], path: str, spec: str
) -> None:
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
            f"checkpoint {path} does not fit the model of --model {spec}: {'; '.join(parts)}; "
            "pass the model factory that built these checkpoints"
        )


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    r"""The loss used when no `--loss` is given.

    * dict batches with `labels`: the model's own `model(**batch).loss`, or the cross-entropy
      of its `.logits` against `labels` when it returns no loss
      ([`logits_loss`][quotient_manifolds.experiments.hf_checkpoints.logits_loss]);
    * `(x, y)` batches: `F.cross_entropy(model(x), y)`.
    """
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise PopulationInputError(
                "a dict batch without 'labels' has no default loss; add labels to the batches "
                "or pass --loss module:function (loss_fn(model, batch) -> scalar tensor)"
            )
        return logits_loss(model, batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)
    raise PopulationInputError(
        f"batches of type {type(batch).__name__} have no default loss (expected a dict with "
        "'labels' or an (x, y) pair); pass --loss module:function"
    )


def _to(batch: Any, device: str | torch.device | None, dtype: torch.dtype | None) -> Any:
    if isinstance(batch, torch.Tensor):
        if dtype is not None and batch.is_floating_point():
            batch = batch.to(dtype)
        return batch.to(device) if device is not None else batch
    if isinstance(batch, Mapping):
        return {k: _to(v, device, dtype) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(v, device, dtype) for v in batch)
    return batch


# -- results file ---------------------------------------------------------------------------
try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks; one writer per file
    fcntl = None  # type: ignore[assignment]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def append_jsonl(path: str | os.PathLike, record: Mapping) -> None:
    """Append one JSON line with a single `write`, then `fsync`, under an exclusive lock."""
    ResultsFile(path).append(record, once=False)


def _parse_line(line: bytes, path: Path, lineno: int) -> dict:
    try:
        rec = json.loads(line)
    except ValueError:
        rec = None
    if not isinstance(rec, dict):
        raise PopulationInputError(
            f"{path} line {lineno} is not a JSON object; delete that line (the other lines are "
            "kept) and run again"
        )
    return rec


def read_jsonl(path: str | os.PathLike, *, repair: bool = False) -> list[dict]:
    """The records of a results file.

    A torn trailing line (no newline at the end: the writer died inside `write`) is ignored,
    and with `repair=True` cut off the file (under the writers' lock). Any other line that is
    not a JSON object is an error that names the line.
    """
    p = Path(path)
    if not p.exists():
        return []
    if repair:
        rf = ResultsFile(p)
        return rf.refresh()
    raw = p.read_bytes()
    end = raw.rfind(b"\n") + 1
    return [_parse_line(line, p, i) for i, line in enumerate(raw[:end].splitlines(), 1)
            if line.strip()]


class ResultsFile:
    """An append-only JSON-lines file that several processes may write at once.

    Every operation takes an exclusive `flock` on the file for its duration: reading the
    lines appended since the last look, cutting off a torn trailing line (only a writer that
    died inside `write` leaves one, since writers hold the lock), and appending one line with
    a single `write` + `fsync`. The keys (the `"key"` field) of every line seen are kept in
    [`keys`][quotient_manifolds.experiments.population.ResultsFile], so that
    [`append`][quotient_manifolds.experiments.population.ResultsFile.append] can refuse a
    line whose key another process has written in the meantime.

    Parameters
    ----------
    path : path
        The results file; created by the first append.

    Notes
    -----
    `flock` is advisory and local to one kernel, except on NFS, where Linux maps it to POSIX
    record locks held by the NFS lock manager. On a file system without locks, give every
    process its own file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.keys: set[str] = set()
        self.records: list[dict] = []
        self._offset = 0
        self._lineno = 0

    @contextlib.contextmanager
    def _locked(self, create: bool) -> Iterator[int | None]:
        flags = os.O_RDWR | os.O_APPEND | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except FileNotFoundError:
            yield None
            return
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)  # releases the lock

    def _scan(self, fd: int) -> list[dict]:
        """Read the complete lines after the offset; cut off a torn tail (we hold the lock)."""
        size = os.fstat(fd).st_size
        if size < self._offset:  # the file was replaced or shortened by hand: read it again
            self._offset, self._lineno, self.keys, self.records = 0, 0, set(), []
        chunks = []
        pos = self._offset
        while pos < size:
            chunk = os.pread(fd, min(size - pos, 1 << 24), pos)
            if not chunk:
                break
            chunks.append(chunk)
            pos += len(chunk)
        raw = b"".join(chunks)
        end = raw.rfind(b"\n") + 1
        if end < len(raw):  # a torn line: its writer died inside write()
            os.ftruncate(fd, self._offset + end)
            os.fsync(fd)
        lines = raw[:end].split(b"\n")[:-1]
        new = [_parse_line(line, self.path, self._lineno + i)
               for i, line in enumerate(lines, 1) if line.strip()]
        self._lineno += len(lines)
        self._offset += end
        self.records.extend(new)
        self.keys.update(str(r["key"]) for r in new if "key" in r)
        return new

    def refresh(self) -> list[dict]:
        """Every record of the file (reading only what was appended since the last look)."""
        with self._locked(create=False) as fd:
            if fd is not None:
                self._scan(fd)
        return list(self.records)

    def append(self, record: Mapping, *, once: bool = True) -> bool:
        """Append `record` as one line; return False (and write nothing) when `once` and a
        line with the same `"key"` is already in the file."""
        data = (json.dumps(dict(record), sort_keys=True, allow_nan=True) + "\n").encode()
        with self._locked(create=True) as fd:
            assert fd is not None
            self._scan(fd)
            key = record.get("key")
            if once and key is not None and str(key) in self.keys:
                return False
            _write_all(fd, data)
            os.fsync(fd)
            self._offset += len(data)
            self._lineno += 1
            self.records.append(dict(record))
            if key is not None:
                self.keys.add(str(key))
        return True


# -- ranks ----------------------------------------------------------------------------------
def distributed_rank() -> tuple[int, int]:
    """`(rank, world_size)` from the environment `torchrun` sets (`RANK`, `WORLD_SIZE`);
    `(0, 1)` outside `torchrun`."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        raise PopulationInputError(
            f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
            "are not integers; launch with torchrun, or unset them"
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise PopulationInputError(
            f"RANK={rank} is not in range(WORLD_SIZE={world}); launch with torchrun, or unset "
            "them"
        )
    return rank, world


def assigned_pairs(n_checkpoints: int, n_measures: int, rank: int,
                   world_size: int) -> list[tuple[int, int]]:
    """The (checkpoint index, measure index) pairs that `rank` of `world_size` computes.

    With at least as many checkpoints as ranks, checkpoint `i` goes, with all its measures, to
    rank `i mod W` (each checkpoint is read, hashed and loaded by one rank only). With fewer
    checkpoints than ranks, pair `k = i·M + j` (checkpoint-major) goes to rank `k mod W`. The
    assignment depends only on the command line, never on what is already in the results
    file, so the ranks need no communication; together they cover every pair exactly once.
    """
    if n_checkpoints >= world_size:
        return [(i, j) for i in range(rank, n_checkpoints, world_size)
                for j in range(n_measures)]
    return [divmod(k, n_measures) for k in range(rank, n_checkpoints * n_measures, world_size)]


def _key(record: Mapping) -> str:
    fields = ("path", "sha256", "measure", "rho", "n_iter", "seed", "kind", "model", "data",
              "loss", "dtype")
    optional = ("batch_size", "batches_sha256")  # hashed only when set (older files keep keys)
    blob = json.dumps({**{k: record.get(k) for k in fields},
                       **{k: record[k] for k in optional if k in record}},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _rank_device(device: str | None, world_size: int) -> str | None:
    """`cuda` under torchrun means this rank's GPU, `cuda:LOCAL_RANK`."""
    if device == "cuda" and world_size > 1 and "LOCAL_RANK" in os.environ:
        return f"cuda:{int(os.environ['LOCAL_RANK'])}"
    return device


def _probe(net: nn.Module, loss_fn: Callable, batch: Any, ckpt: str, data: str) -> None:
    """The loss of the first batch, once per checkpoint: input errors say what does not fit."""
    from ..errors import QuotientManifoldError

    try:
        with torch.no_grad():
            loss = loss_fn(net, batch)
    except QuotientManifoldError:
        raise
    except Exception as e:  # noqa: BLE001 - a batch that does not fit the model
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise PopulationInputError(
            f"checkpoint {ckpt} cannot evaluate the loss on the first batch of {data} "
            f"({type(e).__name__}: {first}); check that the batches fit the model (vocabulary "
            "size, number of labels, image size)"
        ) from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise PopulationInputError(
            f"the loss of checkpoint {ckpt} on the first batch of {data} is not a scalar tensor "
            f"({type(loss).__name__}); the loss must return one number per batch"
        )


def evaluate_population(
    checkpoints: Sequence[str],
    *,
    out: str | os.PathLike,
    model: str | None = None,
    data: str | None = None,
    batches: str | os.PathLike | None = None,
    batch_size: int | None = None,
    loss: str | None = None,
    measures: Sequence[str] = MEASURES,
    rho: float = 0.1,
    n_iter: int = 20,
    seed: int = 0,
    dtype: str | None = None,
    device: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> dict[str, Any]:
    """Measure every checkpoint with every measure; append one JSON line each to `out`.

    Parameters
    ----------
    checkpoints : sequence of str
        Hugging Face checkpoint folders (without `model`), or `state_dict` files (with
        `model`).
    out : path
        The results file (JSON lines; created, or appended to).
    model : str, optional
        `module:function` returning the `nn.Module` that the `state_dict` files fit.
    data, batches, batch_size
        The batches: a `module:function` factory (`data`), or a safetensors file (`batches`)
        cut into `batch_size` rows. Exactly one of `data` and `batches`.
    loss : str, optional
        `module:function`, `loss_fn(model, batch) -> scalar`; default
        [`default_loss`][quotient_manifolds.experiments.population.default_loss].
    measures : sequence of str
        Names of the measure table
        (`quotient_manifolds.sharpness.measures.MEASURES`).
    rho, n_iter, seed
        The radius, Auto-PGD iterations and seed of every measurement.
    dtype : {"float32", "float64"}, optional
        Convert the models and the floating batch tensors.
    device : str, optional
        Where the models and batches go; `"cuda"` under `torchrun` is the rank's GPU.
    progress : bool
        A tqdm bar on standard error (rank 0 only).
    log : callable
        Receives the one-line messages (default: standard error).

    Returns
    -------
    dict
        `{"done": new lines, "skipped": pairs already there, "out": path, "rank": r,
        "world_size": W, "assigned": pairs of this rank}`.

    Notes
    -----
    Under `torchrun` each rank computes only its
    [`assigned_pairs`][quotient_manifolds.experiments.population.assigned_pairs] and appends
    to the same file (see [`ResultsFile`][quotient_manifolds.experiments.population.ResultsFile]).
    """
    from tqdm.auto import tqdm

    from ..sharpness.measures import MEASURES as TABLE

    bad = [m for m in measures if m not in TABLE]
    if bad or not measures:
        raise PopulationInputError(
            f"unknown measure(s) {', '.join(bad) or '(none)'}; choose from {', '.join(TABLE)}"
        )
    if len(set(measures)) != len(measures):
        raise PopulationInputError(f"measures {', '.join(measures)} name one twice; keep one")
    if not (isinstance(rho, (int, float)) and rho > 0 and math.isfinite(rho)):
        raise PopulationInputError(f"--rho {rho} must be a positive number, e.g. --rho 0.1")
    if n_iter < 1:
        raise PopulationInputError(f"--n-iter {n_iter} must be at least 1")
    if not checkpoints:
        raise PopulationInputError("no checkpoint given; pass checkpoints after the options")
    if (data is None) == (batches is None):
        raise PopulationInputError(
            "pass the batches either as a file (--batches FILE --batch-size N) or as a factory "
            "(--data module:function), not " + ("both" if data else "neither")
        )
    if batches is not None and batch_size is None:
        raise PopulationInputError("--batches needs --batch-size N (rows per batch)")
    hf = model is None
    paths = [Path(c) for c in checkpoints]
    archs: dict[int, str] = {}
    for i, (c, p) in enumerate(zip(checkpoints, paths)):
        if hf:
            archs[i] = check_hf_checkpoint(c)
        elif p.is_dir():
            raise PopulationInputError(
                f"checkpoint {c} is a folder; with --model pass state_dict files, or drop "
                "--model to load Hugging Face checkpoint folders"
            )
        elif not p.is_file():
            raise PopulationInputError(f"checkpoint {c} does not exist; check the path")
    out = Path(out)
    if out.exists() and out.is_dir():
        raise PopulationInputError(f"--out {out} is a folder; pass a file name, e.g. "
                                   f"{out / 'results.jsonl'}")
    if not out.parent.exists():
        raise PopulationInputError(f"--out {out}: folder {out.parent} does not exist; create it")
    rank, world = distributed_rank()
    device = _rank_device(device, world)
    model_fn = load_factory(model, "model") if model else None
    data_fn = load_factory(data, "data") if data else None
    loss_fn = load_factory(loss, "loss") if loss else default_loss
    torch_dtype = {None: None, "float32": torch.float32, "float64": torch.float64}[dtype]
    fixed: list | None = None
    base: dict[str, Any] = dict(rho=float(rho), n_iter=int(n_iter), seed=int(seed),
                                kind="worst", model=model or "hf", data=data,
                                loss=loss or "default", dtype=dtype or "model")
    if batches is not None:
        assert batch_size is not None
        fixed = load_batches(batches, int(batch_size), dtype=torch_dtype)
        base.update(data=str(Path(batches).resolve()), batch_size=int(batch_size),
                    batches_sha256=checkpoint_sha256(batches))
    data_name = str(batches) if batches is not None else f"--data {data}"
    who = f"rank {rank}/{world}: " if world > 1 else ""

    results = ResultsFile(out)
    results.refresh()  # cuts off a torn trailing line
    todo: dict[int, list[dict]] = {}
    n_skip = 0
    for i, j in assigned_pairs(len(checkpoints), len(measures), rank, world):
        c, p = checkpoints[i], paths[i]
        if i not in todo:
            todo[i] = []
            ident: dict[str, Any] = dict(checkpoint=c, path=str(p.resolve()),
                                         stem=p.name if p.is_dir() else p.stem,
                                         sha256=checkpoint_sha256(p))
            if hf:
                ident["architecture"] = archs[i]
        rec = {**ident, "measure": measures[j], **base}
        rec["key"] = _key(rec)
        if rec["key"] in results.keys:
            n_skip += 1
        else:
            todo[i].append(rec)
    todo = {i: recs for i, recs in todo.items() if recs}
    n_todo = sum(len(r) for r in todo.values())
    if n_skip:
        log(f"{who}{out}: {n_skip} result(s) already there, skipped; {n_todo} to compute")
    summary = {"done": 0, "skipped": n_skip, "out": str(out), "rank": rank, "world_size": world,
               "assigned": n_skip + n_todo}
    if not n_todo:
        return summary

    net: nn.Module | None = None
    if model_fn is not None:
        assert model is not None
        net = _call_factory(model_fn, model, "model")
        if not isinstance(net, nn.Module):
            raise PopulationInputError(
                f"--model {model} returned a {type(net).__name__}, not a torch.nn.Module; "
                "return the model whose state_dict the checkpoints hold"
            )
        if torch_dtype is not None:
            net = net.to(torch_dtype)
        if device:
            net = net.to(device)
        for i in todo:  # fail fast: every pending checkpoint must fit before any work starts
            _check_fits(net, load_checkpoint(paths[i]), checkpoints[i], model)

    def get_batches() -> Iterable:
        if fixed is not None:
            return [_to(b, device, float_dtype) for b in fixed]
        assert data_fn is not None and data is not None
        got = _call_factory(data_fn, data, "data")
        if torch_dtype is not None or device:
            return (_to(b, device, torch_dtype) for b in got)
        return got

    n_new = 0
    bar = tqdm(total=n_todo, desc="sharpness" + (f" rank 0/{world}" if world > 1 else ""),
               unit="measure", disable=not progress or rank != 0, file=sys.stderr,
               dynamic_ncols=True)
    try:
        for i, recs in todo.items():
            if net is None:
                cur = load_hf_model(paths[i], dtype=torch_dtype, device=device)
            else:
                net.load_state_dict(load_checkpoint(paths[i]), strict=True)
                cur = net
            float_dtype = torch_dtype or next(
                (q.dtype for q in cur.parameters() if q.is_floating_point()), None)
            first = True
            for rec in recs:
                bar.set_postfix_str(f"{paths[i].name} {rec['measure']}")
                batch_list = get_batches()
                if first:
                    batch_list = list(batch_list)
                    if not batch_list:
                        raise PopulationInputError(f"{data_name} yields no batch; pass data")
                    if hf:  # HF models are in eval mode: a forward changes no buffer
                        check_batch_keys(cur, batch_list[0], f"checkpoint {checkpoints[i]}")
                        _probe(cur, loss_fn, batch_list[0], checkpoints[i], data_name)
                    first = False
                t0 = time.perf_counter()
                with warnings.catch_warnings():
                    if n_new:  # the same fallbacks for every checkpoint: say it once
                        warnings.simplefilter("ignore", UserWarning)
                    res = TABLE[rec["measure"]].run(cur, loss_fn, batch_list, rho=float(rho),
                                                    n_iter=int(n_iter), seed=int(seed))
                rec = {**rec, "value": res.value, "per_batch": res.per_batch,
                       "base_loss": sum(res.base_loss) / len(res.base_loss),
                       "n_batches": len(res.per_batch), "n_blocks": len(res.blocks),
                       "n_fallbacks": len(res.fallbacks),
                       "elapsed_s": round(time.perf_counter() - t0, 4),
                       "version": _version()}
                if world > 1:
                    rec.update(rank=rank, world_size=world)
                if results.append(rec):
                    n_new += 1
                else:  # another process wrote this pair meanwhile (two runs at once)
                    n_skip += 1
                bar.update(1)
    finally:
        bar.close()
    summary.update(done=n_new, skipped=n_skip)
    return summary


def _version() -> str:
    from .. import __version__

    return __version__



# -- correlate ------------------------------------------------------------------------------
def read_gaps(path: str | os.PathLike) -> dict[str, float]:
    """`{checkpoint: gap}` from a CSV file with the header columns `checkpoint` and `gap`."""
    p = Path(path)
    if not p.is_file():
        raise PopulationInputError(f"gaps file {path} does not exist; check the path")
    fix = "the file needs a header line 'checkpoint,gap' and one row per checkpoint"
    with p.open(newline="") as f:
        try:
            rows = list(csv.reader(f))
        except csv.Error as e:
            raise PopulationInputError(f"gaps file {path} is not valid CSV ({e}); {fix}") from None
    rows = [r for r in rows if any(c.strip() for c in r)]
    if not rows:
        raise PopulationInputError(f"gaps file {path} is empty; {fix}")
    header = [c.strip().lower() for c in rows[0]]
    if "checkpoint" not in header or "gap" not in header:
        raise PopulationInputError(
            f"gaps file {path} has columns {', '.join(header)}; {fix}"
        )
    ci, gi = header.index("checkpoint"), header.index("gap")
    gaps: dict[str, float] = {}
    for n, row in enumerate(rows[1:], 2):
        if len(row) <= max(ci, gi):
            raise PopulationInputError(f"gaps file {path} line {n} has {len(row)} column(s); {fix}")
        name, val = row[ci].strip(), row[gi].strip()
        try:
            gap = float(val)
        except ValueError:
            raise PopulationInputError(
                f"gaps file {path} line {n}: gap {val!r} is not a number; {fix}"
            ) from None
        if not name:
            raise PopulationInputError(f"gaps file {path} line {n}: empty checkpoint; {fix}")
        if name in gaps:
            raise PopulationInputError(
                f"gaps file {path} line {n}: checkpoint {name!r} appears twice; keep one row"
            )
        gaps[name] = gap
    if not gaps:
        raise PopulationInputError(f"gaps file {path} has a header but no rows; {fix}")
    return gaps


def _match_gap(rec: Mapping, gaps: Mapping[str, float], gaps_dir: Path) -> float | None:
    for k in (rec.get("checkpoint"), rec.get("path")):
        if isinstance(k, str) and k in gaps:
            return gaps[k]
    given = os.path.normpath(str(rec.get("checkpoint")))
    for k, v in gaps.items():  # "runs/m0/" for "runs/m0", paths relative to the CSV, stems
        if (os.path.normpath(k) == given or k.rstrip("/") == rec.get("stem")
                or str((gaps_dir / k).resolve()) == rec.get("path")):
            return v
    return None


def correlate(
    results: str | os.PathLike,
    gaps: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    plots: bool = True,
) -> dict:
    """Kendall τ (bootstrap CI) of every measure and radius in `results` against the gaps.

    Writes `out/correlation.json` and, with `plots`, `out/scatter_<measure>.png`; returns
    the dict of `correlation.json`: `{"rows": [{"measure", "rho", "tau", "ci95", "p_value",
    "n", ...}], "members": [...], "unmatched": [...], "figures": [...]}`.
    """
    from .stats import kendall_tau

    rp = Path(results)
    if not rp.is_file():
        raise PopulationInputError(f"results file {results} does not exist; run "
                                   "'quotient-manifolds sharpness ... --out FILE' first")
    recs = read_jsonl(rp)
    gap_of = read_gaps(gaps)
    recs = [r for r in recs if {"measure", "rho", "value", "checkpoint"} <= r.keys()]
    if not recs:
        raise PopulationInputError(f"results file {results} has no sharpness line; run "
                                   "'quotient-manifolds sharpness' first")
    stems: dict[str | None, set] = {}
    for r in recs:
        stems.setdefault(r.get("stem"), set()).add(r.get("path"))
    gaps_dir = Path(gaps).resolve().parent
    members: dict[str, dict] = {}
    unmatched = []
    for r in recs:
        g = _match_gap(r, gap_of, gaps_dir)
        if g is None:
            if r["checkpoint"] not in unmatched:
                unmatched.append(r["checkpoint"])
            continue
        if r.get("stem") in gap_of and len(stems[r.get("stem")]) > 1 and not (
                r["checkpoint"] in gap_of or r.get("path") in gap_of):
            raise PopulationInputError(
                f"gaps file {gaps}: stem {r['stem']!r} names several checkpoints; use their "
                "paths in the checkpoint column"
            )
        m = members.setdefault(r["path"], {"id": r["checkpoint"], "gap": g, "measures": {}})
        m["measures"].setdefault(r["measure"], {})[repr(float(r["rho"]))] = float(r["value"])
    if len(members) < 3:
        raise PopulationInputError(
            f"only {len(members)} checkpoint(s) of {results} have a gap in {gaps}; τ needs at "
            "least 3: check the checkpoint column (path as given, absolute path, or stem)"
        )
    mlist = list(members.values())
    order = measure_names()
    names = sorted({k for m in mlist for k in m["measures"]},
                   key=lambda n: order.index(n) if n in order else len(order))
    rows = []
    for name in names:
        rhos = sorted({r for m in mlist for r in m["measures"].get(name, {})}, key=float)
        for rho in rhos:
            xs = [m["measures"].get(name, {}).get(rho, math.nan) for m in mlist]
            t = kendall_tau(xs, [m["gap"] for m in mlist], n_boot=n_boot, seed=seed)
            rows.append({"measure": name, "rho": float(rho), **t})
    outdir = Path(out) if out is not None else rp.parent
    outdir.mkdir(parents=True, exist_ok=True)
    figures = []
    if plots:
        figures = [str(_scatter(mlist, name, rows, outdir / f"scatter_{name}.png"))
                   for name in names]
    blob = {"results": str(rp), "gaps": str(gaps), "n_members": len(mlist), "rows": rows,
            "members": mlist, "unmatched": unmatched, "figures": figures, "n_boot": n_boot}
    from .store import atomic_write_text

    atomic_write_text(outdir / "correlation.json", json.dumps(blob, indent=1))
    return blob


def _scatter(members: list[dict], name: str, rows: list[dict], path: Path) -> Path:
    matplotlib = require("matplotlib", "the scatter plots of correlate (or pass --no-plots)")
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot", "the scatter plots of correlate (or pass --no-plots)")

    mine = [r for r in rows if r["measure"] == name]
    fig, axes = plt.subplots(1, len(mine), figsize=(3.8 * len(mine), 3.3), squeeze=False)
    gaps = [m["gap"] for m in members]
    for ax, row in zip(axes[0], mine):
        key = repr(float(row["rho"]))
        xs = [m["measures"].get(name, {}).get(key, math.nan) for m in members]
        ax.scatter(xs, gaps, s=16, alpha=0.8)
        lo, hi = row["ci95"]
        ax.set_title(f"τ = {row['tau']:.2f} [{lo:.2f}, {hi:.2f}], n = {row['n']}", fontsize=9)
        ax.set_xlabel(f"{name} sharpness (ρ = {row['rho']:.3g})")
        if all(x > 0 for x in xs if x == x):
            ax.set_xscale("log")
    axes[0][0].set_ylabel("gap")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_table(blob: Mapping) -> str:
    """The τ table of [`correlate`][quotient_manifolds.experiments.population.correlate] as
    text."""
    lines = [f"{blob['n_members']} checkpoints with a gap",
             f"{'measure':<14}{'rho':>8}{'n':>5}{'tau':>8}   {'95% CI':<16}{'p':>9}"]
    for r in blob["rows"]:
        lo, hi = r["ci95"]
        lines.append(f"{r['measure']:<14}{r['rho']:>8.3g}{r['n']:>5}{r['tau']:>8.3f}   "
                     f"[{lo:+.2f}, {hi:+.2f}]  {r['p_value']:>9.2g}")
    if blob["unmatched"]:
        few = ", ".join(blob["unmatched"][:3])
        more = f" (+{len(blob['unmatched']) - 3} more)" if len(blob["unmatched"]) > 3 else ""
        lines.append(f"no gap for {len(blob['unmatched'])} checkpoint(s): {few}{more}")
    return "\n".join(lines)
