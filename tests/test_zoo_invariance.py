"""The acceptance test of the complete group over the zoo: on every very small architecture of
`audit_zoo.py` (float64, redrawn weights), every symmetry `symmetry="complete"` claims (the
blocks and folds discovery reports, with the user's loss) is applied by an independent
construction (`zoo_constructions.py`, from the config and module structure, not the folds'
`act`). Each family alone and all of them composed keep the logits (the loss symmetries: the
log-probabilities) to 1e-10; composed, they leave geodesic sharpness of the complete measure
(inv and mix) unchanged to 1e-6, while the full measure moves where the full group lacks a
translation or rotation family. The coverage test fails, naming the architecture and the
kind, when a claimed kind has no construction in `CONSTRUCTIONS`."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from audit_zoo import SMALL, ZOO, torch_inputs
from torch import nn
from zoo_constructions import CONSTRUCTIONS, apply_claims, claim_key, claim_params, is_loss_claim

import quotient_manifolds as qm
from quotient_manifolds.models.precision import float64_internals

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore")

DEFAULT = ("bert", "gpt2", "llama_gqa", "qwen3", "phi", "torch_encoder")
"""Architectures of the default suite (one of each structure); the rest are `slow`."""
CLASSIFIERS = {"bert", "roberta", "electra", "distilbert"}
# kinds of the complete group that move the full measure: the full group lacks them, and
# its metric is not already invariant under them (it is under the MLP unit scalings, whose
# weights are in the elementwise metric)
FULL_BLIND = {"norm_shift", "reader_centring", "centring", "softmax_shift", "embedding_shift",
              "rotation", "table_shift", "input_shear", "pad_shift", "token_shift", "score_shift",
              "shift_reader"}
TOL_OUT, TOL_MEASURE, FULL_MOVES = 1e-10, 1e-6, 1e-4
RHO, N_ITER = 0.05, 3
RHO_OF = {"electra": 0.01}  # at 0.05 three Auto-PGD steps find no ascent on it: every value 0


def _params(archs):
    return [a if a in DEFAULT else pytest.param(a, marks=pytest.mark.slow) for a in archs]


# -- the zoo's data and losses --------------------------------------------------------------
def _data(arch: str) -> list:
    g = torch.Generator().manual_seed(5)
    if arch.startswith("torch"):
        return [(torch_inputs()[0], torch.randint(0, 3, (2,), generator=g))]
    if arch == "vit":
        return [{"pixel_values": torch.randn(4, 1, 4, 4, generator=g, dtype=torch.float64),
                 "labels": torch.randint(0, 3, (4,), generator=g)}]
    ids = torch.randint(3, 16, (4, 6), generator=g)
    if arch == "roberta":  # padding at the end: the padding pair's rows are read (together)
        ids[:, -1] = SMALL["pad_token_id"]
    if arch in CLASSIFIERS:
        return [{"input_ids": ids, "labels": torch.randint(0, 3, (4,), generator=g)}]
    return [{"input_ids": ids, "labels": ids}]


def _hf_loss(m, b):
    return m(**b).loss


def _torch_loss(m, b):
    return nn.functional.cross_entropy(m(b[0]), b[1])


def _loss(arch: str):
    return _torch_loss if arch.startswith("torch") else _hf_loss


def _logits(model: nn.Module, arch: str, batch) -> torch.Tensor:
    with torch.no_grad(), float64_internals():
        return model(batch[0]) if arch.startswith("torch") else model(**batch).logits


@functools.cache
def _setup(arch: str):
    """The model, its data and loss, and the complete group's claims (as the measure
    discovers them: probed on the first batch, with the loss)."""
    model, data = ZOO[arch](), _data(arch)
    with warnings.catch_warnings(), float64_internals():
        warnings.simplefilter("ignore")
        sym = qm.symmetries_of(model, _loss(arch), data,
                               geometry=qm.Geometry(metric="inv", symmetry="complete"))
    return model, data, sym, list(sym.blocks) + list(sym.folds)


def _sharpness(model, arch, data, symmetry, metric, sym=None) -> float:
    with warnings.catch_warnings(), float64_internals():
        warnings.simplefilter("ignore")
        g = qm.Geometry(metric=metric, symmetry=symmetry, symmetries=sym)
        return qm.geodesic_sharpness(model, _loss(arch), data, rho=RHO_OF.get(arch, RHO),
                                     n_iter=N_ITER, geometry=g).value


# -- checks -----------------------------------------------------------------------------------
def _changes(model, moved, arch, data) -> dict[str, float]:
    """Relative changes of the logits, the log-probabilities and the loss."""
    a, b = _logits(model, arch, data[0]), _logits(moved, arch, data[0])
    la, lb = a.log_softmax(-1), b.log_softmax(-1)
    with torch.no_grad(), float64_internals():
        ya, yb = float(_loss(arch)(model, data[0])), float(_loss(arch)(moved, data[0]))
    return {"logits": float((a - b).abs().max() / a.abs().max()),
            "logprobs": float((la - lb).abs().max() / la.abs().max()),
            "loss": abs(yb - ya) / abs(ya)}


def _other_outputs_change(model, moved, arch, data) -> float:
    """The largest relative change of the outputs besides the logits and the loss (an
    encoder's returned last hidden state): a loss symmetry may keep the logits and move them."""
    if arch.startswith("torch"):
        return 0.0
    with torch.no_grad(), float64_internals():
        a, b = model(**data[0]), moved(**data[0])
    out = 0.0
    for k, x in a.items():
        if k not in ("logits", "loss") and isinstance(x, torch.Tensor) and x.abs().max() > 0:
            out = max(out, float((x - b[k]).abs().max() / x.abs().max()))
    return out


def _moved_params(model, moved) -> set[str]:
    old = dict(model.named_parameters())
    return {n for n, p in moved.named_parameters()
            if (p - old[n]).abs().max() > 1e-6 * (1 + old[n].abs().max())}


def _check_family(arch, model, data, claims, key) -> float:
    """One family alone: it moves parameters of every claim, and keeps the function."""
    which = [c for c in claims if claim_key(c) == key]
    moved = apply_claims(model, claims, which, seed=1)
    changed = _moved_params(model, moved)
    idle = [c.module for c in which if not claim_params(c) & changed]
    assert not idle, f"{arch}, {key}: the construction moves no parameter of {idle}"
    ch = _changes(model, moved, arch, data)
    first = apply_claims(model, claims, which[:1], seed=1)
    old = dict(model.named_parameters())  # a weight matrix first: a bias can be a symmetry alone
    moved_first = sorted(_moved_params(model, first), key=lambda n: (old[n].dim() < 2, n))
    if len(moved_first) > 1:  # control: a one-sided move (one parameter alone) is no symmetry
        one = copy.deepcopy(model)
        with torch.no_grad():
            dict(one.named_parameters())[moved_first[0]].copy_(
                dict(first.named_parameters())[moved_first[0]])
        alone = _changes(model, one, arch, data)["logprobs"]
        assert alone > 1e-6, (arch, key, f"{moved_first[0]} alone keeps the function")
    if any(is_loss_claim(c) for c in which):
        assert max(ch["logits"], _other_outputs_change(model, moved, arch, data)) > 1e-3, (
            arch, key, "a loss symmetry that moves no output (logits or other)")
        out = max(ch["logprobs"], ch["loss"])
    else:
        out = ch["logits"]
    assert out < TOL_OUT, f"{arch}, {key}: not function-preserving, relative change {out:.2e}"
    return out


def _missing(arch: str, claims) -> list[str]:
    return sorted({claim_key(c) for c in claims} - set(CONSTRUCTIONS))


# -- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(ZOO))
def test_every_claimed_kind_has_a_construction(arch):
    """Coverage: every block and fold kind the complete group claims on the architecture has
    an independent construction in `zoo_constructions.CONSTRUCTIONS`."""
    _, _, _, claims = _setup(arch)
    assert claims, f"{arch}: the complete group claims nothing"
    missing = _missing(arch, claims)
    assert not missing, (
        f"{arch}: the complete group claims {missing}, which have no independent construction: "
        "add one to CONSTRUCTIONS in tests/zoo_constructions.py")


@pytest.mark.parametrize("arch", _params(ZOO))
def test_complete_group_invariance(arch):
    """Each family alone and all composed keep the function; the complete measure does not
    move under the composition (inv and mix); the full measure does where it is blind."""
    model, data, sym, claims = _setup(arch)
    assert not _missing(arch, claims), _missing(arch, claims)
    keys = sorted({claim_key(c) for c in claims})
    alone = {k: _check_family(arch, model, data, claims, k) for k in keys}

    outputs = [c for c in claims if not is_loss_claim(c)]
    moved = apply_claims(model, claims, outputs, seed=2)
    composed = _changes(model, moved, arch, data)["logits"]
    assert composed < TOL_OUT, f"{arch}: the composition changes the logits by {composed:.2e}"
    losses = [c for c in claims if is_loss_claim(c)]
    if losses:
        moved = apply_claims(model, claims, outputs + losses, seed=2)
        ch = _changes(model, moved, arch, data)
        assert max(ch["logprobs"], ch["loss"]) < TOL_OUT, (arch, ch)

    ratios = {}
    for metric in ("inv", "mix"):
        a = _sharpness(model, arch, data, "complete", metric, sym)
        b = _sharpness(moved, arch, data, "complete", metric)
        assert a > 0, (arch, metric, "no ascent found: the comparison would be vacuous")
        ratios[metric] = b / a
    a, b = _sharpness(model, arch, data, "full", "inv"), _sharpness(moved, arch, data, "full",
                                                                   "inv")
    ratios["full"] = b / a
    blind = sorted({c.kind for c in claims} & FULL_BLIND)
    print(f"\n{arch}: claimed {keys}\n  max change alone {max(alone.values()):.1e}, composed "
          f"{composed:.1e}; |S(moved)/S - 1| complete inv {abs(ratios['inv'] - 1):.1e} mix "
          f"{abs(ratios['mix'] - 1):.1e}; full inv S(moved)/S = {ratios['full']:.4g} (blind to "
          f"{blind})")
    for metric in ("inv", "mix"):
        assert abs(ratios[metric] - 1) < TOL_MEASURE, (arch, metric, ratios)
    if blind:
        assert abs(ratios["full"] - 1) > FULL_MOVES, (arch, "full measure did not move", ratios)
    else:  # only families the full measure is invariant under (its own, the MLP scalings)
        assert abs(ratios["full"] - 1) < TOL_MEASURE, (arch, "full measure moved", ratios)
