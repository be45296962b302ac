r"""Sharpness of a population of checkpoints: one JSON line per (checkpoint, measure).

[`evaluate_population`][quotient_manifolds.experiments.population.runner.evaluate_population]
measures every checkpoint with every measure of a
[`MeasureSettings`][quotient_manifolds.experiments.population.runner.MeasureSettings] and
appends the results to a
[`ResultsFile`][quotient_manifolds.experiments.population.results_file.ResultsFile]. The
batches are a [`BatchFile`][quotient_manifolds.experiments.population.runner.BatchFile] (fixed
batches, cut from a safetensors file) or a factory `"module:function"`. A re-run with the same
settings skips every pair already in the file (the line's key hashes the checkpoint path and
content, the measure and every setting).
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import PopulationInputError, QuotientManifoldError
from ...sharpness.measures import MEASURES
from ...tree import tree_map
from ..hf_checkpoints import (
    check_batch_keys,
    check_hf_checkpoint,
    checkpoint_sha256,
    load_batches,
    load_hf_model,
)
from .inputs import (
    call_factory,
    check_fits,
    check_out_file,
    default_loss,
    load_checkpoint,
    load_factory,
)
from .ranks import assigned_pairs, distributed_rank, rank_device
from .results_file import ResultsFile

__all__ = ["DEFAULT_MEASURES", "SEED_MAX", "BatchFile", "MeasureSettings", "evaluate_population"]

DEFAULT_MEASURES = ("adaptive", "geodesic-inv-complete", "geodesic-mix-complete")
"""The default measures: adaptive sharpness (Eq. 1, ℓ2 ball, reference algorithm) and
geodesic sharpness (Eq. 4) with the `inv` or `mix` metric, the second-order retraction
(Eq. 5) and every symmetry the library recognises (the library's default; `geodesic-inv` and
`geodesic-mix` are the paper's measure, GL(h) per head). Any name of the measure table
[`MEASURES`][quotient_manifolds.sharpness.measures.MEASURES] may be asked for."""

SEED_MAX = 2**63 - 1
"""The largest seed (`torch.Generator.manual_seed` takes 0 to 2**63-1)."""

_DTYPES = {None: None, "float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class MeasureSettings:
    r"""What every (checkpoint, measure) pair of a population computes.

    Attributes
    ----------
    measures : tuple of str
        Names of the measure table
        ([`MEASURES`][quotient_manifolds.sharpness.measures.MEASURES]), each once; default
        [`DEFAULT_MEASURES`][quotient_manifolds.experiments.population.runner.DEFAULT_MEASURES].
    rho : float
        The radius $\rho$ of every measurement.
    n_iter : int
        Auto-PGD iterations (the samples of an average-case measure).
    seed : int
        The seed of every measurement, 0 to
        [`SEED_MAX`][quotient_manifolds.experiments.population.runner.SEED_MAX] (2**63-1).

    Raises
    ------
    PopulationInputError
        A measure that is not in the table or is named twice, a radius that is not a positive
        number, `n_iter` that is not an integer from 1, or a seed outside 0 to 2**63-1.
    """

    measures: tuple[str, ...] = DEFAULT_MEASURES
    rho: float = 0.1
    n_iter: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "measures", tuple(self.measures))
        bad = [m for m in self.measures if m not in MEASURES]
        if bad or not self.measures:
            raise PopulationInputError(
                f"unknown measure(s) {', '.join(bad) or '(none)'}; choose from "
                f"{', '.join(MEASURES)}"
            )
        if len(set(self.measures)) != len(self.measures):
            raise PopulationInputError(
                f"measures {', '.join(self.measures)} name one twice; keep one")
        rho = self.rho
        if not (isinstance(rho, (int, float)) and rho > 0 and math.isfinite(rho)):
            raise PopulationInputError(f"rho={rho} must be a positive number, e.g. rho=0.1")
        if not _is_int(self.n_iter) or self.n_iter < 1:
            raise PopulationInputError(
                f"n_iter={self.n_iter!r} must be at least 1 (an integer, e.g. n_iter=20)")
        if not _is_int(self.seed) or not 0 <= self.seed <= SEED_MAX:
            raise PopulationInputError(
                f"seed={self.seed!r} must be an integer from 0 to 2**63-1 = {SEED_MAX}, "
                "e.g. seed=0")


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass(frozen=True)
class BatchFile:
    """Fixed batches: the rows of a safetensors file, `batch_size` per batch, in stored order
    ([`load_batches`][quotient_manifolds.experiments.hf_checkpoints.load_batches]).

    Attributes
    ----------
    path : path
        The safetensors file (`input_ids`, `attention_mask`, `labels`, or `pixel_values`,
        `labels`, …: one row per example).
    batch_size : int
        Rows per batch; the last batch holds the remainder.
    """

    path: str | os.PathLike
    batch_size: int

    def __post_init__(self) -> None:
        if self.batch_size is None:
            raise PopulationInputError("a batches file needs batch_size=N (rows per batch)")


def evaluate_population(
    checkpoints: Sequence[str],
    *,
    out: str | os.PathLike,
    data: str | BatchFile,
    model: str | None = None,
    loss: str | None = None,
    settings: MeasureSettings | None = None,
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
    data : str or BatchFile
        The batches: a factory `"module:function"` returning an iterable of batches (called
        once per measurement), or a
        [`BatchFile`][quotient_manifolds.experiments.population.runner.BatchFile].
    model : str, optional
        `module:function` returning the `nn.Module` that the `state_dict` files fit.
    loss : str, optional
        `module:function`, `loss_fn(model, batch) -> scalar`; default
        [`default_loss`][quotient_manifolds.experiments.population.inputs.default_loss].
    settings : MeasureSettings, optional
        The measures, radius, iterations and seed (default: `MeasureSettings()`).
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

    Raises
    ------
    PopulationInputError
        A missing file, a factory that cannot be imported, a checkpoint that does not fit the
        model, batches that do not fit it; the message names the parameter and the fix.

    Notes
    -----
    Under `torchrun` each rank computes only its
    [`assigned_pairs`][quotient_manifolds.experiments.population.ranks.assigned_pairs] and
    appends to the same file.
    """
    from tqdm.auto import tqdm

    run = _Run(checkpoints, out, data, model, loss, settings or MeasureSettings(), dtype,
               device)
    results = ResultsFile(run.out)
    results.refresh()  # cuts off a torn trailing line
    todo, n_skip = run.pending(results)
    n_todo = sum(len(r) for r in todo.values())
    who = f"rank {run.rank}/{run.world}: " if run.world > 1 else ""
    if n_skip:
        log(f"{who}{run.out}: {n_skip} result(s) already there, skipped; {n_todo} to compute")
    summary = {"done": 0, "skipped": n_skip, "out": str(run.out), "rank": run.rank,
               "world_size": run.world, "assigned": n_skip + n_todo}
    if not n_todo:
        return summary
    net = run.factory_model(todo)
    n_new = 0

    def warned() -> bool:
        return n_new > 0

    desc = "sharpness" + (f" rank 0/{run.world}" if run.world > 1 else "")
    bar = tqdm(total=n_todo, desc=desc, unit="measure", disable=not progress or run.rank != 0,
               file=sys.stderr, dynamic_ncols=True)
    try:
        for i, recs in todo.items():
            for rec in run.measure(i, net, recs, bar, quiet=warned):
                if results.append(rec):
                    n_new += 1
                else:  # another process wrote this pair meanwhile (two runs at once)
                    n_skip += 1
                bar.update(1)
    finally:
        bar.close()
    summary.update(done=n_new, skipped=n_skip)
    return summary


class _Run:
    """The checked inputs of one
    [`evaluate_population`][quotient_manifolds.experiments.population.runner.evaluate_population]
    call, and its steps."""

    def __init__(self, checkpoints: Sequence[str], out: str | os.PathLike, data: str | BatchFile,
                 model: str | None, loss: str | None, settings: MeasureSettings,
                 dtype: str | None, device: str | None) -> None:
        if not checkpoints:
            raise PopulationInputError("no checkpoint given; pass at least one checkpoint")
        if not isinstance(data, (str, BatchFile)):
            raise PopulationInputError(
                f"data is a {type(data).__name__}; pass a factory 'module:function' or a "
                "BatchFile(path, batch_size)"
            )
        if dtype not in _DTYPES:
            raise PopulationInputError(f"dtype={dtype!r} is not one of float32, float64")
        self.checkpoints, self.settings, self.model_spec = list(checkpoints), settings, model
        self.hf = model is None
        self.paths, self.archs = self._checked_checkpoints()
        self.out = check_out_file(out)  # before any work: no measurement is lost to it
        self.rank, self.world = distributed_rank()
        self.device = rank_device(device, self.world)
        self.model_fn = load_factory(model, "model") if model else None
        self.data_spec = data if isinstance(data, str) else None
        self.data_fn = load_factory(data, "data") if isinstance(data, str) else None
        self.loss_fn = load_factory(loss, "loss") if loss else default_loss
        self.dtype = _DTYPES[dtype]
        self.base: dict[str, Any] = dict(
            rho=float(settings.rho), n_iter=int(settings.n_iter), seed=int(settings.seed),
            model=model or "hf", data=self.data_spec, loss=loss or "default",
            dtype=dtype or "model")
        self.fixed: list | None = None
        if isinstance(data, BatchFile):
            self.fixed = load_batches(data.path, int(data.batch_size), dtype=self.dtype)
            self.base.update(data=str(Path(data.path).resolve()),
                             batch_size=int(data.batch_size),
                             batches_sha256=checkpoint_sha256(data.path))
        self.data_name = str(data.path) if isinstance(data, BatchFile) else f"data={data}"

    def _checked_checkpoints(self) -> tuple[list[Path], dict[int, str]]:
        paths = [Path(c) for c in self.checkpoints]
        archs: dict[int, str] = {}
        for i, (c, p) in enumerate(zip(self.checkpoints, paths)):
            if self.hf:
                archs[i] = check_hf_checkpoint(c)
            elif p.is_dir():
                raise PopulationInputError(
                    f"checkpoint {c} is a folder; with model= pass state_dict files, or drop "
                    "model= to load Hugging Face checkpoint folders"
                )
            elif not p.is_file():
                raise PopulationInputError(f"checkpoint {c} does not exist; check the path")
        return paths, archs

    def pending(self, results: ResultsFile) -> tuple[dict[int, list[dict]], int]:
        """The records still to compute of this rank's pairs, by checkpoint, and the number of
        pairs already in `results`."""
        todo: dict[int, list[dict]] = {}
        n_skip = 0
        measures = self.settings.measures
        ident: dict[str, Any] = {}
        for i, j in assigned_pairs(len(self.checkpoints), len(measures), self.rank, self.world):
            c, p = self.checkpoints[i], self.paths[i]
            if i not in todo:
                todo[i] = []
                ident = dict(checkpoint=c, path=str(p.resolve()),
                             stem=p.name if p.is_dir() else p.stem, sha256=checkpoint_sha256(p))
                if self.hf:
                    ident["architecture"] = self.archs[i]
            # the measure's own kind: worst case (Auto-PGD) or average case (Gaussian samples)
            rec = {**ident, "measure": measures[j], "kind": MEASURES[measures[j]].kind,
                   **self.base}
            rec["key"] = _key(rec)
            if rec["key"] in results.keys:
                n_skip += 1
            else:
                todo[i].append(rec)
        return {i: recs for i, recs in todo.items() if recs}, n_skip

    def factory_model(self, todo: Mapping[int, list[dict]]) -> nn.Module | None:
        """The model of the factory (None for Hugging Face folders), checked against every
        pending checkpoint before any work starts."""
        if self.model_fn is None:
            return None
        spec = self.model_spec
        assert spec is not None
        net = call_factory(self.model_fn, spec, "model")
        if not isinstance(net, nn.Module):
            raise PopulationInputError(
                f"model={spec} returned a {type(net).__name__}, not a torch.nn.Module; "
                "return the model whose state_dict the checkpoints hold"
            )
        if self.dtype is not None:
            net = net.to(self.dtype)
        if self.device:
            net = net.to(self.device)
        for i in todo:
            check_fits(net, load_checkpoint(self.paths[i]), self.checkpoints[i], spec)
        return net

    def batches(self, float_dtype: torch.dtype | None) -> Iterable:
        """The batches of one measurement: the fixed ones in `float_dtype` (the model's), or
        a fresh call of the factory."""
        if self.fixed is not None:
            return [_moved(b, self.device, float_dtype) for b in self.fixed]
        assert self.data_fn is not None and self.data_spec is not None
        got = call_factory(self.data_fn, self.data_spec, "data")
        if self.dtype is not None or self.device:
            return (_moved(b, self.device, self.dtype) for b in got)
        return got

    def measure(self, i: int, net: nn.Module | None, recs: Sequence[dict], bar: Any,
                quiet: Callable[[], bool]) -> Iterable[dict]:
        """The finished records of checkpoint `i`, one per pending measure (`quiet()`: the
        engine's fallback warnings were already shown once)."""
        s = self.settings
        if net is None:
            cur = load_hf_model(self.paths[i], dtype=self.dtype, device=self.device)
        else:
            net.load_state_dict(load_checkpoint(self.paths[i]), strict=True)
            cur = net
        float_dtype = self.dtype or next(
            (q.dtype for q in cur.parameters() if q.is_floating_point()), None)
        first = True
        for rec in recs:
            bar.set_postfix_str(f"{self.paths[i].name} {rec['measure']}")
            batch_list = self.batches(float_dtype)
            if first:
                batch_list = list(batch_list)
                if not batch_list:
                    raise PopulationInputError(f"{self.data_name} yields no batch; pass data")
                if self.hf:  # HF models are in eval mode: a forward changes no buffer
                    where = f"checkpoint {self.checkpoints[i]}"
                    check_batch_keys(cur, batch_list[0], where)
                    _probe(cur, self.loss_fn, batch_list[0], self.checkpoints[i],
                           self.data_name)
                first = False
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                if quiet():  # the same fallbacks for every checkpoint: say it once
                    warnings.simplefilter("ignore", UserWarning)
                res = MEASURES[rec["measure"]].run(cur, self.loss_fn, batch_list,
                                                   rho=float(s.rho), n_iter=int(s.n_iter),
                                                   seed=int(s.seed))
            rec = {**rec, "value": res.value, "per_batch": res.per_batch,
                   "base_loss": sum(res.base_loss) / len(res.base_loss),
                   "n_batches": len(res.per_batch), "n_blocks": len(res.blocks),
                   "n_fallbacks": len(res.fallbacks),
                   "elapsed_s": round(time.perf_counter() - t0, 4),
                   "version": _version()}
            if self.world > 1:
                rec.update(rank=self.rank, world_size=self.world)
            yield rec


def _moved(batch: Any, device: str | torch.device | None, dtype: torch.dtype | None) -> Any:
    """`batch` with its floating tensors in `dtype` and every tensor on `device` (None: as
    they are)."""
    def move(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        return t.to(device) if device is not None else t

    return tree_map(move, batch)


def _key(record: Mapping) -> str:
    fields = ("path", "sha256", "measure", "rho", "n_iter", "seed", "kind", "model", "data",
              "loss", "dtype")
    optional = ("batch_size", "batches_sha256")  # hashed only when set (older files keep keys)
    blob = json.dumps({**{k: record.get(k) for k in fields},
                       **{k: record[k] for k in optional if k in record}},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _probe(net: nn.Module, loss_fn: Callable, batch: Any, ckpt: str, data: str) -> None:
    """The loss of the first batch, once per checkpoint: input errors say what does not fit."""
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


def _version() -> str:
    from ... import __version__

    return __version__
