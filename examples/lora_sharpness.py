"""Geodesic vs adaptive sharpness of a peft LoRA model, and their invariance.

A small BERT classifier (randomly initialised, built offline from a ``BertConfig``) gets LoRA
adapters of rank r on ``query`` and ``value`` (``peft.get_peft_model``), and the adapters are
trained for a few steps on a synthetic token task (peft initialises ``B = 0``, a rank-deficient
block; training makes it full rank). Every adapter ``B A`` is a GL(r) block, ``G = B``,
``H = Aᵀ``; the wrapped ``query``/``value`` projections lose their own GL(d_head) symmetry,
which the result records as fallbacks. Only the parameters peft leaves trainable
(``requires_grad=True``: the adapters and the classifier head) are perturbed, the default of
``params=``. Then every block is moved by a random group element (``qm.reparametrize``: the
same function) and both measures are computed again::

    python examples/lora_sharpness.py [--small]
"""

from __future__ import annotations

import argparse
import warnings

import torch
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertForSequenceClassification

import quotient_manifolds as qm


def build(rank: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=layers,
                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=16,
                     num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    base = BertForSequenceClassification(cfg)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["query", "value"],
                      lora_dropout=0.0, task_type="SEQ_CLS")
    return get_peft_model(base, lora).double()


def batches(n: int, size: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 50, (size, 10), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                    "labels": (ids[:, 0] < ids[:, -1]).long()})  # compare first and last token
    return out


def loss_fn(model, batch):
    return model(**batch).loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="1 layer, 3 APGD steps (CI)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    layers, steps, n_iter = (1, 30, 3) if args.small else (2, 200, 20)
    model = build(rank=4, layers=layers)
    train = batches(4, 16, seed=0)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(steps):
        b = train[step % len(train)]
        opt.zero_grad()
        loss_fn(model, b).backward()
        opt.step()
    model.eval()
    print(f"adapter training: {steps} steps, last loss {loss_fn(model, train[0]).item():.4f}")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        blocks = qm.discover_blocks(model)
    for b in blocks:
        d = b.describe()
        print(f"block {d['kind']:<13} heads={d['heads']} h={d['h']} n={d['n']} m={d['m']}  "
              f"{d['module']}")
    for w in caught:
        print(f"{type(w.message).__name__}: {str(w.message)[:150]}")

    data = batches(1 if args.small else 2, 16, seed=1)
    rho = 0.05
    kw = dict(rho=rho, n_iter=n_iter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qm.SymmetryFallbackWarning)  # printed above
        geo = qm.geodesic_sharpness(model, loss_fn, data, **kw)
        ada = qm.adaptive_sharpness(model, loss_fn, data, **kw)
        print(f"geodesic sharpness (inv, rho={rho}): {geo.value:.6g}   "
              f"({len(geo.blocks)} block specs, {len(geo.fallbacks)} fallbacks)")
        print(f"adaptive sharpness (l2,  rho={rho}): {ada.value:.6g}")
        moved = qm.reparametrize(model, a=10.0, generator=torch.Generator().manual_seed(0),
                                 symmetry="paper")  # a random GL(r) element per adapter
        x = data[0]
        diff = (moved(**x).logits - model(**x).logits).abs().max().item()
        geo2 = qm.geodesic_sharpness(moved, loss_fn, data, **kw)
        ada2 = qm.adaptive_sharpness(moved, loss_fn, data, **kw)
    print(f"after reparametrize(a=10): max |logit change| {diff:.1e}; geodesic ratio "
          f"{geo2.value / geo.value:.6f}, adaptive ratio {ada2.value / ada.value:.4g}")


if __name__ == "__main__":
    main()
