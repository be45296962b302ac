r"""Sharpness of a population of checkpoints, and its rank correlation with a gap.

The work behind two subcommands of `quotient-manifolds` (user guide: the
[command line](../cli.md) and [distributed](../distributed.md) pages), in four parts:

* [`runner`][quotient_manifolds.experiments.population.runner]:
  [`evaluate_population`][quotient_manifolds.experiments.population.runner.evaluate_population]
  appends one JSON line per (checkpoint, measure) to a results file. Checkpoints are Hugging
  Face folders (`config.json` + `model.safetensors`, as `save_pretrained` writes them;
  [`hf_checkpoints`][quotient_manifolds.experiments.hf_checkpoints]), or, with a model factory
  (`model="module:function"`), `state_dict` files. The batches are a safetensors file of fixed
  batches ([`BatchFile`][quotient_manifolds.experiments.population.runner.BatchFile]) or a
  factory returning an iterable of batches (`data="module:function"`).
* [`inputs`][quotient_manifolds.experiments.population.inputs]: the factories, the
  `state_dict` files (`.safetensors`, or files that `torch.load(path, weights_only=True)`
  reads: nothing is unpickled unsafely) and the default loss.
* [`results_file`][quotient_manifolds.experiments.population.results_file] and
  [`ranks`][quotient_manifolds.experiments.population.ranks]: the lines are written by a
  [`ResultsFile`][quotient_manifolds.experiments.population.results_file.ResultsFile] (one
  `write` + `fsync` under an exclusive file lock), so several processes can append to one
  file, a crash or Ctrl-C loses no finished line, and a torn trailing line is cut off by the
  next writer. Under `torchrun` (the environment variables `RANK` and `WORLD_SIZE`), each rank
  takes its share of the pairs
  ([`assigned_pairs`][quotient_manifolds.experiments.population.ranks.assigned_pairs]); no
  process group is created, and the sharpness engine runs on each rank alone.
* [`analysis`][quotient_manifolds.experiments.population.analysis]:
  [`correlate`][quotient_manifolds.experiments.population.analysis.correlate], the Kendall
  τ-b of each measure (and radius) against a gap, with bootstrap intervals and scatter plots.

Bad input (a missing file, a factory that cannot be imported, a checkpoint that does not fit
the model, a malformed gaps file) raises
[`PopulationInputError`][quotient_manifolds.errors.PopulationInputError], whose message names
the parameter at fault (`model=…`, `rho=…`); the command line prints it as one line, in its
own flags (`--model …`, `--rho …`), and exits with status 2.
"""

from ...errors import PopulationInputError
from .analysis import correlate, format_table, read_gaps
from .inputs import call_factory, check_fits, default_loss, load_checkpoint, load_factory
from .ranks import assigned_pairs, distributed_rank, rank_device
from .results_file import ResultsFile, append_jsonl, read_jsonl
from .runner import (
    DEFAULT_MEASURES,
    SEED_MAX,
    BatchFile,
    MeasureSettings,
    evaluate_population,
)

__all__ = [
    "DEFAULT_MEASURES",
    "SEED_MAX",
    "BatchFile",
    "MeasureSettings",
    "PopulationInputError",
    "ResultsFile",
    "append_jsonl",
    "assigned_pairs",
    "call_factory",
    "check_fits",
    "correlate",
    "default_loss",
    "distributed_rank",
    "evaluate_population",
    "format_table",
    "load_checkpoint",
    "load_factory",
    "rank_device",
    "read_gaps",
    "read_jsonl",
]
