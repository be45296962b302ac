r"""Data-parallel sharpness under ``torch.distributed`` (``torchrun``).

Two ways to share the work of [`geodesic_sharpness`][quotient_manifolds.geodesic_sharpness] and
[`adaptive_sharpness`][quotient_manifolds.adaptive_sharpness] among the ``W`` ranks of a process
group (see ``docs/distributed.md``). Nothing is shared unless asked for: ``shard=None`` (the
default) runs everything on this process, even inside a ``torchrun`` job, and no collective is
called.

``shard="batches"``
    Rank ``r`` solves the inner maximisation of the batches ``b`` with ``b mod W = r``,
    exactly as a single process would; the per-batch records are then gathered, so every
    rank returns the same [`SharpnessResult`][quotient_manifolds.SharpnessResult], whose per-batch
    values equal a single-process run's.  Every rank must iterate the same ``data`` in the same
    order.

``shard="within_batch"``
    Every rank takes a slice of every batch (dim 0 of each tensor, by default); the
    loss is the slice-size weighted sum of the per-rank losses and the gradients are
    summed over ranks:

    $$
    L = \sum_r \frac{n_r}{N} L_r, \qquad ∇_ξ L = \sum_r \frac{n_r}{N} ∇_ξ L_r,
    $$

    which is the full-batch loss when ``loss_fn`` returns a *mean over the examples* of
    its batch.  The tangent vector ξ is the same on every rank throughout (every rank
    takes the same steps on the same all-reduced values), so the value equals the
    single-process one up to float rounding of the sums.

``shard="none"`` (or ``None``) runs everything on this process. Options other than the mode
go into a [`Shard`][quotient_manifolds.sharpness.distributed.Shard]:
``shard=Shard("within_batch", split_batch=fn, group=g)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import DistributedError, InvalidArgumentError
from ..state import fingerprint
from ..tree import leading_size, tree_map

__all__ = ["SHARD_MODES", "Shard", "ShardContext", "default_split", "resolve_shard"]

SHARD_MODES = ("none", "batches", "within_batch")

SplitFn = Callable[[object, int, int], tuple[object, int]]
#: a loss evaluator `(params, batch) -> loss` of the engine
Evaluator = Callable[[dict[str, torch.Tensor], object], torch.Tensor]


def _dist():
    import torch.distributed as dist

    return dist


def default_split(batch: object, rank: int, world_size: int) -> tuple[object, int]:
    """Rank ``rank``'s slice of ``batch`` and its number of examples.

    Every tensor (also inside dicts, lists and tuples, e.g. a Hugging Face batch
    ``{"input_ids": …, "labels": …}`` or ``(x, y)``) is cut along dim 0 by
    `torch.tensor_split` into ``world_size`` near-equal parts; 0-d tensors and
    non-tensors are passed whole.  The size is dim 0 of the first tensor found.
    """
    n = leading_size(batch)
    if n is None:
        raise DistributedError(
            "shard='within_batch' found no tensor with a batch dimension in the batch; "
            "pass split_batch=fn with fn(batch, rank, world_size) -> (slice, n_examples)"
        )
    part = tree_map(lambda t: torch.tensor_split(t, world_size, dim=0)[rank] if t.dim() else t,
                    batch)
    return part, int(torch.tensor_split(torch.empty(n, 0), world_size)[rank].shape[0])


class _SumOverRanks(torch.autograd.Function):
    """Forward: all-reduce (sum) a scalar, with a flag per rank that failed to compute its
    term; backward: identity (each rank owns its term)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, rank: int, world: int, failed: bool):
        y = torch.zeros(1 + world, dtype=x.dtype, device=x.device)
        y[0] = x.detach().reshape(())
        y[1 + rank] = float(failed)
        _dist().all_reduce(y, group=group)
        flags = y[1:].detach().clone()
        ctx.mark_non_differentiable(flags)
        return y[0].clone(), flags

    @staticmethod
    def backward(ctx, g: torch.Tensor, _flags: torch.Tensor):
        return g, None, None, None, None


class _GradSumOverRanks(torch.autograd.Function):
    """Forward: identity on shared tensors; backward: one all-reduce (sum) of all their grads."""

    @staticmethod
    def forward(ctx, group, *xs: torch.Tensor):
        ctx.group = group
        ctx.meta = [(x.shape, x.dtype, x.device) for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        gs = [torch.zeros(s, dtype=d, device=dev) if g is None else g
              for g, (s, d, dev) in zip(grads, ctx.meta, strict=True)]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(gs):
            by_dtype.setdefault(g.dtype, []).append(i)
        out = list(gs)
        for dt in sorted(by_dtype, key=str):  # same order on every rank
            idx = by_dtype[dt]
            flat = torch.cat([gs[i].reshape(-1) for i in idx])
            _dist().all_reduce(flat, group=ctx.group)
            for i, piece in zip(idx, torch.split(flat, [gs[i].numel() for i in idx]),
                                strict=True):
                out[i] = piece.view_as(gs[i])
        return (None, *out)


class _WithinBatchEvaluator:
    """``L = Σ_r (n_r/N) L_r`` on every rank, with gradients summed over ranks."""

    def __init__(self, ev, ctx: ShardContext) -> None:
        self.ev, self.ctx = ev, ctx

    def __call__(self, params: dict[str, torch.Tensor], batch) -> torch.Tensor:
        ctx = self.ctx
        part, n_local = ctx.split(batch, ctx.rank, ctx.world_size)
        device = next(iter(params.values())).device  # nccl reduces device tensors only
        sizes = torch.tensor([float(n_local)], dtype=torch.float64, device=device)
        _dist().all_reduce(sizes, group=ctx.group)
        n_total = float(sizes)
        if n_total <= 0:
            raise DistributedError("shard='within_batch': the batch has no examples on any rank")
        names = [k for k, t in params.items() if t.requires_grad]
        if names:
            shared = _GradSumOverRanks.apply(ctx.group, *(params[k] for k in names))
            params = {**params, **dict(zip(names, shared, strict=True))}
        error: Exception | None = None
        zero = torch.zeros((), dtype=torch.float64, device=device)
        try:
            if n_local > 0:
                loss = self.ev(params, part).double() * (n_local / n_total)
            else:  # keep the graph connected, so this rank joins the gradient all-reduce
                loss = sum((params[k].sum().double() * 0.0 for k in names), zero)
        except Exception as e:  # noqa: BLE001 - joins the all-reduce, then raised below
            error, loss = e, zero
        total, flags = _SumOverRanks.apply(loss, ctx.group, ctx.rank, ctx.world_size,
                                           error is not None)
        if error is not None:
            raise error
        failed = [r for r, f in enumerate(flags.tolist()) if f]
        if failed:
            raise DistributedError(
                f"shard='within_batch': the loss failed on rank(s) {failed} (the error is "
                "raised there in full); this rank stopped with it")
        return total


@dataclass
class ShardContext:
    """How this process shares the work (see the module docstring)."""

    mode: str = "none"
    rank: int = 0
    world_size: int = 1
    group: object = None
    split: SplitFn = default_split

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def main(self) -> bool:
        """Whether this is the rank that prints progress."""
        return self.rank == 0

    def owns(self, b: int) -> bool:
        """Whether this rank solves batch ``b``."""
        return self.mode != "batches" or b % self.world_size == self.rank

    def evaluator(self, ev: Evaluator) -> Evaluator:
        """The loss evaluator to use (wrapped for ``within_batch``)."""
        return _WithinBatchEvaluator(ev, self) if self.mode == "within_batch" else ev

    def common_seed(self, seed: int | None) -> int:
        """``seed``, or a fresh random seed drawn on rank 0 and shared with every rank."""
        if seed is not None:
            return int(seed)
        s = int(torch.Generator().seed() % (2**63))  # a fresh seed; global RNG untouched
        if self.active:
            box = [s]
            _dist().broadcast_object_list(box, src=self._global(0), group=self.group)
            s = int(box[0])
        return s

    def _global(self, rank: int) -> int:
        if self.group is None:
            return rank
        return _dist().get_global_rank(self.group, rank)

    def _exchange(self, mine: object, error: BaseException | None) -> list:
        """Every rank's `mine`, after every rank has told whether it failed: a failure on this
        rank is raised here (after the exchange, so the others do not wait), and one on
        another rank becomes a
        [`DistributedError`][quotient_manifolds.errors.DistributedError] naming it."""
        out: list = [None] * self.world_size
        note = None if error is None else f"{type(error).__name__}: {error}"
        _dist().all_gather_object(out, (mine, note), group=self.group)
        if error is not None:
            raise error
        failed = [(r, o[1]) for r, o in enumerate(out) if o[1] is not None]
        if failed:
            r, msg = failed[0]
            raise DistributedError(
                f"rank {r} failed ({msg})" + (f", and ranks {[f for f, _ in failed[1:]]}"
                                              if len(failed) > 1 else "")
                + "; this rank stopped with it. Fix the failing rank's input (its error is "
                "raised there in full)")
        return [o[0] for o in out]

    def check_same(self, tensors: list[torch.Tensor] | None,
                   error: BaseException | None = None) -> None:
        """Raise [`DistributedError`][quotient_manifolds.errors.DistributedError] unless every rank
        has the same base point.

        Compares shapes and the float64 sums of ``t`` and ``t²`` of every tensor (relative
        tolerance 1e-9, so that summation order on different machines does not matter). A
        rank that failed before it has a base point passes its `error` (and `tensors=None`):
        it is raised there, and the others raise a `DistributedError` naming that rank.
        """
        if not self.active:
            if error is not None:
                raise error
            return
        mine = None if tensors is None else [(tuple(t.shape), *fingerprint(t)) for t in tensors]
        out = self._exchange(mine, error)
        bad = [r for r, o in enumerate(out) if not _same_sums(o, out[0])]
        if bad:
            raise DistributedError(
                f"rank(s) {bad} hold a different model than rank 0 (weights or GL blocks "
                "differ); load the same checkpoint on every rank before computing sharpness"
            )

    def gather(self, records: list[tuple], n_evals: int, elapsed: float, *,
               fingerprints: list[tuple] | None = None, error: BaseException | None = None
               ) -> tuple[list[tuple], int, float]:
        """All ranks' per-batch records in batch order, total evaluations, max wall time.

        ``within_batch``: every rank already holds every record; only the wall time
        (the maximum over ranks) is shared. `fingerprints` (one
        [`batch_fingerprint`][quotient_manifolds.sharpness.guards.batch_fingerprint] per batch
        iterated) must agree on every rank: ranks that iterate different data raise a
        [`DistributedError`][quotient_manifolds.errors.DistributedError]. A rank's `error` is
        raised there after the exchange, and named on the others.
        """
        if not self.active:
            if error is not None:
                raise error
            return records, n_evals, elapsed
        mine = (records if self.mode == "batches" else [], n_evals, elapsed, fingerprints)
        out = self._exchange(mine, error)
        ref = out[0][3]
        if ref is not None:
            for r, o in enumerate(out[1:], start=1):
                if o[3] is not None and not _same_batches(o[3], ref):
                    raise DistributedError(
                        f"rank {r} iterates different data than rank 0 "
                        f"({_first_difference(o[3], ref)}); with shard={self.mode!r} every rank "
                        "must iterate the same batches in the same order (the ranks split the "
                        "work themselves): pass the same data, not a rank's own shard of it")
        wall = max(o[2] for o in out)
        if self.mode != "batches":
            return records, n_evals, wall
        merged = sorted((r for recs, _, _, _ in out for r in recs), key=lambda r: r[0])
        return merged, sum(o[1] for o in out), wall


def _close(a: float, b: float) -> bool:
    return (a != a and b != b) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-30)  # NaN == NaN


def _same_sums(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(
        sa == sb and _close(xa, xb) and _close(ya, yb)
        for (sa, xa, ya), (sb, xb, yb) in zip(a, b, strict=True))


def _same_batches(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(_same_sums(x, y) for x, y in zip(a, b, strict=True))


def _first_difference(a: list[tuple], b: list[tuple]) -> str:
    if len(a) != len(b):
        return f"{len(a)} batches against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if not _same_sums(x, y):
            return f"batch {i} differs"
    return "the batches differ"


@dataclass(frozen=True)
class Shard:
    """Data parallelism of a sharpness call (see the module docstring).

    Attributes
    ----------
    mode : {"batches", "within_batch", "none"}
        How the ranks share the work.
    split_batch : callable, optional
        ``split_batch(batch, rank, world_size) -> (slice, n_examples)`` for
        ``"within_batch"``; default
        [`default_split`][quotient_manifolds.sharpness.distributed.default_split].
    group : ProcessGroup, optional
        The process group (default: the world).
    """

    mode: str = "batches"
    split_batch: SplitFn | None = None
    group: object = None

    def __post_init__(self) -> None:
        if self.mode not in SHARD_MODES:
            raise InvalidArgumentError(
                f"shard must be one of {SHARD_MODES} or None, got {self.mode!r}")
        if self.split_batch is not None and self.mode != "within_batch":
            raise InvalidArgumentError("split_batch is only used with shard='within_batch'")


def resolve_shard(shard: str | Shard | None, split_batch: SplitFn | None = None,
                  group: object = None) -> ShardContext:
    """The [`ShardContext`][quotient_manifolds.sharpness.distributed.ShardContext] of a sharpness
    call.

    ``shard=None`` or ``"none"`` runs on this process alone, whether or not a process group
    exists. A mode (or a [`Shard`][quotient_manifolds.sharpness.distributed.Shard]) shares the work
    among the ranks of an initialised group; without one (or with a single rank) it also runs on
    this process alone.
    """
    if shard is None:
        shard = "none"
    if isinstance(shard, str):
        shard = Shard(shard, split_batch, group)
    elif split_batch is not None or group is not None:
        raise InvalidArgumentError("pass split_batch and group inside the Shard object")
    if shard.mode == "none":
        return ShardContext()
    dist = _dist()
    up = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(shard.group) if up else 1
    if world == 1:  # nothing to share: this process does everything
        return ShardContext()
    return ShardContext(shard.mode, dist.get_rank(shard.group), world, shard.group,
                        shard.split_batch or default_split)
