r"""Symmetry discovery: ask every symmetry family what it finds, and check every claim.

[`discover`][quotient_manifolds.models.discovery.discover] runs the families of
[`FAMILIES`][quotient_manifolds.models.families.FAMILIES] on a
[`Scene`][quotient_manifolds.models.symmetry.Scene] of the model, in two phases:

1. **blocks**: the block families (attention heads in every layout, LoRA adapters, …) claim
   GL(h) or subgroup blocks by structure; every claim (and every user block of
   [declare_block][quotient_manifolds.models.blocks.declare_block]) is checked by the
   function-preservation probe of the [`Prober`][quotient_manifolds.models.prober.Prober] on
   a float64 copy, and a claim the probe rejects is dropped and recorded with the measured
   error;
2. **folds** (not for `symmetry="paper"`): the fold families (q/k norms, pre-norm gains, bias
   translations, …) propose canonical representatives on the traced forward pass; the first
   alternative of each proposal that the whole-model probe confirms is claimed, all claimed
   folds together are probed once more, and the factor parts the folds freeze are stripped from
   the blocks ([`strip_frozen`][quotient_manifolds.models.discovery.strip_frozen]).

What looks like a symmetry but is not claimed is recorded as a
[Fallback][quotient_manifolds.models.records.Fallback] with the reason, and warned about once
per module.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..errors import (
    BlockSpecError,
    LossEvaluationError,
    NoBlocksWarning,
    ProbeWarning,
    SymmetryFallbackWarning,
)
from .blocks import BlockSpec, FactorPart, claimed_mask
from .families import FAMILIES
from .inputs import normalize_inputs
from .prober import Joint
from .records import (
    DEFAULT_SYMMETRY,
    SYMMETRIES,
    Fallback,
    ProbeRecord,
    Symmetries,
    parameter_layout,
)
from .symmetry import Fold, Scene, SymmetryFamily

__all__ = ["apply_folds", "discover", "discover_blocks", "find_folds", "strip_frozen"]


def apply_folds(
    folds: Sequence[Fold], params: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    r"""The canonical point of `params` and the frozen masks of `folds`, applied in order.

    A pure function: `params` is not modified, and tensors that no fold touches are passed
    through (not copied).

    Returns
    -------
    (dict, dict)
        `{name: tensor}` of every parameter and `{name: bool mask}` of the entries the folds
        fix (shaped like the parameter; names absent from it have no frozen entry).
    """
    return Symmetries((), folds=tuple(folds)).canonicalize(params)


def _families(families: Sequence[SymmetryFamily] | None, kind: str, symmetry: str
              ) -> list[SymmetryFamily]:
    return [f for f in (FAMILIES if families is None else families)
            if f.kind == kind and symmetry in f.symmetries]


def _outside(found: list[BlockSpec], declared: list[BlockSpec],
             params: Mapping[str, torch.Tensor]) -> list[BlockSpec]:
    """The found blocks that share no entry with a declared block: a declaration takes
    precedence over discovery on its weights (e.g. a GL(h) block declared over a pair of
    linear maps whose units the complete group would quotient one by one)."""
    taken: dict[str, torch.Tensor] = {}
    for b in declared:
        for n, m in claimed_mask(b, params).items():
            taken[n] = m if n not in taken else taken[n] | m
    return [b for b in found if not any(
        n in taken and bool((taken[n] & m).any()) for n, m in claimed_mask(b, params).items())]


def _probe_blocks(scene: Scene, found: list[BlockSpec], declared: list[BlockSpec],
                  warn: bool) -> tuple[list[BlockSpec], list[ProbeRecord]]:
    """The verified blocks of `found`, and every probe record; a declared block the probe
    rejects raises."""
    p = scene.prober
    blocks, unprobed, records = [], [], []
    for b in found:
        rec = p.check_block(b, scene.input_dims)
        if rec is None:
            unprobed.append(b)
            blocks.append(replace(b, note=(b.note + "; not probed").lstrip("; ")))
            continue
        records.append(rec)
        if rec.passed:
            blocks.append(b)
        else:
            group = "GL(h)" if b.group is None else type(b.group).__name__
            scene.fallback(b.module, b.kind, f"the function-preservation probe rejected the "
                           f"claimed {group} block: {rec.reason}")
    for b in declared:
        rec = p.check_block(b, scene.input_dims)
        if rec is None:
            continue
        records.append(rec)
        if not rec.passed:
            raise BlockSpecError(
                f"the declared block {b.kind!r} ({', '.join(b.params)}) is not a symmetry "
                f"of the model: {rec.reason}. Check the parts, offsets, heads= and h=."
            )
    if unprobed and warn:
        names = ", ".join(dict.fromkeys(b.module or "<root>" for b in unprobed))
        warnings.warn(
            f"{len(unprobed)} discovered block(s) could not be checked by the "
            f"function-preservation probe (no example input reached {names}); pass "
            "example_inputs= to discover() to verify them.",
            ProbeWarning,
            stacklevel=3,
        )
    return blocks, records


def _fold_phase(scene: Scene, blocks: Sequence[BlockSpec],
                families: Sequence[SymmetryFamily] | None = None
                ) -> tuple[list[Fold], list[Fallback]]:
    """The confirmed folds of the fold families, in application order, and their fallbacks."""
    scene.blocks = list(blocks)
    fams = _families(families, "folds", scene.symmetry)
    if not any(f.present(scene) for f in fams):
        return [], []  # nothing can fold: nothing to probe, nothing to report
    p = scene.prober
    if p.problem is not None:
        return [], [Fallback("", "folds", p.problem)]
    start = len(scene.fallbacks)
    scene.proposals = []
    for f in fams:
        f.find(scene)
    for f in fams:
        f.finish(scene)
    fallbacks = scene.fallbacks[start:]
    del scene.fallbacks[start:]
    chosen = p.select([pr.alternatives for pr in scene.proposals])
    folds: list[Fold] = []
    for pr, c in zip(scene.proposals, chosen, strict=True):
        if c is not None:
            assert isinstance(c, Fold)
            folds.append(c)
        elif pr.reject is not None:
            fb = pr.reject(p)
            if fb is not None:
                fallbacks.append(fb)
    folds.sort(key=lambda f: f.order)
    if folds:
        outputs = [f for f in folds if f.invariant == "outputs"]
        with warnings.catch_warnings():  # the conditioning of these internal canonical points
            # (a subset of the folds, probe points) is not the user's: theirs warns when used
            warnings.filterwarnings("ignore", message="the canonical basis of the residual")
            err = max(p.probe(Joint(outputs)), p.change(apply_folds(outputs, p.params)[0])) if (
                outputs) else 0.0
            if len(outputs) < len(folds):  # symmetries of the loss: the loss is unchanged
                err = max(err, p.probe(Joint(folds)),
                          p.loss_change(apply_folds(folds, p.params)[0]))
        if err > p.fold_tolerance * len(folds):  # folds that pass one by one, not together
            return [], fallbacks + [Fallback("", "folds", (
                f"the folds pass one by one but together change the output by {err:.1e}; "
                "none is claimed"))]
    return folds, fallbacks


def find_folds(
    model: nn.Module,
    blocks: Sequence[BlockSpec],
    *,
    example_inputs: Any = None,
    families: Sequence[SymmetryFamily] | None = None,
    symmetry: str = DEFAULT_SYMMETRY,
    loss: tuple[Callable, Any] | None = None,
) -> tuple[list[Fold], list[Fallback]]:
    r"""The folds of `model` (the fold families of discovery), each confirmed by a probe.

    Candidates come from one traced forward pass of a float64 copy of the model (the model
    itself is never run or changed); each is kept only if a random element of its group leaves
    every output of the copy unchanged to
    [`PROBE_RTOL`][quotient_manifolds.models.records.PROBE_RTOL] (relative). At the end, all
    kept folds together are probed once more, and the canonical point is checked to compute the
    same function.

    Parameters
    ----------
    model : nn.Module
        Only read (deep-copied to float64).
    blocks : sequence of BlockSpec
        The model's resolved GL blocks (bias rows included, as discovered).
    example_inputs : optional
        An input the model accepts: `(args, kwargs)`, a dict of keyword arguments, a tuple of
        positional arguments or a tensor. Default: a small random input derived from the
        model's configuration (Hugging Face, timm); without one, or if the model fails on it,
        no fold is claimed and a fallback says so.
    families : sequence of SymmetryFamily, optional
        The families to ask (default
        [`FAMILIES`][quotient_manifolds.models.families.FAMILIES]; only fold families are used).
    symmetry : str
        The group whose fold families are asked (`"complete"` or `"full"`).
    loss : (loss_fn, batch), optional
        The loss that the symmetries of the loss only must leave unchanged.

    Returns
    -------
    (list of Fold, list of Fallback)
        The folds, in application order, and the structures that look like a symmetry but are
        not removed, with the reason.
    """
    inputs = None if example_inputs is None else normalize_inputs(example_inputs)
    return _fold_phase(Scene(model, symmetry, inputs, loss), blocks, families)


def strip_frozen(
    blocks: Iterable[BlockSpec],
    frozen: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
) -> tuple[list[BlockSpec], list[Fallback]]:
    """Remove from each block the factor parts whose entries are all frozen.

    A part that is only partly frozen cannot be removed; its block is dropped and recorded
    as a fallback. A block left without a `G` or `H` part is dropped as well.
    """
    out: list[BlockSpec] = []
    fbs: list[Fallback] = []
    for b in blocks:
        keep: dict[str, list[FactorPart]] = {"G": [], "H": []}
        bad = None
        for side in ("G", "H"):
            for part in getattr(b, side):
                fz = frozen.get(part.param)
                if fz is None:
                    keep[side].append(part)
                    continue
                mask = torch.zeros(fz.shape, dtype=torch.bool, device=fz.device)
                part.mark(mask, b.heads, b.h)
                covered = fz[mask]
                if bool(covered.all()):
                    continue
                if bool(covered.any()):
                    bad = part.param
                keep[side].append(part)
        if bad is not None:
            fbs.append(Fallback(b.module, b.kind, f"part of {bad!r} is frozen by a "
                                "canonicalisation fold and part is not"))
            continue
        if not keep["G"] or not keep["H"]:
            fbs.append(Fallback(b.module, b.kind, "every part of a factor is frozen by a "
                                "canonicalisation fold"))
            continue
        if len(keep["G"]) == len(b.G) and len(keep["H"]) == len(b.H):
            out.append(b)
        else:
            out.append(replace(b, G=tuple(keep["G"]), H=tuple(keep["H"])).resolved(params))
    return out, fbs


# -- discover -------------------------------------------------------------------------------------


def _warn_fallbacks(fallbacks: list[Fallback], classes: Mapping[str, str]) -> None:
    by_module: dict[str, list[Fallback]] = {}
    for fb in fallbacks:
        by_module.setdefault(fb.module, []).append(fb)
    for module, fbs in by_module.items():
        cls = classes.get(module)
        where = f"{module or '<root>'}" + (f" ({cls})" if cls else "")
        what = "; ".join(f"[{fb.kind}] {fb.reason}" for fb in fbs)
        warnings.warn(
            f"{where}: these weights use the adaptive geometry instead of a symmetry block: "
            f"{what}. The fallbacks are recorded in the result.",
            SymmetryFallbackWarning,
            stacklevel=3,
        )

def discover(
    model: nn.Module,
    *,
    symmetry: str = DEFAULT_SYMMETRY,
    declared: Iterable[BlockSpec] = (),
    warn: bool = True,
    probe: bool = True,
    example_inputs: Any = None,
    families: Sequence[SymmetryFamily] | None = None,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    batch: Any = None,
) -> Symmetries:
    """The symmetries of `model`: verified blocks, fallbacks and canonicalisation folds.

    Parameters
    ----------
    model : nn.Module
        Any model; it is only read (probes run on a float64 deep copy).
    symmetry : {"complete", "full", "paper"}
        `"complete"` (the default): every symmetry the families claim (the full group, and
        MLP neurons, LayerNorm translations, embedding and softmax shifts, residual
        rotations; the symmetries of the loss only when `loss_fn` and `batch` are given).
        `"full"`: the rotary commutant, grouped heads, norm gains, bias translations and q/k
        norms.
        `"paper"`: GL(h) per recognised head only, bias rows appended, no folds
        ([`SYMMETRIES`][quotient_manifolds.models.records.SYMMETRIES]).
    declared : iterable of BlockSpec
        User blocks from [declare_block][quotient_manifolds.models.blocks.declare_block];
        validated, and probed when an example input is available. A declared block takes
        precedence over the discovered blocks that share its entries.
    warn : bool
        Emit a `SymmetryFallbackWarning` per module that falls back, a `ProbeWarning` for
        claims the probe could not reach, and a `NoBlocksWarning` when nothing is found.
    probe : bool
        Check every block with the function-preservation probe (default). `False` trusts
        the structural recognition of the blocks (cheaper: no float64 copy, no forward, unless
        folds are searched, which are always probed).
    example_inputs : optional
        Input of the model for the probes: `(args, kwargs)`, a dict of keyword arguments, a
        tuple of positional arguments or a tensor. Default: built from the model
        ([example_inputs][quotient_manifolds.models.inputs.example_inputs]).
    families : sequence of SymmetryFamily, optional
        The symmetry families to ask, in order (default
        [`FAMILIES`][quotient_manifolds.models.families.FAMILIES]).
    loss_fn, batch : optional
        The loss and an example batch: the symmetries of the loss but not of the outputs (the
        softmax shift of an untied output head) are claimed only when `loss_fn(model, batch)`
        is unchanged by them, and only when these are given.

    Returns
    -------
    Symmetries

    Raises
    ------
    BlockSpecError
        For an unknown `symmetry`, a malformed declared block, or a declared block the probe
        shows not to be a symmetry.
    """
    if symmetry not in SYMMETRIES:
        raise BlockSpecError(f"symmetry must be one of {SYMMETRIES}, got {symmetry!r}")
    inputs = None if example_inputs is None else normalize_inputs(example_inputs)
    scene = Scene(model, symmetry, inputs,
                  None if loss_fn is None or batch is None else (loss_fn, batch))
    block_families = _families(families, "blocks", symmetry)
    for f in block_families:
        f.find(scene)
    for f in block_families:
        f.finish(scene)
    params = {n: p.detach() for n, p in model.named_parameters()}
    found = [b.resolved(params) for b in scene.blocks]
    decl = [b.resolved(params) for b in declared]
    records: list[ProbeRecord] = []
    blocks = list(found)
    if probe and (found or decl):
        blocks, records = _probe_blocks(scene, found, decl, warn)
    blocks = _outside(blocks, decl, params) + decl
    discovered = tuple(blocks)
    fallbacks = list(scene.fallbacks)
    folds: list[Fold] = []
    if symmetry != "paper":
        try:
            folds, fold_fallbacks = _fold_phase(scene, blocks, families)
        except LossEvaluationError:  # the user's loss failed: not a failed search
            raise
        except Exception as e:  # noqa: BLE001 -- recorded and warned, never silent
            folds, fold_fallbacks = [], [Fallback("", "folds", (
                f"the search for canonicalisation folds failed ({type(e).__name__}: {e}); "
                "norm gains and bias translations are not removed; pass example_inputs="))]
        fallbacks += fold_fallbacks
        if folds:
            _, frozen = apply_folds(folds, params)
            blocks, stripped = strip_frozen(blocks, frozen, params)
            fallbacks += stripped
    if warn and fallbacks:
        _warn_fallbacks(fallbacks, scene.classes)
    if not blocks:
        fallbacks.append(Fallback("", "all", "no symmetry block detected"))
        if warn:
            warnings.warn(
                f"no symmetry block found in {type(model).__name__}; every weight uses the "
                "adaptive geometry (geodesic sharpness then equals first-order adaptive "
                "sharpness with the metric projection). Declare blocks with "
                "qm.declare_block(...) if the model has symmetries discovery does not know.",
                NoBlocksWarning,
                stacklevel=2,
            )
    return Symmetries(tuple(blocks), tuple(fallbacks), tuple(folds), tuple(records), symmetry,
                      discovered, parameter_layout(model))


def discover_blocks(
    model: nn.Module,
    *,
    declared: Iterable[BlockSpec] = (),
    warn: bool = True,
    symmetry: str = DEFAULT_SYMMETRY,
    probe: bool = True,
    example_inputs: Any = None,
) -> list[BlockSpec]:
    """The verified blocks of `model` as discovered, bias rows included.

    `discover(model, ...).discovered` as a list: with `symmetry="complete"` or `"full"` the
    rotary and grouped blocks too (and with `"complete"` the MLP neurons), with `"paper"` GL(h)
    per recognised head only. Unlike `discover(...).blocks`, the parts that canonicalisation
    folds freeze (key and value bias rows) are kept, as in the paper's factors (App. A,
    App. C). The parameters are those of [discover][quotient_manifolds.models.discovery.discover].

    Returns
    -------
    list of BlockSpec
        One spec per module and kind, covering all heads; `n` and `m` resolved.
    """
    return list(discover(model, symmetry=symmetry, declared=declared, warn=warn, probe=probe,
                         example_inputs=example_inputs).discovered)
