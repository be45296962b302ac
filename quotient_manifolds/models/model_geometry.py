r"""The quotient geometry of a whole model: a product of tangent spaces plus gather/scatter.

[`ModelGeometry`][quotient_manifolds.models.model_geometry.ModelGeometry] reads the model's
parameters once (detached, not copied) and splits the selected ones into

* GL(h) blocks, batched by shape `(n, m, h)` (and subgroup) into one `(B, n + m, h)` point per
  group — e.g. all QK heads of all layers of a BERT — with the tangent space
  `GLQuotient(n, m, metric, …).at(x0)`;
* one flat vector of every other selected entry, with the tangent space
  `AdaptiveEuclidean(adaptive_eps).at(w0)` (the metric $\xi^2/(w^2 + \varepsilon)$).

Its `space` is the
[`ProductTangentSpace`][quotient_manifolds.manifolds.product.ProductTangentSpace] of these, on
flat packed tangent vectors of shape `(D,)`; all metric, projection and retraction formulas live
in the tangent spaces. This class only maps between the model's parameters and the packed
points: [`gather`][quotient_manifolds.models.model_geometry.ModelGeometry.gather] and
[`to_params`][quotient_manifolds.models.model_geometry.ModelGeometry.to_params].

**Which weights move.** `params=` selects the perturbed parameters (default: those with
`requires_grad=True`). A GL block is used only if all its parameters are selected; otherwise its
selected entries fall back to the adaptive geometry, with the reason recorded. Unselected
parameters keep their values.

**Canonical base point.** The symmetries may come with a canonicalisation
(`symmetries.canonicalize(params) -> (params, frozen masks)`): the base point is then the
canonical representative of the model's orbit, and frozen entries never move. The model itself
is never written to. The perturbations of the adaptive entries are horizontal to the orbits of
the translation folds (`translations`, a
[`TranslationConstraint`][quotient_manifolds.models.translations.TranslationConstraint]; the
post-norm and embedding shifts' slices are free for it): their tangent space is a
[`ConstrainedAdaptiveTangentSpace`][quotient_manifolds.manifolds.constrained.ConstrainedAdaptiveTangentSpace].

**Zero weights.** With `adaptive_eps = 0` the adaptive metric is infinite at $w = 0$; such
entries never move (the adaptive tangent space freezes them; the reference code behaves the same
way, since its perturbation is $\delta \odot |w|$). `n_masked_zeros` counts them.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

import torch
from torch import nn

from ..errors import (
    BlockSpecError,
    NoParametersError,
    ParameterSelectionError,
    PrecisionError,
    RankDeficientError,
    ZeroWeightError,
)
from ..manifolds import GLQuotient
from ..manifolds.adaptive import AdaptiveTangentSpace
from ..manifolds.gl_quotient import GLTangentSpace
from ..manifolds.product import ProductTangentSpace
from .blocks import BlockSpec, claimed_mask, gather_block, scatter_block
from .cache import discovery_cache
from .config import QuotientConfig
from .records import Fallback, Symmetries
from .row_layout import RowLayout
from .translations import RowsConstraint, adaptive_space, horizontal_translations, rows_space

__all__ = ["BlockGroup", "AdaptiveEntry", "ModelGeometry", "HALF_DTYPES",
           "ParamSelection", "select_parameters"]

HALF_DTYPES = (torch.float16, torch.bfloat16)

ParamSelection = (Iterable[str] | Iterable[torch.Tensor] | Mapping[str, torch.Tensor]
                  | Callable[[str, torch.Tensor], bool] | None)


def select_parameters(model: nn.Module, params: ParamSelection = None) -> tuple[str, ...]:
    """The names of the parameters selected by `params`, in `model.named_parameters()` order.

    `params` is `None` (every parameter with `requires_grad=True`), an iterable of names or of
    parameter tensors, a dict `{name: parameter}`, or a predicate `(name, param) -> bool`.
    """
    named = dict(model.named_parameters())
    if not named:
        raise NoParametersError(
            f"{type(model).__name__} has no parameters: there is nothing to perturb; pass a "
            "model with nn.Parameter weights"
        )
    if params is None:
        chosen = {n for n, p in named.items() if p.requires_grad}
        what = "no parameter has requires_grad=True"
    elif callable(params) and not isinstance(params, nn.Module):
        chosen = {n for n, p in named.items() if params(n, p)}
        what = "the params= predicate selects no parameter"
    elif isinstance(params, (str, torch.Tensor)):
        raise ParameterSelectionError(
            "params= takes several parameters: wrap a single name or tensor in a list, e.g. "
            f"params=[{params!r}]" if isinstance(params, str) else
            "params= takes several parameters: wrap a single tensor in a list")
    else:
        # (mypy's callable() narrowing leaves nn.Module in the union; it is passed as is)
        items = list(params.items()) if isinstance(params, Mapping) else list(
            cast("Iterable[str | torch.Tensor]", params))
        by_id = {id(p): n for n, p in named.items()}
        chosen = set()
        for it in items:
            if isinstance(it, tuple) and len(it) == 2 and isinstance(it[0], str):
                name, t = it
                if name not in named or named[name] is not t:
                    raise ParameterSelectionError(
                        f"params[{name!r}] is not the model's parameter of that name; pass "
                        "dict(model.named_parameters()) entries")
            elif isinstance(it, str):
                name = it
            elif isinstance(it, torch.Tensor):
                name = by_id.get(id(it))
                if name is None:
                    raise ParameterSelectionError(
                        "params= holds a tensor that is not a parameter of the model")
            else:
                raise ParameterSelectionError(
                    f"params= entries must be names, parameters or (name, parameter) pairs, got "
                    f"{type(it).__name__}")
            if name not in named:
                close = difflib.get_close_matches(name, list(named), n=3)
                hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
                raise ParameterSelectionError(
                    f"params= names {name!r}, which is not in model.named_parameters(){hint}")
            chosen.add(name)
        what = "params= is empty"
    if not chosen:
        raise NoParametersError(f"no parameter of {type(model).__name__} is selected ({what}); "
                                "pass params= naming the parameters to perturb")
    if not any(named[n].is_floating_point() for n in chosen):
        raise ParameterSelectionError(
            f"params= selects only parameters that are not floating point "
            f"({', '.join(sorted(chosen)[:3])}: {named[min(chosen)].dtype}); integer weights "
            "cannot be perturbed, select floating-point ones")
    return tuple(n for n in named if n in chosen)


def _selected_blocks(blocks: Sequence[BlockSpec], fallbacks: list[Fallback],
                     selected: Sequence[str]) -> tuple[list[BlockSpec], list[Fallback]]:
    """The blocks whose parameters are all perturbed; the others become fallbacks."""
    chosen = set(selected)
    keep = []
    for b in blocks:
        missing = [p for p in b.params if p not in chosen]
        if missing:
            fallbacks.append(Fallback(
                b.module, b.kind,
                f"parameters {', '.join(missing)} are not perturbed (params= / "
                "requires_grad); the block's selected entries use the adaptive geometry"))
        else:
            keep.append(b)
    return keep, fallbacks


def _claimed(blocks: Sequence[BlockSpec], base: Mapping[str, torch.Tensor]
             ) -> dict[str, torch.Tensor]:
    """The entries the blocks claim, per parameter; `BlockSpecError` if two blocks overlap."""
    seen: dict[str, torch.Tensor] = {}
    for b in blocks:
        for name, m in claimed_mask(b, base).items():
            prev = seen.get(name)
            if prev is not None and bool((prev & m).any()):
                raise BlockSpecError(
                    f"two blocks claim the same entries of {name!r} (second: {b.kind} at "
                    f"{b.module!r}); each weight may belong to one GL block only"
                )
            seen[name] = m if prev is None else prev | m
    return seen


def _name_rank_deficient(blocks: Sequence[BlockSpec], base: Mapping[str, torch.Tensor],
                         geometry: QuotientConfig, dtype: torch.dtype, msg: str) -> str:
    assert geometry.metric is not None  # called for blocks, which need a metric
    bad = []
    for b in blocks:
        x = gather_block(b, base).to(dtype)
        man = GLQuotient(b.n, b.m, geometry.metric, geometry.eps, validate=False)
        for i in range(b.heads):
            try:
                man.at(x[i : i + 1])
            except RankDeficientError:
                bad.append(f"{b.kind} at {b.module!r} head {i}")
    where = ", ".join(bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
    return f"{msg} Rank-deficient block(s): {where or 'unknown'}."


def _adaptive_entries(selected: Sequence[str], base: Mapping[str, torch.Tensor],
                      claimed: Mapping[str, torch.Tensor], frozen: Mapping[str, torch.Tensor],
                      adaptive_eps: float, dtype: torch.dtype
                      ) -> tuple[list[AdaptiveEntry], list[torch.Tensor], int]:
    """The free entries of every selected parameter outside the blocks and the folds' frozen
    entries, their values (in the parameters' dtype), and the number of zero weights that
    cannot move."""
    entries, pieces, start, masked = [], [], 0, 0
    for name in selected:
        w = base[name]
        if not w.is_floating_point():
            continue
        free = ~claimed[name] if name in claimed else None
        fz = frozen.get(name)
        if fz is not None:
            free = ~fz if free is None else free & ~fz
        if adaptive_eps == 0:
            # w² must be positive, not only w: tiny float32 weights (|w| < 1e-22) square to 0
            # (seen in all-MiniLM-L6-v2). Such entries stay in the flat vector, frozen by the
            # adaptive tangent space (c² = 0: they never move).
            wd = w.to(dtype)
            zero = wd * wd == 0
            masked += int((zero if free is None else (zero & free)).sum())
        if free is None or bool(free.all()):
            idx, vals = None, w.reshape(-1)
        elif bool(free.any()):
            idx = free.reshape(-1).nonzero().squeeze(1)
            vals = w.reshape(-1)[idx]
        else:
            continue
        entries.append(AdaptiveEntry(name, start, start + vals.numel(), idx))
        pieces.append(vals)
        start += vals.numel()
    return entries, pieces, masked


def _group_point(geo: ModelGeometry, blocks: Sequence[BlockSpec]) -> torch.Tensor:
    """The packed base point `(heads, n + m, h)` of a group's blocks."""
    return torch.cat([gather_block(b, geo.base).to(geo.dtype) for b in blocks])


def _flat_point(geo: ModelGeometry, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """The flat adaptive base point from the free entries of every parameter."""
    if not pieces:
        return torch.zeros(0, dtype=geo.dtype, device=geo._device())
    return torch.cat([p.to(geo.dtype) for p in pieces])


def _by_shape(blocks: Sequence[BlockSpec]) -> dict[tuple, list[BlockSpec]]:
    """The blocks by `(n, m, h, subgroup)`: one batched manifold each."""
    out: dict[tuple, list[BlockSpec]] = {}
    for b in blocks:
        out.setdefault((b.n, b.m, b.h, getattr(b, "group", None)), []).append(b)
    return out


def _share_base(entries: Sequence[AdaptiveEntry], base: dict[str, torch.Tensor],
                raw: Mapping[str, torch.Tensor], w0: torch.Tensor) -> None:
    """Make every canonicalised whole adaptive entry of `base` a view of `w0`, which holds
    the same values: the canonical copy made by `canonicalize` is then freed (one copy of
    each such parameter, not two; the model's own tensors are left as they are). Not where
    `w0` holds only a slice of the entries (a model-parallel rank's)."""
    if w0.numel() != sum(e.stop - e.start for e in entries):
        return
    for e in entries:
        t = base[e.name]
        if (e.index is None and t.dtype == w0.dtype and t.is_contiguous()
                and t.data_ptr() != raw[e.name].data_ptr()):
            base[e.name] = w0[e.start : e.stop].view(t.shape)


@dataclass
class BlockGroup:
    """All blocks of one shape `(n, m, h)` (and subgroup), batched along dim 0."""

    n: int
    m: int
    h: int
    blocks: list[BlockSpec]
    manifold: GLQuotient
    space: GLTangentSpace

    @property
    def x0(self) -> torch.Tensor:
        return self.space.x0

    @property
    def G(self) -> torch.Tensor:
        return self.space.G

    @property
    def H(self) -> torch.Tensor:
        return self.space.H

    @property
    def grams(self):
        return self.space.grams


@dataclass
class AdaptiveEntry:
    """Where a parameter's free entries sit in the flat adaptive vector."""

    name: str
    start: int
    stop: int
    index: torch.Tensor | None  # None: the whole parameter is free


class ModelGeometry:
    r"""Quotient geometry of a model at its current weights (the base point).

    Parameters
    ----------
    model : nn.Module
        The model; only read (its parameters are detached, not copied).
    geometry : QuotientConfig
        Metric, symmetries, retractions and relaxations (a sharpness
        [`Geometry`][quotient_manifolds.sharpness.config.Geometry] is one; its ball is not
        read here).
    params : names, tensors, dict or predicate, optional
        The perturbed parameters
        ([`select_parameters`][quotient_manifolds.models.model_geometry.select_parameters];
        default: those with `requires_grad=True`).
    symmetries : Symmetries, optional
        The model's symmetries, e.g. from `discover(model)`; default `geometry.symmetries`,
        discovered when both are None (ignored if `geometry.blocks` is given).
    warn : bool
        Emit the discovery warnings.
    example_inputs : optional
        An input of the model for discovery's probes, as for
        [`discover`][quotient_manifolds.models.discover] (used only when the symmetries are
        discovered here).
    probed : (inputs, (loss_fn, batch)), optional
        The probes' inputs and the loss on one batch (for the symmetries of the loss only);
        replaces `example_inputs`.

    Attributes
    ----------
    space : ProductTangentSpace
        The tangent space of the selected weights: the block groups, then the adaptive part.
    kinds : list of str
        The retraction of each factor of `space`.
    groups : list of BlockGroup
        The GL block groups.
    base : dict
        Every parameter at the base point (detached; canonical if the symmetries fold).
    """

    def __init__(
        self,
        model: nn.Module,
        geometry: QuotientConfig | None = None,
        *,
        params: ParamSelection = None,
        symmetries: Symmetries | None = None,
        warn: bool = True,
        example_inputs: Any = None, probed: Any = None,
    ) -> None:
        geometry = QuotientConfig() if geometry is None else geometry
        if not isinstance(geometry, QuotientConfig):
            raise TypeError(f"geometry must be a Geometry or QuotientConfig, got {geometry!r}; "
                            f"e.g. ModelGeometry(model, Geometry(metric={geometry!r}))")
        self.geometry = g = geometry
        self.selected = select_parameters(model, params)
        raw = {n: p.detach() for n, p in model.named_parameters()}
        floats = [raw[n].dtype for n in self.selected if raw[n].is_floating_point()]
        half = [d for d in floats if d in HALF_DTYPES]
        if half and g.half != "float32":
            raise PrecisionError(
                f"the model has {half[0]} parameters; the h×h block algebra must not run in "
                "half precision. Convert it with model.float() (or .double()), or pass "
                "geometry=Geometry(half='float32') to keep the model in half "
                "precision and run the block algebra and perturbations in float32."
            )
        self.dtype = torch.float64 if floats and all(d == torch.float64 for d in floats) else (
            torch.float32)
        if g.metric is None:
            sym = Symmetries(blocks=())
        elif g.blocks is not None:
            sym = Symmetries(blocks=tuple(b.resolved(raw)
                                          for b in list(g.blocks) + list(g.declared)))
        elif symmetries is not None or g.symmetries is not None:
            sym = cast(Symmetries, symmetries if symmetries is not None else g.symmetries)
            sym.check_model(model)
        else:
            inputs, loss = (example_inputs, None) if probed is None else probed
            sym = discovery_cache.discover(  # one discovery per model, weights and options
                model, symmetry=g.symmetry, declared=g.declared, warn=warn,
                example_inputs=inputs, loss_fn=None if loss is None else loss[0],
                batch=None if loss is None else loss[1])
        self.symmetries = sym
        self.base, self.frozen = sym.canonicalize(raw)
        self.base = {n: t.detach() for n, t in self.base.items()}
        translations, self.frozen = horizontal_translations(sym.folds, self.base, self.frozen)
        self.blocks, self.fallbacks = _selected_blocks(sym.blocks, list(sym.fallbacks),
                                                       self.selected)
        self.claimed = _claimed(self.blocks, self.base)
        self.groups = self._build_groups()
        self.entries, pieces, self.n_masked_zeros = _adaptive_entries(
            self.selected, self.base, self.claimed, self.frozen, g.adaptive_eps, self.dtype)
        self.w0 = self._flat_point(pieces)
        _share_base(self.entries, self.base, raw, self.w0)
        self.adaptive, self.adaptive_space, self.translations = self._adaptive_space(
            g, self.w0, translations, self.base, self.entries, self.dtype)
        self._point_buffer: torch.Tensor | None = None
        self._point_origin: object | None = None  # the RowLayout family last written there
        spaces = [grp.space for grp in self.groups] + [self.adaptive_space]
        labels = ["blocks"] * len(self.groups) + ["adaptive"]
        self.kinds = [g.retraction] * len(self.groups) + [g.adaptive_retraction]
        self.space = ProductTangentSpace(spaces, (), labels, self.kinds)

    # -- construction -----------------------------------------------------
    def _build_groups(self) -> list[BlockGroup]:
        g = self.geometry
        groups = []
        for (n, m, h, sub), blocks in _by_shape(self.blocks).items():
            assert g.metric is not None  # metric=None discovers no blocks
            x0 = self._group_point(blocks)
            man = GLQuotient(n, m, g.metric, g.eps, g.retraction, validate=False,
                             steps=g.exact_steps, subalgebra=sub)
            try:
                space = man.at(x0)
            except RankDeficientError as e:
                raise RankDeficientError(_name_rank_deficient(
                    blocks, self.base, g, self.dtype, str(e))) from None
            groups.append(BlockGroup(n, m, h, blocks, man, space))
        return groups

    _group_point, _flat_point = _group_point, _flat_point  # a subclass may keep some rows
    _adaptive_space = staticmethod(adaptive_space)  # and project on the whole adaptive vector

    def _device(self) -> torch.device:
        """Device of the model's parameters (CPU for a model without any)."""
        return next(iter(self.base.values())).device if self.base else torch.empty(0).device

    # -- packed vectors ---------------------------------------------------------
    @property
    def D(self) -> int:
        """Length of a packed tangent vector."""
        return self.space.D

    @property
    def c2(self) -> torch.Tensor:
        r"""$w^2 + \varepsilon$ of the adaptive entries."""
        return self.adaptive_space.c2

    @property
    def base_points(self) -> list[torch.Tensor]:
        """The base points of the factors of `space`: `[x0_1, …, x0_K, w0]`."""
        return self.space.points()

    def zeros(self) -> torch.Tensor:
        """The zero tangent vector `(D,)`."""
        return self.space.zeros()

    @cached_property
    def _w2(self) -> torch.Tensor:
        parts = []
        for grp in self.groups:
            c2 = grp.x0**2 + self.geometry.adaptive_eps
            if bool((c2 == 0).any()):
                names = sorted({p for b in grp.blocks for p in b.params})[:4]
                raise ZeroWeightError(
                    f"the adaptive-norm ball measures GL-block entries by ξ/|w|, but blocks with "
                    f"parameters {names} have zero entries (often untrained biases); use "
                    "Geometry(adaptive_eps > 0) for ξ²/(w² + ε)"
                )
            parts.append(c2)
        return self.space.join(parts + [self.c2])

    def w2(self) -> torch.Tensor:
        r"""$c^2 = w^2 + \varepsilon$ (`adaptive_eps`) of every entry, packed `(D,)`.

        Raises `ZeroWeightError` if a GL-block entry is zero and $\varepsilon = 0$.
        """
        return self._w2

    # -- points and parameters ----------------------------------------------------
    def retract(self, xi: torch.Tensor) -> list[torch.Tensor]:
        r"""The points reached from the base point along the packed `xi`, one per factor, by the
        geometry's retractions (GL blocks: `retraction`, e.g. Eq. 5; other weights:
        `adaptive_retraction`). Differentiable in `xi`."""
        return self.space.retract(xi, self.kinds)

    def to_params(self, points: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every parameter, with the given points (one per factor) written in, out of place.

        Parameters not touched keep their (detached) base tensors. Differentiable in
        `points`; the model's own parameters are never read or written.
        """
        # One split per tensor, not one slice per parameter: the backward of a split is a
        # single concatenation, while every slice's backward materialises a zero tensor the
        # size of the whole flat vector (quadratic in the number of parameters).
        pieces = torch.split(points[-1], [e.stop - e.start for e in self.entries])
        return self._to_params(points[:-1], pieces)

    def _to_params(self, points: Sequence[torch.Tensor], pieces: Sequence[torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
        new = dict(self.base)
        for e, piece in zip(self.entries, pieces, strict=True):
            base = self.base[e.name]
            piece = piece.to(base.dtype)
            if e.index is None:
                new[e.name] = piece.view(base.shape)
            else:
                new[e.name] = base.reshape(-1).index_copy(0, e.index, piece).view(base.shape)
        for grp, x in zip(self.groups, points, strict=False):
            for b, rows in zip(grp.blocks, torch.split(x, [b.heads for b in grp.blocks]),
                               strict=True):
                scatter_block(b, rows, new)
        return new

    def params_at(self, xi: torch.Tensor) -> dict[str, torch.Tensor]:
        """`to_params(retract(xi))`: the perturbed parameters."""
        return self.to_params(self.retract(xi))

    def params_and_leaves(self, xi: torch.Tensor, layout: RowLayout | None = None
                          ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        r"""The perturbed parameters at `xi` and leaf tensors whose gradients, flattened and
        concatenated in order (`pack_grads`), are the gradient with respect to `xi`.

        The leaves are the block parts of `xi` and, when the adaptive retraction is first order
        ($w + \xi$, identity Jacobian), the perturbed adaptive entries themselves, written into
        a buffer reused from call to call (valid until the next call): the backward pass then
        produces the adaptive gradient directly, without copying it through $\xi$. Otherwise
        the adaptive part of `xi` is one more leaf.

        With a `layout` ([`RowLayout`][quotient_manifolds.models.row_layout.RowLayout], first
        order only), `xi` is of that layout: the kept adaptive entries are written, the others
        stay at their base values; the leaves are whole parameters, and `pack_grads` with the
        same `layout` packs their gradients.
        """
        space = self.space if layout is None else layout.space
        parts = [p.detach() for p in space.split(xi.detach())]
        leaves = [p.requires_grad_() for p in parts[:-1]]
        points = [s.retract(p, k) for s, p, k in zip(self.space.spaces[:-1], leaves,
                                                        self.kinds[:-1], strict=True)]
        xa = parts[-1]
        if self.geometry.adaptive_retraction == "first_order":
            if self._point_buffer is None:
                self._point_buffer = torch.empty_like(self.w0)
            if layout is None:
                pa = self.adaptive_space.retract(xa, "first_order", out=self._point_buffer)
                self._point_origin = None
            else:
                pa = self._point_buffer
                if self._point_origin is not layout.origin:  # rows of another layout or of a
                    pa.copy_(self.w0)  # full vector may be perturbed there: start from w
                    self._point_origin = layout.origin
                layout.write_point(pa, xa)
            pieces = [t.requires_grad_() for t in
                      torch.split(pa, [e.stop - e.start for e in self.entries])]
            leaves += pieces
            return self._to_params(points, pieces), leaves
        if layout is not None:
            raise ValueError("a RowLayout needs the first-order adaptive retraction "
                             "(Geometry(adaptive_retraction='first_order'))")
        xa.requires_grad_()
        leaves.append(xa)
        return self.to_params(points + [self.adaptive_space.retract(xa, self.kinds[-1])]), leaves

    def pack_grads(self, leaves: Sequence[torch.Tensor],
                   grads: Sequence[torch.Tensor | None], out: torch.Tensor | None = None,
                   layout: RowLayout | None = None) -> torch.Tensor:
        """The flat gradient with respect to ξ from the leaves' gradients (`None`: zero), in the
        full layout or in `layout` (the leaves of `params_and_leaves`)."""
        if layout is not None:
            return layout.pack(grads, out)
        flat = [torch.zeros(t.numel(), dtype=t.dtype, device=t.device) if g is None
                else g.reshape(-1) for t, g in zip(leaves, grads, strict=True)]
        if not flat:
            return torch.zeros(0, dtype=self.dtype, device=self.w0.device)
        return torch.cat(flat, out=out) if out is not None else torch.cat(flat)

    def row_layout(self, grads: Sequence[torch.Tensor | None], *, max_fraction: float = 0.5,
                   min_saving: float = 0.125) -> RowLayout | None:
        """`RowLayout.from_gradients` here, the entries of `RowsConstraint.local` kept whole."""
        return RowLayout.from_gradients(self, grads, max_fraction=max_fraction,
                                        min_saving=min_saving,
                                        whole=RowsConstraint.local(self.translations))

    def layout_adaptive_space(self, layout: RowLayout) -> AdaptiveTangentSpace:
        """The adaptive tangent space of a row layout (`rows_space`)."""
        return rows_space(self.adaptive, layout.w0, layout.shifts, self.translations)

    def gather(self, params: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Points of an arbitrary parameter dict, one per factor (the inverse of `to_params`)."""
        out = [torch.cat([gather_block(b, params).to(self.dtype) for b in grp.blocks])
               for grp in self.groups]
        pieces = [params[e.name].reshape(-1) if e.index is None
                  else params[e.name].reshape(-1)[e.index] for e in self.entries]
        out.append(torch.cat([p.to(self.dtype) for p in pieces]) if pieces
                   else torch.zeros(0, dtype=self.dtype, device=self.w0.device))
        return out

    # -- reporting -------------------------------------------------------------
    def describe(self) -> dict:
        """Blocks, groups, fallbacks and adaptive sizes, JSON-friendly."""
        return {
            **self.geometry.settings(),
            "blocks": [b.describe() for b in self.blocks],
            "groups": [{"n": grp.n, "m": grp.m, "h": grp.h, "count": int(grp.x0.shape[0])}
                       for grp in self.groups],
            "fallbacks": [f.to_dict() for f in self.fallbacks],
            "perturbed_parameters": len(self.selected),
            "adaptive_entries": int(self.w0.numel()),
            "masked_zero_weights": self.n_masked_zeros,
        }
