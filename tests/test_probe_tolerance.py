"""Fold probes far along an orbit: the tolerance follows the copy's rounding noise, so an exact
symmetry is still confirmed where a fixed 1e-10 rejects it (float64, tiny BERT)."""

from __future__ import annotations

import torch
from model_zoo import bert_data, hf_loss, small_bert

import quotient_manifolds as qm
from quotient_manifolds.models.prober import Prober
from quotient_manifolds.models.records import PROBE_RTOL


def _inputs(batch):
    return ((), {k: v for k, v in batch.items() if k != "labels"})


def test_far_along_the_orbit_the_same_folds_are_confirmed():
    model = small_bert().double().eval()
    batch = bert_data(n_batches=1)[0]
    kw = dict(loss_fn=hf_loss, batch=batch, warn=False)
    near = qm.discover(model, **kw)
    moved = qm.reparametrize(model, a=100.0, generator=torch.Generator().manual_seed(11),
                             loss_fn=hf_loss, batch=batch)
    far = qm.discover(moved, **kw)
    assert len(near.folds) > 20
    assert sorted(f.kind for f in far.folds) == sorted(f.kind for f in near.folds)
    # the tolerance rose with the noise there, and only there
    assert Prober(model, _inputs(batch)).fold_tolerance == PROBE_RTOL
    assert Prober(moved, _inputs(batch)).fold_tolerance > PROBE_RTOL


def test_the_rounding_tolerance_still_rejects_a_broken_symmetry():
    """A one-sided translation (a writer moved along 1 without its LayerNorm: here the
    classifier, which reads the pooled output) changes the output far above the raised
    tolerance."""
    model = small_bert().double().eval()
    batch = bert_data(n_batches=1)[0]
    moved = qm.reparametrize(model, a=100.0, generator=torch.Generator().manual_seed(11))
    p = Prober(moved, _inputs(batch))
    w = p.params["classifier.weight"]
    broken = {**p.params, "classifier.weight": w + torch.ones_like(w) * w.abs().mean()}
    assert p.change(broken) > 1e4 * p.fold_tolerance
