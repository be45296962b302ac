"""SmolLM2-135M under the complete group: geodesic sharpness is invariant under a random element.

Slow (the GGUF file is dequantised on load, and the complete group's discovery probes a float64
copy of the whole model): run with `-m slow`. The measured ratio is recorded on
docs/symmetries.md.
"""

from __future__ import annotations

import copy
import time
from collections import Counter

import pytest
import torch

from quotient_manifolds.experiments import smollm2

RHO, N_ITER, A, SEED = 0.05, 3, 10.0, 0


@pytest.fixture(scope="module")
def smol64():
    pytest.importorskip("gguf")
    try:
        smollm2.model_dir()
    except Exception as e:  # noqa: BLE001
        pytest.skip(str(e))
    torch.set_num_threads(1)
    model, tok = smollm2.load_model(torch.float32)
    return model.double(), tok


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::quotient_manifolds.errors.SymmetryFallbackWarning")
def test_smollm2_complete_measure_is_invariant(smol64):
    """S(moved)/S = 1 to float32 rounding (the model's RMSNorm and softmax compute in float32
    even in float64) for a random element of the complete group (a = 10).

    The complete group is discovered once (its block probes skipped: the float64-internals
    logit check below confirms that the drawn element is a symmetry) and the model moved by
    `transform_params`, the core of `qm.reparametrize(symmetry="complete")`, with it (a second
    discovery would double the run time)."""
    import quotient_manifolds as qm
    from quotient_manifolds.models.reparam import transform_params

    model, tok = smol64
    batch = smollm2.make_batches(tok, 1, 2, 16)
    t0 = time.perf_counter()
    sym = qm.discover(model, symmetry="complete", probe=False, loss_fn=smollm2.loss_fn,
                      batch=batch[0])
    kinds = Counter(f.kind for f in sym.folds)
    t_disc = time.perf_counter() - t0
    moved = copy.deepcopy(model)
    params = {n: p.detach() for n, p in moved.named_parameters()}
    new = transform_params(params, sym.blocks, sym.folds, a=A,
                           generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        for n, p in moved.named_parameters():
            p.copy_(new[n])
    with torch.no_grad(), qm.models.float64_internals():
        x = batch[0]["input_ids"]
        l0 = model(input_ids=x, use_cache=False).logits
        l1 = moved(input_ids=x, use_cache=False).logits
    logit_change = float((l0 - l1).abs().max() / l0.abs().max())
    geometry = qm.Geometry(metric="inv", symmetry="complete", symmetries=sym)
    t1 = time.perf_counter()
    s0 = qm.geodesic_sharpness(model, smollm2.loss_fn, batch, rho=RHO, n_iter=N_ITER,
                               geometry=geometry).value
    t2 = time.perf_counter()
    s1 = qm.geodesic_sharpness(moved, smollm2.loss_fn, batch, rho=RHO, n_iter=N_ITER,
                               geometry=geometry).value
    t3 = time.perf_counter()
    ratio = s1 / s0
    print(f"\nfolds {dict(kinds)}, blocks {len(sym.blocks)}, discovery {t_disc:.0f} s; "
          f"logit change (float64 internals) {logit_change:.1e}; S = {s0:.6f}, "
          f"S(moved) = {s1:.6f}, ratio {ratio:.9f}; sharpness {t2 - t1:.0f} s + {t3 - t2:.0f} s")
    assert logit_change < 1e-10
    assert abs(ratio - 1) < 1e-5
