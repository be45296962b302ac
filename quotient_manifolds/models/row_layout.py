r"""A packing of the perturbation that keeps, of some adaptive entries, only some rows.

An embedding whose batch reads few tokens has zero gradient on the rows of the other tokens:
Auto-PGD started at $\xi = 0$ never moves them, so the iterations can run on the rows that ever
had a gradient ([`RowLayout`][quotient_manifolds.models.row_layout.RowLayout]), with the same
iterates up to the order of summation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..manifolds.product import ProductTangentSpace

__all__ = ["PackedGeometry", "RowLayout"]


class PackedGeometry(Protocol):
    """What a row layout reads of a
    [`ModelGeometry`][quotient_manifolds.models.model_geometry.ModelGeometry]."""

    @property
    def D(self) -> int: ...

    w0: torch.Tensor
    entries: list
    base: dict[str, torch.Tensor]
    groups: list
    space: ProductTangentSpace
    geometry: Any
    adaptive: Any
    dtype: torch.dtype
    kinds: list

    def layout_adaptive_space(self, layout: RowLayout) -> Any: ...


def _row_shape(t: torch.Tensor) -> tuple[int, int]:
    """`(rows, row size)` of a parameter: slices along dim 0 (a 1-D parameter is one row)."""
    R = t.shape[0] if t.dim() >= 2 else 1
    return R, (t.numel() // R if R else 0)


def _nonzero_rows(g: torch.Tensor | None, R: int, C: int) -> torch.Tensor | None:
    """`(R,)` flags: the rows of the gradient `g` with an entry that is not 0 (NaN counts as
    not 0); `None` for a gradient that is `None` (identically zero)."""
    if g is None:
        return None
    return g.reshape(R, C).any(1)


@dataclass
class _Whole:
    """Whole adaptive entries `members`, side by side: at `full` in the full adaptive vector and
    at `part` in the adaptive part of a `RowLayout`."""

    full: slice
    part: slice
    members: tuple[int, ...]


@dataclass
class _Rows:
    """The rows `rows` of the adaptive entry `entry` (shaped `shape`, `(rows, row size)`), at
    `full` in the full adaptive vector and at `part` in the adaptive part of a `RowLayout`."""

    full: slice
    part: slice
    entry: int
    shape: tuple[int, int]
    rows: torch.Tensor  # (k,) long, the rows kept
    mask: torch.Tensor  # (R,) bool, the rows kept
    w0: torch.Tensor  # (k, C): the base weights of the rows kept


class RowLayout:
    r"""A packing of the perturbation that keeps, of some adaptive entries, only some rows.

    `rows` maps the index of a whole-parameter entry of `geo.entries` to the indices of its rows
    (slices along dim 0) that are kept; the other rows of that entry stay at their base values
    (their perturbation is 0). The block parts and the other adaptive entries are kept whole.
    A tangent vector in this layout has length `D`: the block parts as in the full packing,
    then the kept adaptive entries and rows (an entry's rows in the order of `rows`).
    [`take`][quotient_manifolds.models.row_layout.RowLayout.take] and
    [`put`][quotient_manifolds.models.row_layout.RowLayout.put] convert from and to the
    full packing; `space` is the product tangent space of the kept entries (the same block
    tangent spaces, the adaptive metric at the kept weights).

    The layouts grown from one another
    ([`grow`][quotient_manifolds.models.row_layout.RowLayout.grow]) share an `origin`;
    their rows only ever extend.

    Parameters
    ----------
    geo : ModelGeometry
        The geometry (first-order adaptive retraction).
    rows : mapping of int to Tensor
        Entry index to the indices of the rows kept (1-D, long).
    origin : object, optional
        The `origin` of the layout this one grows (a new one if omitted).
    """

    def __init__(self, geo: PackedGeometry, rows: Mapping[int, torch.Tensor],
                 origin: object | None = None) -> None:
        self.geo = geo
        self.rows = dict(rows)
        self.origin = object() if origin is None else origin
        self.nb = geo.D - geo.w0.numel()  # the block parts
        whole: list[_Whole] = []
        parts: list[_Rows] = []
        pos = 0
        for i, e in enumerate(geo.entries):
            size = e.stop - e.start
            if i not in self.rows:
                last = whole[-1] if whole else None
                if last is not None and last.full.stop == e.start and last.part.stop == pos:
                    whole[-1] = _Whole(slice(last.full.start, e.stop),
                                       slice(last.part.start, pos + size), (*last.members, i))
                else:
                    whole.append(_Whole(slice(e.start, e.stop), slice(pos, pos + size), (i,)))
                pos += size
                continue
            R, C = _row_shape(geo.base[e.name])
            r = self.rows[i].to(device=geo.w0.device, dtype=torch.long)
            mask = torch.zeros(R, dtype=torch.bool, device=r.device)
            mask[r] = True
            w0 = geo.w0[e.start : e.stop].view(R, C).index_select(0, r)
            parts.append(_Rows(slice(e.start, e.stop), slice(pos, pos + r.numel() * C), i,
                               (R, C), r, mask, w0))
            pos += r.numel() * C
        self.whole, self.parts = whole, parts
        self.D = self.nb + pos
        self.w0 = self._take_adaptive(geo.w0, geo.w0.new_empty(pos))
        spaces = [*geo.space.spaces[:-1], geo.layout_adaptive_space(self)]
        self.space = ProductTangentSpace(spaces, (), geo.space.labels, geo.kinds)

    @classmethod
    def from_gradients(cls, geo: PackedGeometry, grads: Sequence[torch.Tensor | None], *,
                       max_fraction: float = 0.5, min_saving: float = 0.125,
                       whole: Sequence[tuple[int, int]] = ()) -> RowLayout | None:
        """The layout that keeps, of every whole-parameter adaptive entry, only the rows whose
        gradient in `grads` is not identically zero, where at most `max_fraction` of the rows
        are kept; `None` if it would drop less than `min_saving` of the entries of a tangent
        vector, or if the adaptive retraction is not first order.

        `grads` are the gradients of the leaves of
        [`params_and_leaves`][quotient_manifolds.models.model_geometry.ModelGeometry.params_and_leaves]
        (full packing; `None`: zero). Rows are slices along dim 0 (a 1-D parameter is one row;
        NaN counts as non-zero). An embedding whose batch reads few tokens is the typical case:
        the rows of the other tokens have zero gradient. The entries that meet a span of
        `whole` (flat adaptive positions) are kept whole.
        """
        if geo.geometry.adaptive_retraction != "first_order":
            return None
        rows: dict[int, torch.Tensor] = {}
        dropped = 0
        for i, e in enumerate(geo.entries):
            if e.index is not None or e.stop == e.start or any(
                    a < e.stop and e.start < b for a, b in whole):
                continue
            R, C = _row_shape(geo.base[e.name])
            g = grads[len(geo.groups) + i]
            live = _nonzero_rows(g, R, C)
            k = int(live.sum()) if live is not None else 0
            if k <= max_fraction * R:
                rows[i] = (live.nonzero().squeeze(1) if live is not None
                           else torch.zeros(0, dtype=torch.long, device=geo.w0.device))
                dropped += (R - k) * C
        if not rows or dropped < min_saving * geo.D:
            return None
        return cls(geo, rows)

    @property
    def shifts(self) -> list[tuple[int, int, int]]:
        """`(start, stop, offset)` of each run of whole entries: the flat adaptive positions
        `[start, stop)` sit at `position + offset` in this layout's adaptive part."""
        return [(w.full.start, w.full.stop, w.part.start - w.full.start) for w in self.whole]

    @property
    def kept(self) -> int:
        """The number of adaptive entries kept."""
        return self.D - self.nb

    def _take_adaptive(self, va: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for w in self.whole:
            out[w.part].copy_(va[w.full])
        for p in self.parts:
            torch.index_select(va[p.full].view(p.shape), 0, p.rows,
                               out=out[p.part].view(-1, p.shape[1]))
        return out

    def take(self, v: torch.Tensor) -> torch.Tensor:
        """The entries of a full-packing vector `(D_full,)` that this layout keeps, `(D,)`."""
        out = v.new_empty(self.D)
        out[: self.nb].copy_(v[: self.nb])
        self._take_adaptive(v[self.nb :], out[self.nb :])
        return out

    def put(self, v: torch.Tensor) -> torch.Tensor:
        """The full-packing vector with the entries of `v` (this layout) and 0 elsewhere."""
        out = v.new_zeros(self.geo.D)
        out[: self.nb].copy_(v[: self.nb])
        va, oa = v[self.nb :], out[self.nb :]
        for w in self.whole:
            oa[w.full].copy_(va[w.part])
        for p in self.parts:
            oa[p.full].view(p.shape).index_copy_(0, p.rows, va[p.part].view(-1, p.shape[1]))
        return out

    def write_point(self, pa: torch.Tensor, xa: torch.Tensor) -> None:
        r"""$w + \xi$ on the kept entries, written into the full adaptive point `pa`, from the
        adaptive part `xa` of a vector of this layout (the other entries of `pa` untouched)."""
        w0 = self.geo.w0
        for w in self.whole:
            torch.add(w0[w.full], xa[w.part], out=pa[w.full])
        for p in self.parts:
            pa[p.full].view(p.shape).index_copy_(0, p.rows,
                                                 p.w0 + xa[p.part].view(-1, p.shape[1]))

    def pack(self, grads: Sequence[torch.Tensor | None], out: torch.Tensor | None = None
             ) -> torch.Tensor:
        """The gradient in this layout from the gradients of the leaves of
        [`params_and_leaves`][quotient_manifolds.models.model_geometry.ModelGeometry.params_and_leaves]
        (`None`: zero), into `out` if given."""
        geo = self.geo
        out = torch.empty(self.D, dtype=geo.dtype, device=geo.w0.device) if out is None else out
        nb = len(geo.groups)
        pos = 0
        for g, size in zip(grads[:nb], geo.space.sizes[:-1], strict=True):
            _copy_or_zero(out[pos : pos + size], g)
            pos += size
        oa = out[self.nb :]
        for w in self.whole:
            shift = w.part.start - w.full.start
            for i in w.members:
                e = geo.entries[i]
                _copy_or_zero(oa[e.start + shift : e.stop + shift], grads[nb + i])
        for p in self.parts:
            o = oa[p.part].view(-1, p.shape[1])
            g = grads[nb + p.entry]
            if g is None:
                o.zero_()
            else:
                torch.index_select(g.reshape(p.shape), 0, p.rows, out=o)
        return out

    def grow(self, grads: Sequence[torch.Tensor | None]) -> RowLayout | None:
        """The layout that also keeps every row not kept here whose gradient in `grads` (as in
        `pack`) is not identically zero, appended after the kept rows; `None` if there is
        none."""
        nb = len(self.geo.groups)
        new: dict[int, torch.Tensor] = {}
        for p in self.parts:
            live = _nonzero_rows(grads[nb + p.entry], *p.shape)
            if live is None:
                continue
            extra = (live & ~p.mask).nonzero().squeeze(1)
            if extra.numel():
                new[p.entry] = torch.cat([p.rows, extra])
        if not new:
            return None
        return RowLayout(self.geo, {**self.rows, **new}, origin=self.origin)


def _copy_or_zero(out: torch.Tensor, g: torch.Tensor | None) -> None:
    """`out = g` (flattened), or 0 for `g = None`."""
    if g is None:
        out.zero_()
    else:
        out.copy_(g.reshape(-1))
