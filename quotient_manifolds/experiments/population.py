r"""Sharpness of a population of checkpoints, and its rank correlation with a gap (issue 7).

Two subcommands of ``quotient-manifolds`` (the user guide is docs/cli.md).

**sharpness**: ``quotient-manifolds sharpness --model pkg.mod:make_model --data
pkg.mod:make_batches [--loss pkg.mod:loss_fn] [--measures adaptive,geodesic-inv,geodesic-mix]
[--rho 0.1] [--n-iter 20] [--seed 0] [--out results.jsonl] CKPT [CKPT ...]``

* ``--model``: a function (no arguments) returning the ``torch.nn.Module`` whose ``state_dict``
  the checkpoints hold. ``module:function`` is imported from the current directory or
  ``PYTHONPATH``; ``path/to/file.py:function`` loads a file.
* ``--data``: a function (no arguments) returning an iterable of batches (a list, a
  ``DataLoader``, a generator). It is called once per measurement.
* ``--loss``: ``loss_fn(model, batch) -> scalar tensor``. Default: ``model(**batch).loss`` for
  dict batches that hold ``labels`` (Hugging Face models), and ``F.cross_entropy(model(x), y)``
  for ``(x, y)`` batches.
* checkpoints: ``.safetensors`` files, or files that ``torch.load(path, weights_only=True)``
  reads (a ``state_dict``, or a dict holding one under ``"state_dict"``/``"model"``). Nothing is
  ever unpickled unsafely.

Each (checkpoint, measure) pair appends one JSON line to ``--out``. Every line is written with a
single ``write`` + ``fsync`` on a file opened in append mode, so a crash or Ctrl-C loses no
finished line and never leaves a half-written one in the middle of the file; a torn trailing line
(power loss) is removed on the next run. A re-run with the same settings skips every pair that is
already in the file (the key hashes the checkpoint path and content, the measure and every
setting).

**correlate**: ``quotient-manifolds correlate results.jsonl gaps.csv [--out DIR]``. Kendall τ-b
of each measure (and radius) against the gap, with a percentile-bootstrap 95 % interval and the
p-value of τ = 0 (:func:`quotient_manifolds.experiments.stats.kendall_tau`), printed as a table
and written to ``DIR/correlation.json``, and one scatter PNG per measure
(``DIR/scatter_<measure>.png``). ``gaps.csv`` has a header with the columns ``checkpoint`` and
``gap`` (others are ignored); ``checkpoint`` is the path as given to ``sharpness``, an absolute
path, or the file name without its suffix (the stem).

Bad input (a missing file, a factory that cannot be imported, a checkpoint whose keys do not
fit the model, a malformed gaps file) ends the command with a one-line error that names the
fix and exit status 2.
"""

from __future__ import annotations

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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from ..errors import PopulationInputError

__all__ = [
    "MEASURES",
    "PopulationInputError",
    "append_jsonl",
    "correlate",
    "default_loss",
    "evaluate_population",
    "format_table",
    "load_checkpoint",
    "load_factory",
    "read_gaps",
    "read_jsonl",
]

MEASURES = ("adaptive", "geodesic-inv", "geodesic-mix")
"""The default ``--measures``: adaptive sharpness (ℓ2, reference algorithm) and geodesic
sharpness with the ``inv`` or ``mix`` metric (second-order retraction). Any name of the
measure table :data:`quotient_manifolds.sharpness.measures.MEASURES` is accepted."""


# -- inputs ---------------------------------------------------------------------------------
def load_factory(spec: str, what: str) -> Callable:
    """Import ``module:function`` or ``path/to/file.py:function`` and return the callable.

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


def _call_factory(fn: Callable, spec: str, what: str):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - user code
        raise PopulationInputError(
            f"--{what} {spec!r} raised {type(e).__name__}: {e}; fix the factory (it is called "
            "with no arguments)"
        ) from None


def load_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The ``state_dict`` in ``path``: safetensors, or ``torch.load(weights_only=True)``.

    A dict holding the state under ``"state_dict"`` or ``"model"`` (a training checkpoint) is
    unwrapped. Files that need unsafe unpickling are refused.
    """
    p = Path(path)
    if not p.is_file():
        raise PopulationInputError(f"checkpoint {path} does not exist; check the path")
    with p.open("rb") as f:
        head = f.read(16)
    if p.suffix == ".safetensors" or (len(head) >= 9 and head[8:9] == b"{"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(p))
        except (SafetensorError, OSError, ValueError) as e:
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


def _check_fits(model: nn.Module, state: Mapping[str, torch.Tensor], path: str, spec: str):
    ref = model.state_dict()
    missing = [k for k in ref if k not in state]
    unexpected = [k for k in state if k not in ref]
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in ref.items()
              if k in state and tuple(state[k].shape) != tuple(v.shape)]

    def few(xs):
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


def default_loss(model: nn.Module, batch) -> torch.Tensor:
    r"""The loss used when no ``--loss`` is given.

    * dict batches with ``labels``: ``model(**batch).loss`` (Hugging Face models);
    * ``(x, y)`` batches: ``F.cross_entropy(model(x), y)``.
    """
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise PopulationInputError(
                "a dict batch without 'labels' has no default loss; add labels to the batches "
                "or pass --loss module:function (loss_fn(model, batch) -> scalar tensor)"
            )
        out = model(**batch)
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if loss is None:
            raise PopulationInputError(
                "model(**batch) returned no .loss; pass --loss module:function"
            )
        return loss
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)
    raise PopulationInputError(
        f"batches of type {type(batch).__name__} have no default loss (expected a dict with "
        "'labels' or an (x, y) pair); pass --loss module:function"
    )


def _to(batch, device, dtype):
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
def append_jsonl(path: str | os.PathLike, record: Mapping) -> None:
    """Append one JSON line with a single ``write``, then ``fsync`` (never half a line)."""
    data = (json.dumps(record, sort_keys=True, allow_nan=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: str | os.PathLike, *, repair: bool = False) -> list[dict]:
    """The records of a results file.

    A torn trailing line (no newline at the end: the writer died inside ``write``) is ignored,
    and with ``repair=True`` cut off the file. Any other line that is not a JSON object is an
    error that names the line.
    """
    p = Path(path)
    if not p.exists():
        return []
    raw = p.read_bytes()
    end = raw.rfind(b"\n") + 1
    if end < len(raw) and repair:
        with open(p, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    out = []
    for i, line in enumerate(raw[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict):
            raise PopulationInputError(
                f"{path} line {i} is not a JSON object; delete that line (the other lines are "
                "kept) and run again"
            )
        out.append(rec)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _key(record: Mapping) -> str:
    fields = ("path", "sha256", "measure", "rho", "n_iter", "seed", "kind", "model", "data",
              "loss", "dtype")
    blob = json.dumps({k: record.get(k) for k in fields}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _measure(name: str, model, loss_fn, data, rho: float, n_iter: int, seed: int):
    from ..sharpness.measures import MEASURES as TABLE

    return TABLE[name].run(model, loss_fn, data, rho=rho, n_iter=n_iter, seed=seed)


def evaluate_population(
    checkpoints: Sequence[str],
    *,
    model: str,
    data: str,
    out: str | os.PathLike,
    loss: str | None = None,
    measures: Sequence[str] = MEASURES,
    rho: float = 0.1,
    n_iter: int = 20,
    seed: int = 0,
    dtype: str | None = None,
    device: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> dict:
    """Measure every checkpoint with every measure; append one JSON line each to ``out``.

    Returns ``{"done": n_new, "skipped": n_skipped, "out": path}``. Pairs already in ``out``
    (same checkpoint file and content, measure and settings) are skipped.
    """
    from tqdm.auto import tqdm

    from ..sharpness.measures import MEASURES as TABLE

    bad = [m for m in measures if m not in TABLE]
    if bad or not measures:
        raise PopulationInputError(
            f"unknown measure(s) {', '.join(bad) or '(none)'}; choose from {', '.join(TABLE)}"
        )
    if not (isinstance(rho, (int, float)) and rho > 0 and math.isfinite(rho)):
        raise PopulationInputError(f"--rho {rho} must be a positive number, e.g. --rho 0.1")
    if n_iter < 1:
        raise PopulationInputError(f"--n-iter {n_iter} must be at least 1")
    if not checkpoints:
        raise PopulationInputError("no checkpoint given; pass checkpoint files after the options")
    paths = [Path(c) for c in checkpoints]
    for c, p in zip(checkpoints, paths):
        if not p.is_file():
            raise PopulationInputError(f"checkpoint {c} does not exist; check the path")
    out = Path(out)
    if out.exists() and out.is_dir():
        raise PopulationInputError(f"--out {out} is a folder; pass a file name, e.g. "
                                   f"{out / 'results.jsonl'}")
    if not out.parent.exists():
        raise PopulationInputError(f"--out {out}: folder {out.parent} does not exist; create it")
    model_fn = load_factory(model, "model")
    data_fn = load_factory(data, "data")
    loss_fn = load_factory(loss, "loss") if loss else default_loss
    torch_dtype = {None: None, "float32": torch.float32, "float64": torch.float64}[dtype]

    done = {r.get("key") for r in read_jsonl(out, repair=True)}
    base = dict(rho=float(rho), n_iter=int(n_iter), seed=int(seed), kind="worst", model=model,
                data=data, loss=loss or "default", dtype=dtype or "model")
    todo: list[tuple[int, list[dict]]] = []
    n_skip = 0
    for i, (c, p) in enumerate(zip(checkpoints, paths)):
        ident = dict(checkpoint=c, path=str(p.resolve()), stem=p.stem, sha256=_sha256(p))
        recs = []
        for m in measures:
            rec = {**ident, "measure": m, **base}
            rec["key"] = _key(rec)
            if rec["key"] in done:
                n_skip += 1
            else:
                recs.append(rec)
        if recs:
            todo.append((i, recs))
    n_todo = sum(len(r) for _, r in todo)
    if n_skip:
        log(f"{out}: {n_skip} result(s) already there, skipped; {n_todo} to compute")
    if not n_todo:
        return {"done": 0, "skipped": n_skip, "out": str(out)}

    net = _call_factory(model_fn, model, "model")
    if not isinstance(net, nn.Module):
        raise PopulationInputError(
            f"--model {model} returned a {type(net).__name__}, not a torch.nn.Module; return "
            "the model whose state_dict the checkpoints hold"
        )
    if torch_dtype is not None:
        net = net.to(torch_dtype)
    if device:
        net = net.to(device)
    for i, _ in todo:  # fail fast: every pending checkpoint must fit before any work starts
        _check_fits(net, load_checkpoint(paths[i]), checkpoints[i], model)

    n_new = 0
    bar = tqdm(total=n_todo, desc="sharpness", unit="measure", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    try:
        for i, recs in todo:
            net.load_state_dict(load_checkpoint(paths[i]), strict=True)
            for rec in recs:
                bar.set_postfix_str(f"{paths[i].name} {rec['measure']}")
                batches = _call_factory(data_fn, data, "data")
                if torch_dtype is not None or device:
                    batches = (_to(b, device, torch_dtype) for b in batches)
                t0 = time.perf_counter()
                with warnings.catch_warnings():
                    if n_new:  # the same fallbacks for every checkpoint: say it once
                        warnings.simplefilter("ignore", UserWarning)
                    res = _measure(rec["measure"], net, loss_fn, batches, float(rho), int(n_iter),
                                   int(seed))
                rec = {**rec, "value": res.value, "per_batch": res.per_batch,
                       "base_loss": sum(res.base_loss) / len(res.base_loss),
                       "n_batches": len(res.per_batch), "n_blocks": len(res.blocks),
                       "n_fallbacks": len(res.fallbacks),
                       "elapsed_s": round(time.perf_counter() - t0, 4),
                       "version": _version()}
                append_jsonl(out, rec)
                n_new += 1
                bar.update(1)
    finally:
        bar.close()
    return {"done": n_new, "skipped": n_skip, "out": str(out)}


def _version() -> str:
    from .. import __version__

    return __version__


# -- correlate ------------------------------------------------------------------------------
def read_gaps(path: str | os.PathLike) -> dict[str, float]:
    """``{checkpoint: gap}`` from a CSV file with the header columns ``checkpoint`` and ``gap``."""
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
        if k in gaps:
            return gaps[k]
    for k, v in gaps.items():  # paths relative to the CSV's folder, or stems
        if k == rec.get("stem") or str((gaps_dir / k).resolve()) == rec.get("path"):
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
    """Kendall τ (bootstrap CI) of every measure and radius in ``results`` against the gaps.

    Writes ``out/correlation.json`` and, with ``plots``, ``out/scatter_<measure>.png``; returns
    the dict of ``correlation.json``: ``{"rows": [{"measure", "rho", "tau", "ci95", "p_value",
    "n", ...}], "members": [...], "unmatched": [...], "figures": [...]}``.
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
    stems: dict[str, set] = {}
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
    names = sorted({k for m in mlist for k in m["measures"]},
                   key=lambda n: MEASURES.index(n) if n in MEASURES else len(MEASURES))
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    """The τ table of :func:`correlate` as text."""
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
