r"""Model-parallel sharpness of a model sharded by FSDP2 (`fully_shard`) or laid out as DTensors.

The call is the unsharded one, made on every rank;
[`model_parallel`][quotient_manifolds.sharpness.sharded.model_parallel] is the seam of the
engine (see the "Model-parallel (FSDP2)" section of ``docs/distributed.md``):

1. **Layout.** The DTensor parameters must live on one device mesh of one dimension (the
   model-parallel group: every rank of the mesh) or two, `(data, model)` with every parameter
   replicated along the first (HSDP: `fully_shard(model, mesh=mesh_2d)`). Any placement along
   the model dimension is accepted (FSDP's `Shard(0)`, tensor parallel `Shard(1)`): the
   perturbation is not laid out like the weights but partitioned by heads and entries (below).
2. **Base point.** Each parameter is all-gathered once (`DTensor.full_tensor`, in
   `named_parameters` order on every rank) into a copy of the module tree that holds the
   whole weights (same classes, buffers and attributes; FSDP's hooks dropped). Discovery's
   probes and the loss run on that copy, so the symmetries are those of the unsharded model.
3. **Perturbation and ascent state.** Only this rank's share of every packed factor is built
   ([`ShardedGeometry`][quotient_manifolds.sharpness.sharded_space.ShardedGeometry]): whole
   heads of every GL block group (so a head's $h\times h$ Gram never crosses ranks, whichever
   rows of $W_Q$ or $W_O$ FSDP put where) and a contiguous range of the adaptive entries. The
   solver's buffers are vectors of that share. Norms and inner products are all-reduced; the
   loss sees the whole perturbed weights (one all-gather per evaluation).

Data parallelism (`shard="batches"` / `"within_batch"`) runs over the mesh's first (data)
dimension; it needs a 2-D mesh.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ShardedModelError
from ..models.config import QuotientConfig
from .distributed import Shard, ShardContext, resolve_shard
from .sharded_space import ShardedGeometry

__all__ = ["ModelParallel", "model_parallel", "sharded_parameters"]


def _dtensor_cls():
    mod = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before its import
    return None if mod is None else mod.DTensor


def sharded_parameters(model: nn.Module) -> list[str]:
    """The names of `model`'s DTensor parameters (empty for an unsharded model); raises
    [`ShardedModelError`][quotient_manifolds.errors.ShardedModelError] for the old
    `FullyShardedDataParallel` wrapper, whose flat parameters have no per-weight layout."""
    fsdp1 = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    if fsdp1 is not None and any(isinstance(m, fsdp1.FullyShardedDataParallel)
                                 for m in model.modules()):
        raise ShardedModelError(
            "the model is wrapped in FullyShardedDataParallel (FSDP1), whose flattened "
            "parameters do not keep each weight's shape; shard it with "
            "torch.distributed.fsdp.fully_shard (FSDP2) instead, or measure it unwrapped")
    cls = _dtensor_cls()
    if cls is None:
        return []
    return [n for n, p in model.named_parameters() if isinstance(p, cls)]


@dataclass
class ModelParallel:
    """A sharded model's groups and `module`, its unsharded copy holding the whole weights."""

    module: nn.Module
    group: object
    rank: int
    size: int
    data_group: object
    data_size: int

    def geometry(self, model: nn.Module, geometry: QuotientConfig, **kw: Any
                 ) -> ShardedGeometry:
        """This rank's share of `ModelGeometry(model, geometry, **kw)` (`model`: `module`)."""
        return ShardedGeometry(model, geometry, group=self.group, rank=self.rank,
                               size=self.size, **kw)

    def context(self, shard: str | Shard | None) -> ShardContext:
        """The data-parallel context of the call: over the mesh's data dimension."""
        if shard is None or shard == "none" or (isinstance(shard, Shard)
                                                and shard.mode == "none"):
            return ShardContext()
        mode = shard if isinstance(shard, str) else shard.mode
        if self.data_group is None:
            raise ShardedModelError(
                f"shard={mode!r} with a model sharded over a 1-D mesh: every rank of the mesh "
                "holds a share of one model, so no rank is left to take other data. Shard "
                "the model over a 2-D mesh (data, model), e.g. fully_shard(model, "
                "mesh=init_device_mesh(device, (dp, mp))), and pass shard= again: the data "
                "dimension shares the batches")
        given = shard if isinstance(shard, Shard) else Shard(mode)
        if given.group is not None and _ranks(given.group) != _ranks(self.data_group):
            raise ShardedModelError(
                "shard=Shard(group=...) must be the data dimension of the model's mesh "
                f"(ranks {_ranks(self.data_group)}), got ranks {_ranks(given.group)}; "
                "leave group=None to use it")
        return resolve_shard(Shard(given.mode, given.split_batch, self.data_group))

    def settings(self) -> dict:
        return {"model_parallel": self.size}


def _ranks(group) -> list[int]:
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group))


def _layout(model: nn.Module, names: list[str]) -> tuple[Any, Any]:
    """The model-parallel group and the data group (None on a 1-D mesh) of the DTensors."""
    from torch.distributed.tensor import Replicate

    named: dict[str, Any] = dict(model.named_parameters())  # DTensors
    meshes = {id(named[n].device_mesh): named[n].device_mesh for n in names}
    if len(meshes) != 1:
        raise ShardedModelError(
            f"the model's DTensor parameters live on {len(meshes)} different device meshes; "
            "shard every parameter over one mesh (one fully_shard mesh for all the modules)")
    mesh = next(iter(meshes.values()))
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    if mesh.ndim == 2:
        bad = [n for n in names if not isinstance(named[n].placements[0], Replicate)]
        if bad:
            raise ShardedModelError(
                f"parameter {bad[0]!r} is sharded along the first dimension of the 2-D mesh "
                f"({named[bad[0]].placements}); the first dimension is the data dimension: "
                "replicate every parameter along it and shard along the second (HSDP, "
                "fully_shard(model, mesh=mesh_2d))")
        return mesh.get_group(1), mesh.get_group(0)
    raise ShardedModelError(
        f"the model is sharded over a {mesh.ndim}-D device mesh; sharpness supports a 1-D "
        "mesh (model) or a 2-D mesh (data, model): reshard it, or gather it onto fewer "
        "dimensions")


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_FSDP_ATTRS = ("__composable_api", "_fsdp", "_is_fsdp")
_HOOK_FLAGS = {"_forward_pre_hooks_with_kwargs": "_forward_pre_hooks",
               "_forward_hooks_with_kwargs": "_forward_hooks",
               "_forward_hooks_always_called": "_forward_hooks"}


def _fsdp_hook(h) -> bool:
    owner = getattr(h, "__self__", None)
    mod = type(owner).__module__ if owner is not None else getattr(h, "__module__", "")
    return str(mod).startswith("torch.distributed")


def _plain_class(m: nn.Module) -> type:
    """The class `fully_shard` replaced (it swaps in a subclass `FSDP<Class>`)."""
    cls = type(m)
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not isinstance(m, fsdp.FSDPModule):
        return cls
    bases = [b for b in cls.__bases__ if not issubclass(b, fsdp.FSDPModule)]
    return bases[0] if len(bases) == 1 else cls


def _unsharded(model: nn.Module) -> nn.Module:
    """A copy of the module tree with every parameter whole (DTensors all-gathered); buffers
    and every other attribute shared with `model`, FSDP's hooks dropped."""
    cls = _dtensor_cls()
    whole: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for _, p in model.named_parameters():  # the same order on every rank
            if cls is not None and isinstance(p, cls):
                whole[id(p)] = nn.Parameter(p.full_tensor().detach(),
                                            requires_grad=p.requires_grad)
    memo: dict[int, nn.Module] = {}

    def copy(m: nn.Module) -> nn.Module:
        if id(m) in memo:
            return memo[id(m)]
        new: nn.Module = object.__new__(_plain_class(m))
        new.__dict__.update((k, v) for k, v in m.__dict__.items()
                            if not k.startswith(_FSDP_ATTRS))  # FSDP's state and flags
        memo[id(m)] = new
        new._parameters = {k: (None if p is None else whole.get(id(p), p))
                           for k, p in m._parameters.items()}
        new._buffers = dict(m._buffers)
        for attr in _HOOKS:
            hooks = getattr(m, attr, None)
            if isinstance(hooks, dict):
                setattr(new, attr, collections.OrderedDict(
                    (k, h) for k, h in hooks.items() if not _fsdp_hook(h)))
        for attr, main in _HOOK_FLAGS.items():  # flags keyed by the ids of kept hooks
            flags = getattr(m, attr, None)
            if isinstance(flags, dict):
                keep = getattr(new, main)
                setattr(new, attr, collections.OrderedDict(
                    (k, v) for k, v in flags.items() if k in keep))
        new._modules = {k: (None if c is None else copy(c)) for k, c in m._modules.items()}
        return new

    return copy(model)


@contextmanager
def model_parallel(model: nn.Module, geometry: QuotientConfig | None = None,
                   solver: object = None) -> Iterator[ModelParallel | None]:
    """`None` for an unsharded model; for a sharded one (see the module docstring), its
    [`ModelParallel`][quotient_manifolds.sharpness.sharded.ModelParallel] (the whole weights
    held for the duration of the block). Refuses what is not sharded: balls other than the
    metric ball, solvers other than APGD and Average."""
    names = sharded_parameters(model)
    if not names:
        yield None
        return
    import torch.distributed as dist

    from .solvers import APGD, Average

    ball = getattr(geometry, "ball", "metric")  # a sharpness Geometry has one
    if ball != "metric":
        raise ShardedModelError(
            f"a model-parallel call measures in the metric ball; ball={ball!r} (and "
            "adaptive_sharpness) is not sharded: use geodesic_sharpness with "
            "Geometry(ball='metric'), or gather the model onto one process")
    if solver is not None and not isinstance(solver, (APGD, Average)):
        raise ShardedModelError(
            f"a model-parallel call runs APGD or Average, got {type(solver).__name__}; the "
            "other solvers keep whole perturbations")
    group, data_group = _layout(model, names)
    module = _unsharded(model)
    try:
        yield ModelParallel(module, group, dist.get_rank(group), dist.get_world_size(group),
                            data_group, 1 if data_group is None else
                            dist.get_world_size(data_group))
    finally:
        del module
