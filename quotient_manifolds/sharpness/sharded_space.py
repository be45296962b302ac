r"""The tangent space and geometry of a model-parallel sharpness call, split by rows.

Each of the $P$ ranks of the model-parallel group holds a contiguous share of every factor of
the packed perturbation: of a GL block group `(B, n + m, h)`, the heads $b \in [b_r, b_{r+1})$
(whole heads: every $h \times h$ Gram $x^\top x$, inverse and Sylvester solve of a head is
computed on the rank that holds it, no collective); of the flat adaptive vector, the entries
$[a_r, a_{r+1})$. The shares are `torch.tensor_split`'s, so ranks differ by at most one head
or entry.

Every other operation of the ascent acts head by head or entry by entry, except the reductions
of the product metric: the inner product of two perturbations is a sum over factors, heads and
entries,

$$
\langle u, v\rangle_w = \sum_{r} \sum_{k} \langle u_k^{(r)}, v_k^{(r)}\rangle_{x_k^{(r)}},
$$

so [`ShardedSpace`][quotient_manifolds.sharpness.sharded_space.ShardedSpace] sums its factors'
local inner products on the rank and all-reduces the $K + 1$ numbers (one collective per norm
or inner product, of $K + 1$ scalars). The norm of the Riemannian gradient (the ascent
direction's normalisation) is one more scalar all-reduce.

The loss needs the whole perturbed model:
[`ShardedGeometry.params_at`][quotient_manifolds.sharpness.sharded_space.ShardedGeometry.params_at]
retracts the local share, all-gathers the points (one `all_gather` of the packed points per
evaluation) and writes them into the parameters. Every rank of the group then computes the
same loss and the same full gradient; the backward of the gather keeps the rank's own rows
(no collective: the gradients are equal on every rank already).

The projection onto the complement of the translation orbits (the horizontal adaptive space of
the complete group) couples entries across a parameter (a mean along an axis, a shift of an
embedding table), which a contiguous slice cuts:
[`ShardedConstraint`][quotient_manifolds.sharpness.sharded_space.ShardedConstraint]
all-gathers the slices of the vector (one `all_gather` of the adaptive part per projection,
and one of the weights $m$ per new $m$), projects the whole vector with the constraint built
on the whole base point, exactly as one process does, and keeps this rank's slice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ShardedModelError
from ..manifolds.adaptive import AdaptiveEuclidean, AdaptiveTangentSpace
from ..manifolds.base import Generator, TangentSpace, standard_normal
from ..manifolds.constrained import SlicedInvC2
from ..manifolds.product import ProductTangentSpace
from ..models.blocks import BlockSpec, gather_block
from ..models.config import QuotientConfig
from ..models.model_geometry import ModelGeometry
from ..models.row_layout import RowLayout
from ..models.translations import TranslationConstraint, adaptive_space

__all__ = ["Partition", "ShardedConstraint", "ShardedSpace", "ShardedGeometry"]


def _dist():
    import torch.distributed as dist

    return dist


def _backend(group) -> str:
    return str(_dist().get_backend(group))


@dataclass(frozen=True)
class Partition:
    """Who holds which rows: `counts[k][r]` rows (dim 0) of factor `k` on rank `r` of `group`;
    `trailing[k]` is the shape of one row."""

    group: object
    rank: int
    size: int
    counts: tuple[tuple[int, ...], ...]
    trailing: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(shapes: Sequence[tuple[int, ...]], group: object, rank: int, size: int
           ) -> Partition:
        counts = tuple(tuple(int(t.shape[0]) for t in torch.tensor_split(
            torch.empty(sh[0], 0), size)) for sh in shapes)
        return Partition(group, rank, size, counts, tuple(tuple(sh[1:]) for sh in shapes))

    def rows(self, k: int, r: int | None = None) -> tuple[int, int]:
        """The rows `[start, stop)` of factor `k` held by rank `r` (default: this rank)."""
        r = self.rank if r is None else r
        start = sum(self.counts[k][:r])
        return start, start + self.counts[k][r]

    def numel(self, k: int, r: int) -> int:
        n = self.counts[k][r]
        for d in self.trailing[k]:
            n *= d
        return n


class _GatherPoints(torch.autograd.Function):
    """Forward: the whole points of every factor from each rank's rows (one `all_gather`);
    backward: this rank's rows of the gradients (the same on every rank)."""

    @staticmethod
    def forward(ctx, part: Partition, *local: torch.Tensor):
        ctx.part = part
        ctx.meta = [(t.dtype, t.device) for t in local]
        dtype, device = local[0].dtype, local[0].device
        sizes = [sum(part.numel(k, r) for k in range(len(local))) for r in range(part.size)]
        width = max(sizes)
        mine = torch.zeros(width, dtype=dtype, device=device)
        if local:
            flat = torch.cat([t.detach().reshape(-1) for t in local])
            mine[:flat.numel()] = flat
        bufs = [torch.empty(width, dtype=dtype, device=device) for _ in range(part.size)]
        _dist().all_gather(bufs, mine, group=part.group)
        out = []
        offsets = [0] * part.size
        for k in range(len(local)):
            pieces = []
            for r in range(part.size):
                n = part.numel(k, r)
                pieces.append(bufs[r][offsets[r]:offsets[r] + n].view(part.counts[k][r],
                                                                      *part.trailing[k]))
                offsets[r] += n
            out.append(torch.cat(pieces))
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        part = ctx.part
        out = []
        for k, g in enumerate(grads):
            a, b = part.rows(k)
            dtype, device = ctx.meta[k]
            if g is None:
                out.append(torch.zeros(b - a, *part.trailing[k], dtype=dtype, device=device))
            else:
                out.append(g[a:b])
        return (None, *out)


class ShardedSpace(ProductTangentSpace):
    """A [`ProductTangentSpace`][quotient_manifolds.manifolds.product.ProductTangentSpace] of
    this rank's rows of every factor, whose reductions are summed over the ranks of the
    partition's group (see the module docstring). `full_shapes` are the factors' whole base
    point shapes (the noise of `sample` is drawn at that shape, so the draws are those of one
    process)."""

    def __init__(self, spaces: Sequence[TangentSpace], part: Partition,
                 full_shapes: Sequence[tuple[int, ...]], labels: Sequence[str],
                 kinds: Sequence[str | None]) -> None:
        super().__init__(spaces, (), labels, kinds)
        self.part = part
        self.full_shapes = [tuple(s) for s in full_shapes]

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = t.detach().clone()
            _dist().all_reduce(t, group=self.part.group)
        return t

    def inners(self, u: torch.Tensor, v: torch.Tensor | None = None) -> list[torch.Tensor]:
        parts = super().inners(u, v)
        if not parts:
            return parts
        return list(self._sum(torch.stack(parts)).unbind())

    def egrad2rgrad_and_norm2(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r, n2 = super().egrad2rgrad_and_norm2(g)
        return r, self._sum(n2)

    def vertical_norm2(self, u: torch.Tensor) -> torch.Tensor:
        return self._sum(super().vertical_norm2(u))

    def sample(self, generator: Generator = None) -> torch.Tensor:
        """This rank's rows of the standard Gaussian that one process draws: the noise of each
        factor is drawn whole (on the host, as one process does) and sliced."""
        parts = []
        for k, (s, shape) in enumerate(zip(self.spaces, self.full_shapes, strict=True)):
            a, b = self.part.rows(k)
            z = standard_normal(shape, generator, s.x0.dtype, "cpu")[a:b]
            parts.append(s.sample(noise=z.to(s.x0.device)))
        return self.join(parts)

    def sample_weighted(self, w2: torch.Tensor, generator: Generator = None) -> torch.Tensor:
        raise ShardedModelError("a model-parallel call measures in the metric ball only "
                                "(Geometry(ball='metric'))")


class ShardedConstraint:
    r"""A [`LinearConstraint`][quotient_manifolds.manifolds.constrained.LinearConstraint] on
    this rank's slice `[lo, hi)` of the flat adaptive vector: `project(u, m)` all-gathers the
    slices of `u` (and of `m`, once per `m`), applies the whole-vector `constraint`
    ($\Pi_V$ of one process) and returns this rank's slice of the result. Every rank of `group`
    must call it the same number of times (a collective)."""

    def __init__(self, constraint: TranslationConstraint, group: object, rank: int,
                 size: int, total: int) -> None:
        self.constraint, self.group = constraint, group
        self.counts = [b - a for a, b in (_share(total, r, size) for r in range(size))]
        self.lo, self.hi = _share(total, rank, size)
        # (this rank's m, whole m)
        self._m: tuple[torch.Tensor | SlicedInvC2, torch.Tensor] | None = None

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """The whole vectors `(..., total)` from every rank's slices `(..., hi - lo)`."""
        rows = x.detach().reshape(-1, x.shape[-1])
        width = max(self.counts)
        mine = torch.zeros(rows.shape[0], width, dtype=x.dtype, device=x.device)
        mine[:, :rows.shape[1]] = rows
        bufs = [torch.empty_like(mine) for _ in self.counts]
        _dist().all_gather(bufs, mine, group=self.group)
        whole = torch.cat([b[:, :n] for b, n in zip(bufs, self.counts, strict=True)], dim=1)
        return whole.reshape(*x.shape[:-1], whole.shape[-1])

    def project(self, u: torch.Tensor, m: torch.Tensor | SlicedInvC2, gradient: bool = False,
                inplace: bool = False) -> torch.Tensor:
        r"""This rank's slice of $\Pi_V$ of the whole vector (not differentiable); nothing is
        gathered when no component applies (`gradient`: see `TranslationConstraint.project`);
        with `inplace`, written into `u`."""
        if not self.constraint.active(gradient):
            return u
        if torch.is_grad_enabled() and u.requires_grad:
            raise ShardedModelError("the sharded translation projection is not differentiable; "
                                    "call it under torch.no_grad() on a detached vector")
        if self._m is None or self._m[0] is not m:  # the constraint caches on the whole m
            self._m = (m, self._gather(m if isinstance(m, torch.Tensor) else m[:]))
        whole = self.constraint.project(self._gather(u), self._m[1], gradient, inplace=True)
        mine = whole[..., self.lo:self.hi]
        return u.copy_(mine) if inplace else mine


@dataclass
class _GroupInfo:
    """What the engine reads of a block group: its shape, blocks and (a meta tensor of) the
    shape of its whole base point."""

    n: int
    m: int
    h: int
    blocks: list[BlockSpec]
    x0: torch.Tensor


def _share(n: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s rows `[start, stop)` of `n` (`torch.tensor_split`'s shares)."""
    q, r = divmod(n, size)
    start = rank * q + min(rank, r)
    return start, start + q + (1 if rank < r else 0)


class ShardedGeometry(ModelGeometry):
    """The [`ModelGeometry`][quotient_manifolds.models.model_geometry.ModelGeometry] of a
    model-parallel call: the same blocks, entries and base parameters as one process's, with
    this rank's rows of the packed points only (see the module docstring).

    The packed points are never built whole: a group's point is read block by block (only
    the blocks with heads on this rank), the flat adaptive point parameter by parameter
    (only the entries in this rank's range), and the tangent spaces (Grams, metric weights)
    are made of these rows. A failure on one rank (e.g. a rank-deficient head) is raised on
    every rank of the group.
    """

    def __init__(self, model: nn.Module, geometry: QuotientConfig, *, group: object,
                 rank: int, size: int, **kw: Any) -> None:
        self._mp = (group, rank, size)
        error: BaseException | None = None
        try:
            super().__init__(model, geometry, **kw)
        except BaseException as e:  # noqa: BLE001 - told to the other ranks, then raised
            error = e
        flag = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64,
                            device=self._device() if error is None else "cpu")
        if error is not None and flag.device.type == "cpu" and _backend(group) == "nccl":
            flag = flag.cuda()
        _dist().all_reduce(flag, group=group)
        if error is not None:
            raise error
        if float(flag) > 0:
            raise ShardedModelError(
                f"{int(float(flag))} other rank(s) of the model-parallel group failed to set up "
                "the geometry (the error is raised there in full); this rank stopped with it")
        self.claimed = {}  # the masks of the blocks' entries (1 B per weight): read, done
        full_shapes = [(sum(b.heads for b in grp.blocks), grp.n + grp.m, grp.h)
                       for grp in self.groups] + [(self._adaptive_total,)]
        self.part = Partition.of(full_shapes, group, rank, size)
        spaces = [grp.space for grp in self.groups] + [self.adaptive_space]
        self.groups = [_GroupInfo(g.n, g.m, g.h, g.blocks,  # type: ignore[misc]  # shapes only
                                  torch.empty(sh, device="meta"))
                       for g, sh in zip(self.groups, full_shapes, strict=False)]
        self.space = ShardedSpace(spaces, self.part, full_shapes, self.space.labels,
                                  self.kinds)
        dtypes = {self.base[n].dtype for n in self.selected
                  if self.base[n].is_floating_point()}
        # the points are written into the weights in the weights' dtype: gathered in it when
        # it is one (half the traffic and memory of float32 points for a bfloat16 model)
        self.wire = dtypes.pop() if len(dtypes) == 1 else self.dtype

    def _group_point(self, blocks: Sequence[BlockSpec]) -> torch.Tensor:
        _, rank, size = self._mp
        lo, hi = _share(sum(b.heads for b in blocks), rank, size)
        rows, at = [], 0
        for b in blocks:
            a, z = max(lo, at), min(hi, at + b.heads)
            if a < z:
                rows.append(gather_block(b, self.base)[a - at:z - at].to(self.dtype))
            at += b.heads
        if rows:
            return torch.cat(rows)
        return torch.zeros(0, blocks[0].n + blocks[0].m, blocks[0].h, dtype=self.dtype,
                           device=self._device())

    def _flat_point(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        _, rank, size = self._mp
        self._adaptive_total = total = sum(int(p.numel()) for p in pieces)
        lo, hi = _share(total, rank, size)
        out, at = [], 0
        for p in pieces:
            a, z = max(lo, at), min(hi, at + p.numel())
            if a < z:
                out.append(p.reshape(-1)[a - at:z - at].to(self.dtype))
            at += p.numel()
        return torch.cat(out) if out else torch.zeros(0, dtype=self.dtype,
                                                      device=self._device())

    def _adaptive_space(  # type: ignore[override]  # a method where the base has a function
        self, geometry: QuotientConfig, w0: torch.Tensor, folds: Sequence[Any],
        base: Mapping[str, torch.Tensor], entries: Sequence[Any], dtype: torch.dtype,
    ) -> tuple[AdaptiveEuclidean, AdaptiveTangentSpace, TranslationConstraint | None]:
        """The adaptive space of this rank's slice `w0`, horizontal to the translation orbits
        through the whole-vector projection
        ([`ShardedConstraint`][quotient_manifolds.sharpness.sharded_space.ShardedConstraint])."""
        group, rank, size = self._mp
        total = self._adaptive_total
        return adaptive_space(geometry, w0, folds, base, entries, dtype, size=total,
                              wrap=lambda tc: ShardedConstraint(tc, group, rank, size, total))

    def w2(self) -> torch.Tensor:
        raise ShardedModelError("a model-parallel call measures in the metric ball only "
                                "(Geometry(ball='metric')); the adaptive-norm balls and "
                                "adaptive_sharpness are not sharded")

    def gather(self, params: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Not available: this geometry holds this rank's rows only."""
        raise ShardedModelError("ShardedGeometry holds this rank's rows only; use a "
                                "ModelGeometry of the unsharded model to gather points")

    def full_points(self, points: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The whole points of every factor from this rank's (differentiable)."""
        return list(_GatherPoints.apply(self.part, *(p.to(self.wire) for p in points)))

    def params_at(self, xi: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every parameter at this rank's share `xi` of the perturbation and the other ranks'."""
        return self.to_params(self.full_points(self.retract(xi)))

    def params_and_leaves(self, xi: torch.Tensor, layout: RowLayout | None = None
                          ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """The perturbed parameters and one leaf per factor (this rank's part of `xi`)."""
        if layout is not None:
            raise ValueError("a model-parallel geometry packs every row (no RowLayout)")
        leaves = [p.detach().requires_grad_() for p in self.space.split(xi.detach())]
        points = [s.retract(p, k) for s, p, k in zip(self.space.spaces, leaves, self.kinds,
                                                        strict=True)]
        return self.to_params(self.full_points(points)), leaves

    def row_layout(self, grads: Sequence[torch.Tensor | None], *, max_fraction: float = 0.5,
                   min_saving: float = 0.125) -> None:
        """No restriction to active rows: every rank packs all its rows."""
        return None
