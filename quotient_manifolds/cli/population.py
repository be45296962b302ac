"""The `sharpness` and `correlate` subcommands of `quotient-manifolds` (docs/cli.md).

The work is done by [`population`][quotient_manifolds.experiments.population]; this module
only parses arguments, sets the thread count and turns errors into exit codes, with the
library's parameter names in their messages spelled as flags (`n_iter=3` as `--n-iter 3`).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import (
    InvalidArgumentError,
    MissingDependencyError,
    PopulationInputError,
    QuotientManifoldError,
)
from ..experiments.population import (
    DEFAULT_MEASURES,
    SEED_MAX,
    BatchFile,
    MeasureSettings,
    correlate,
    evaluate_population,
    format_table,
    read_jsonl,
)
from ..sharpness.measures import MEASURES

__all__ = ["add_subcommands"]


#: the library's parameters and functions that the command line names otherwise
_FLAGS = {"model": "--model", "data": "--data", "loss": "--loss", "batch_size": "--batch-size",
          "rho": "--rho", "n_iter": "--n-iter", "out": "--out", "seed": "--seed",
          "n_boot": "--n-boot"}
_PARAMETER = re.compile(r"(?<![\w.])(" + "|".join(_FLAGS) + r")=")
#: more threads than any machine has cores (torch takes up to 2**31-1, then tries to start them)
_THREADS_MAX = 1024
_NAMES = (("plots=False", "--no-plots"), ("evaluate_population", "'quotient-manifolds sharpness'"))


def _as_flags(message: str) -> str:
    """`message` with the library's names in command-line terms: `rho=0.1` as `--rho 0.1`."""
    message = _PARAMETER.sub(lambda m: f"{_FLAGS[m[1]]} ", message)
    for name, flag in _NAMES:
        message = message.replace(name, flag)
    return message


# -- command line ---------------------------------------------------------------------------
def _measures_arg(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    known = list(MEASURES)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown measure(s) {', '.join(bad) or '(none)'}; choose from {', '.join(known)}"
        )
    return names


def _count(example: int, most: int | None = None) -> Callable[[str], int]:
    """An argparse `type=` accepting the integers from 1 (to `most`); `example` goes into the
    message."""
    accepted = f"1 to {most}" if most is not None else "1 or more"

    def count(text: str) -> int:
        try:
            v = int(text)
        except ValueError:  # also the digits beyond int's limit
            v = 0
        if v < 1 or (most is not None and v > most):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a positive integer; pass {accepted} (e.g. {example})")
        return v

    return count


def _seed(text: str) -> int:
    """An argparse `type=` accepting the seeds of torch's generators: 0 to 2**63-1."""
    try:
        v = int(text)
    except ValueError:
        v = -1
    if not 0 <= v <= SEED_MAX:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a seed; pass an integer from 0 to 2**63-1 = {SEED_MAX} (e.g. 0)")
    return v


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number (e.g. 0.1)")
    return v


def _fail(cmd: str, e: BaseException) -> int:
    msg = " ".join(_as_flags(str(e)).split())
    print(f"quotient-manifolds {cmd}: error: {msg}", file=sys.stderr)
    return 2


def _run_sharpness(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    # checkpoints and batches are local files: never reach for the Hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        settings = MeasureSettings(measures=tuple(args.measures), rho=args.rho,
                                   n_iter=args.n_iter, seed=args.seed)
        if args.batches is not None and args.batch_size is None:
            raise PopulationInputError("--batches needs --batch-size N (rows per batch)")
        data = BatchFile(args.batches, args.batch_size) if args.batches is not None else args.data
        info = evaluate_population(
            args.checkpoints, out=args.out, data=data, model=args.model, loss=args.loss,
            settings=settings, dtype=args.dtype, device=args.device,
            progress=not args.no_progress,
        )
    except (PopulationInputError, MissingDependencyError) as e:
        return _fail("sharpness", e)
    except QuotientManifoldError as e:
        print(f"quotient-manifolds sharpness: error: {' '.join(str(e).split())} "
              f"(finished results are kept in {args.out})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        n = len(read_jsonl(args.out)) if Path(args.out).is_file() else 0
        print(f"\nquotient-manifolds sharpness: interrupted; {n} finished result(s) are in "
              f"{args.out}; run the same command again to resume", file=sys.stderr)
        return 130
    who = f"rank {info['rank']}/{info['world_size']}: " if info["world_size"] > 1 else ""
    print(f"{who}{info['done']} new result(s), {info['skipped']} skipped: {info['out']}")
    return 0


def _run_correlate(args: argparse.Namespace) -> int:
    try:
        if not Path(args.results).is_file():
            raise PopulationInputError(f"results file {args.results} does not exist; run "
                                       "'quotient-manifolds sharpness ... --out FILE' first")
        blob = correlate(args.results, args.gaps, args.out, n_boot=args.n_boot,
                         plots=not args.no_plots)
    except (PopulationInputError, InvalidArgumentError, MissingDependencyError) as e:
        return _fail("correlate", e)
    print(format_table(blob))
    for f in blob["figures"]:
        print(f"figure: {f}")
    print(f"table: {Path(args.out if args.out is not None else Path(args.results).parent)}"
          "/correlation.json")
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Add ``sharpness`` and ``correlate`` to the ``quotient-manifolds`` parser."""
    s = sub.add_parser(
        "sharpness", help="sharpness of a population of checkpoints, one JSON line each",
        description="Evaluate sharpness measures on checkpoints: Hugging Face folders "
        "(config.json + model.safetensors), or state_dict files with --model. Append one JSON "
        "line per (checkpoint, measure) to --out; re-running the same command resumes. Under "
        "torchrun the ranks share the work.",
    )
    s.add_argument("checkpoints", nargs="+", metavar="CKPT",
                   help="Hugging Face checkpoint folders (save_pretrained), or, with --model, "
                   ".safetensors / torch.save(state_dict) files")
    s.add_argument("--model", metavar="MODULE:FUNCTION",
                   help="function returning the nn.Module that state_dict checkpoints fit "
                   "(omit for Hugging Face folders)")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--batches", metavar="FILE",
                     help="safetensors file of input_ids/attention_mask/labels or "
                     "pixel_values/labels (one row per example), cut into --batch-size rows")
    src.add_argument("--data", metavar="MODULE:FUNCTION",
                     help="function returning an iterable of batches (called per measurement)")
    s.add_argument("--batch-size", type=_count(8), metavar="N", help="rows per batch of --batches")
    s.add_argument("--loss", metavar="MODULE:FUNCTION",
                   help="loss_fn(model, batch) -> scalar; default: the model's .loss (or "
                   "cross-entropy of .logits) for dict batches with labels, "
                   "cross_entropy(model(x), y) for (x, y) batches")
    s.add_argument("--measures", type=_measures_arg, default=list(DEFAULT_MEASURES),
                   help=f"comma-separated, from {','.join(MEASURES)} (default: "
                   f"{','.join(DEFAULT_MEASURES)})")
    s.add_argument("--rho", type=_positive, default=0.1, help="radius of the ball (default 0.1)")
    s.add_argument("--n-iter", type=_count(20), default=20,
                   help="APGD iterations, or samples of an average measure (default 20)")
    s.add_argument("--seed", type=_seed, default=0,
                   help="seed of the average measures' samples, 0 to 2**63-1 (default 0)")
    s.add_argument("--out", default="results.jsonl", help="results file (default results.jsonl)")
    s.add_argument("--dtype", choices=["float32", "float64"],
                   help="convert the model and floating batch tensors (default: as stored)")
    s.add_argument("--device", help="e.g. cuda (under torchrun: cuda:LOCAL_RANK); default: "
                   "the CPU, or where the model factory puts it")
    s.add_argument("--threads", type=_count(4, _THREADS_MAX),
                   help=f"torch.set_num_threads, 1 to {_THREADS_MAX} (default: torch's)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=_run_sharpness)

    c = sub.add_parser(
        "correlate", help="Kendall tau of each measure against a gap, with scatter plots",
        description="Kendall tau-b (bootstrap 95%% CI, p-value) of every measure in a results "
        "file against the gaps of a CSV file with columns checkpoint,gap.",
    )
    c.add_argument("results", help="results file of 'quotient-manifolds sharpness'")
    c.add_argument("gaps", help="CSV with a header 'checkpoint,gap'; checkpoint = path, file "
                   "stem or folder name")
    c.add_argument("--out", help="folder for correlation.json and the PNGs (default: the "
                   "results file's folder)")
    c.add_argument("--n-boot", type=_count(2000), default=2000,
                   help="bootstrap resamples, 1 or more (default 2000)")
    c.add_argument("--no-plots", action="store_true", help="skip the scatter PNGs")
    c.set_defaults(func=_run_correlate)
