r"""The reproductions of the paper by command-line name, and a runner for several of them.

Every experiment is a module ``quotient_manifolds.experiments.<module>`` with

```python
run(out: str | os.PathLike, *, quick: bool = False, progress: bool = True) -> dict
```

which writes ``out/<name>/results.json``
([`summarize`][quotient_manifolds.experiments.report.summarize]) and its PNG figures, caches trained
members in a [`PopulationStore`][quotient_manifolds.experiments.store.PopulationStore], prints
nothing but tqdm progress (stderr), and returns the results dict.  Modules are imported lazily, only
when their experiment runs, so a missing or broken experiment never breaks the others.
"""

from __future__ import annotations

import importlib
import inspect
import os
import time
from collections.abc import Callable, Mapping, Sequence

from .._deps import install_hint, missing
from ..errors import QuotientManifoldError
from .report import tau_table

__all__ = [
    "EXPERIMENTS",
    "ExperimentUnavailableError",
    "combined_table",
    "load",
    "run_experiments",
]

#: command-line name -> module under ``quotient_manifolds.experiments``, in the ``all`` order.
EXPERIMENTS: dict[str, str] = {
    "diagonal": "diagonal",
    "toy": "toy",
    "invariance": "invariance",
    "grokking": "grokking",
    "vit-digits": "vit_digits",
    "lora-minilm": "lora_minilm",
    "smollm2": "smollm2",
    "minilm-finetune": "minilm_finetune",
    "vit-finetune": "vit_finetune",
    "seed-finetune": "seed_finetune",
    "minilm-soup": "minilm_soup",
}


class ExperimentUnavailableError(QuotientManifoldError, ImportError):
    """An experiment's module is missing or does not provide ``run(out, quick=, progress=)``."""


def load(name: str) -> Callable[..., dict]:
    """The ``run`` function of experiment ``name`` (a key of `EXPERIMENTS`).

    Raises
    ------
    ValueError
        ``name`` is not a known experiment.
    ExperimentUnavailableError
        Its module is not installed in this checkout, has no ``run``, or an optional package
        that it lists in ``REQUIRES`` is not installed (the message says what to install).
    """
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}")
    modname = f"{__package__}.{EXPERIMENTS[name]}"
    try:
        mod = importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name != modname:  # the module exists but one of its own imports is missing
            raise ExperimentUnavailableError(
                f"experiment {name!r} needs the package {e.name!r}, which is not installed; "
                "run `make install` (or pip install -c constraints.txt -e '.[hf,vision,plots]')"
            ) from e
        raise ExperimentUnavailableError(
            f"experiment {name!r} is not available in this checkout: module {modname} is "
            "missing. Run another experiment, or update the checkout."
        ) from e
    absent = missing(getattr(mod, "REQUIRES", ()))
    if absent:
        raise ExperimentUnavailableError(
            f"experiment {name!r} needs {', '.join(absent)}, which "
            f"{'is' if len(absent) == 1 else 'are'} not installed; "
            + "; ".join(dict.fromkeys(install_hint(n) for n in absent))
        )
    run = getattr(mod, "run", None)
    if not callable(run):
        raise ExperimentUnavailableError(
            f"module {modname} has no run(out, *, quick, progress) function; it cannot be "
            "reproduced from the command line yet"
        )
    return run


def run_experiments(
    names: Sequence[str],
    out: str | os.PathLike,
    *,
    quick: bool = False,
    progress: bool = True,
    weights: str | os.PathLike | None = None,
) -> dict[str, dict]:
    """Run the experiments ``names`` (``"all"`` expands to every one, in order).

    Returns ``{name: results}``; each results dict also gets ``"wall_s"``, the run's
    wall-clock seconds.  Unknown or unavailable experiments raise before anything runs.
    ``weights``: the folder for the trained weights of the experiments whose ``run`` takes
    ``weights=`` (the records stay under ``out``); a ``ValueError`` for any other.
    """
    expanded: list[str] = []
    for n in names:
        for m in (EXPERIMENTS if n == "all" else [n]):
            if m not in expanded:
                expanded.append(m)
    runners = {n: load(n) for n in expanded}
    if weights is not None:
        cannot = [n for n, r in runners.items()
                  if "weights" not in inspect.signature(r).parameters]
        if cannot:
            raise ValueError(f"--weights is not supported by {', '.join(cannot)}; it is for "
                             f"{', '.join(n for n in runners if n not in cannot) or 'none'}"
                             " of these (drop it, or run those experiments separately)")
    results: dict[str, dict] = {}
    for n, run in runners.items():
        t0 = time.perf_counter()
        res = run(out, quick=quick, progress=progress,
                  **({} if weights is None else {"weights": weights}))
        res = dict(res)
        res["wall_s"] = time.perf_counter() - t0
        results[n] = res
    return results


def combined_table(results: Mapping[str, Mapping]) -> str:
    """The τ tables of several experiments, one after the other."""
    return "\n\n".join(tau_table(r) for r in results.values())
