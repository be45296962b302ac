r"""Which rank of a `torchrun` job measures which (checkpoint, measure) pair.

The launcher is read only through the environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`); no
process group is created, and the ranks share nothing but the results file.
"""

from __future__ import annotations

import os

from ...errors import PopulationInputError

__all__ = ["assigned_pairs", "distributed_rank", "rank_device"]


def distributed_rank() -> tuple[int, int]:
    """`(rank, world_size)` from the environment `torchrun` sets (`RANK`, `WORLD_SIZE`);
    `(0, 1)` outside `torchrun`."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        raise PopulationInputError(
            f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
            "are not integers; launch with torchrun, or unset them"
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise PopulationInputError(
            f"RANK={rank} is not in range(WORLD_SIZE={world}); launch with torchrun, or unset "
            "them"
        )
    return rank, world


def assigned_pairs(n_checkpoints: int, n_measures: int, rank: int,
                   world_size: int) -> list[tuple[int, int]]:
    """The (checkpoint index, measure index) pairs that `rank` of `world_size` computes.

    With at least as many checkpoints as ranks, checkpoint `i` goes, with all its measures, to
    rank `i mod W` (each checkpoint is read, hashed and loaded by one rank only). With fewer
    checkpoints than ranks, pair `k = i·M + j` (checkpoint-major) goes to rank `k mod W`. The
    assignment depends only on the arguments (the order of the checkpoints and measures),
    never on what is already in the results file, so the ranks need no communication;
    together they cover every pair exactly once.
    """
    if n_checkpoints >= world_size:
        return [(i, j) for i in range(rank, n_checkpoints, world_size)
                for j in range(n_measures)]
    return [divmod(k, n_measures) for k in range(rank, n_checkpoints * n_measures, world_size)]


def rank_device(device: str | None, world_size: int) -> str | None:
    """The device of this rank: `"cuda"` under `torchrun` means this rank's GPU,
    `cuda:LOCAL_RANK`; any other device is returned as given."""
    if device == "cuda" and world_size > 1 and "LOCAL_RANK" in os.environ:
        return f"cuda:{int(os.environ['LOCAL_RANK'])}"
    return device
