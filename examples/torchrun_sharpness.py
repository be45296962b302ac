"""Data-parallel geodesic sharpness with torch.distributed (see docs/distributed.md).

Under torchrun every rank runs this script; sharpness calls shard the work by
themselves once a process group is initialised::

    torchrun --nproc_per_node=2 examples/torchrun_sharpness.py           # CPU: gloo
    torchrun --nproc_per_node=8 examples/torchrun_sharpness.py --cuda    # GPUs: nccl

``python examples/torchrun_sharpness.py --small`` (what ``make examples`` runs) starts
two local gloo ranks itself, with ``torch.multiprocessing``, and checks them against a
single-process run.  Without torchrun and without ``--small`` it runs single-process.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
from torch import nn

import quotient_manifolds as qm


class TinyTransformer(nn.Module):
    """Embedding → one self-attention layer → mean pool → linear classifier."""

    def __init__(self, d: int = 16, heads: int = 2, din: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Linear(din, d)
        self.att = nn.MultiheadAttention(d, heads, batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        a, _ = self.att(h, h, h)
        return self.head((h + a).mean(1))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)  # a mean over the batch


def make(device: torch.device, n_batches: int, bs: int):
    """The same model and data on every rank (same seed; in practice: same checkpoint)."""
    torch.manual_seed(0)
    model = TinyTransformer().to(device).eval()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(bs, 5, 6, generator=g).to(device),
             torch.randint(0, 3, (bs,), generator=g).to(device)) for _ in range(n_batches)]
    return model, data


def sharpness(device: torch.device, n_batches: int, bs: int, n_iter: int) -> dict:
    model, data = make(device, n_batches, bs)
    out = {}
    for shard in ("batches", "within_batch"):
        r = qm.geodesic_sharpness(model, loss_fn, data, rho=0.1, n_iter=n_iter, shard=shard)
        out[shard] = r
    return out


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """One rank of the ``--small`` demonstration (gloo on localhost)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        res = sharpness(torch.device("cpu"), args.batches, args.batch_size, args.iters)
        if rank == 0:
            model, data = make(torch.device("cpu"), args.batches, args.batch_size)
            single = qm.geodesic_sharpness(model, loss_fn, data, rho=0.1, n_iter=args.iters,
                                           shard="none")
            print(f"single process     : {single.value:.6f}  per batch {fmt(single)}")
            for shard, r in res.items():
                print(f"{world} ranks, {shard:12s}: {r.value:.6f}  per batch {fmt(r)}")
            diff = max(abs(a - b) for r in res.values()
                       for a, b in zip(r.per_batch, single.per_batch, strict=True))
            print(f"max |per-batch difference| to the single process: {diff:.2e}")
            if diff > 1e-5:
                raise SystemExit("data-parallel result differs from the single process")
    finally:
        dist.destroy_process_group()


def fmt(r: qm.SharpnessResult) -> str:
    return "[" + ", ".join(f"{v:.6f}" for v in r.per_batch) + "]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="spawn 2 local gloo ranks (CI)")
    p.add_argument("--cuda", action="store_true", help="one GPU per rank, nccl backend")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    if "LOCAL_RANK" in os.environ:  # launched by torchrun: env:// rendezvous
        import torch.distributed as dist

        local = int(os.environ["LOCAL_RANK"])
        if args.cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if args.cuda else "gloo")
        device = torch.device("cuda", local) if args.cuda else torch.device("cpu")
        try:
            res = sharpness(device, args.batches, args.batch_size, args.iters)
            if dist.get_rank() == 0:
                for shard, r in res.items():
                    print(f"{dist.get_world_size()} ranks, {shard:12s}: {r.value:.6f} "
                          f"per batch {fmt(r)}")
        finally:
            dist.destroy_process_group()
    elif args.small:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(rank_main, args=(2, port, args), nprocs=2, join=True,
                           start_method="spawn")
    else:
        device = torch.device("cuda" if args.cuda else "cpu")
        res = sharpness(device, args.batches, args.batch_size, args.iters)  # no group: 1 rank
        for shard, r in res.items():
            print(f"1 process, shard={shard!r} (no group: single process): {r.value:.6f}")


if __name__ == "__main__":
    main()
