r"""Geodesic sharpness on an accelerator: BERT-base, and a SmolLM2-shaped Llama sharded by FSDP2.

One command measures, on the first visible CUDA device (the CPU without one):

* **BERT-base** (`transformers.BertConfig()` defaults, random weights, nothing downloaded) as a
  sequence classifier on 1024 random samples (batch 128, sequence 128), 20 APGD iterations:
  the time of a default `qm.geodesic_sharpness` call, against the floor (21 plain forward +
  backward passes over the same batches, the least 20 ascent iterations can cost), and the
  peak memory of the call against one forward + backward (`torch.cuda.max_memory_allocated`
  on CUDA; the peak resident set, `VmHWM`, on the CPU). A warm-up call on the first batch
  discovers the symmetries; the timed call finds them in the discovery cache (the discovery's
  own time is reported apart).
* **a sharded Llama** with the shape of SmolLM2-135M (`LlamaConfig` only: 30 layers, width 576,
  9 heads, 3 key/value heads, tied embeddings; random weights), every decoder layer and the
  root wrapped by FSDP2 `fully_shard` on every visible device (two CPU ranks over gloo without
  CUDA), ranks spawned by `torch.multiprocessing`. Every rank makes the same call as on an
  unsharded model; its value is compared with the unsharded call of rank 0, and its time and
  peak memory per rank reported. If the sharded call raises, the part reports "not available:
  <error>" instead of failing (and a part that hangs is stopped after `--timeout` s).

`--quick` uses tiny configurations of both (a few seconds on the CPU; the `bench-smoke` target).

    .venv/bin/python benchmarks/gpu.py [--quick] [--device cuda] [--json runs/gpu.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import environment, fmt, print_table, sync, write_json  # noqa: E402

import quotient_manifolds as qm  # noqa: E402

RHO = 0.05


# -- memory -------------------------------------------------------------------------------------
def _vm(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_start(device: torch.device) -> int:
    """Reset the peak counter; the memory in use now (bytes)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass
    return _vm("VmRSS")


def peak_since(device: torch.device, start: int) -> int:
    """The peak memory above `start` since `peak_start` (bytes)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    return _vm("VmHWM") - start


# -- the parts ----------------------------------------------------------------------------------
def hf_loss(model, batch):
    return model(**batch).loss


def _floor_pass(model, data) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    for b in data:
        torch.autograd.grad(hf_loss(model, b), params)


def _timed(fn, device: torch.device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


class _Discovery(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: list[tuple[bool, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seconds.append((record.getMessage().startswith("cache hit"),
                             float(getattr(record, "seconds", "nan"))))


def bert_part(device: torch.device, quick: bool, samples: int, batch: int, seq: int,
              n_iter: int) -> dict:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig() if not quick else BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, max_position_embeddings=64)
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg).to(device).eval()
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device),
             "attention_mask": torch.ones(batch, seq, dtype=torch.long, device=device),
             "labels": torch.randint(0, cfg.num_labels, (batch,), generator=g).to(device)}
            for _ in range(samples // batch)]
    handler = _Discovery()
    log = logging.getLogger("quotient_manifolds.discovery")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _floor_pass(model, data[:1])  # warm-up
            _, floor = _timed(lambda: _floor_pass(model, data), device)
            base = peak_start(device)
            _floor_pass(model, data[:1])
            floor_peak = peak_since(device, base)
            # warm-up and discovery on the first batch; the timed call hits the cache
            qm.geodesic_sharpness(model, hf_loss, data[:1], rho=RHO, n_iter=1)
            base = peak_start(device)
            r, t = _timed(lambda: qm.geodesic_sharpness(model, hf_loss, data, rho=RHO,
                                                         n_iter=n_iter), device)
            peak = peak_since(device, base)
    finally:
        log.removeHandler(handler)
    discovered = [s for hit, s in handler.seconds if not hit]
    return {
        "model": "BERT-base" if not quick else "BERT (tiny)",
        "parameters": sum(p.numel() for p in model.parameters()),
        "samples": len(data) * batch, "batch": batch, "seq": seq, "n_iter": n_iter,
        "time_s": t, "floor_pass_s": floor, "floor_ratio": t / ((n_iter + 1) * floor),
        "peak_mb": peak / 2**20, "floor_peak_mb": floor_peak / 2**20,
        "peak_over_floor": peak / max(floor_peak, 1),
        "discovery_s": discovered[0] if discovered else float("nan"),
        "cache_hit": bool(handler.seconds and handler.seconds[-1][0]),
        "sharpness": r.value,
    }


def llama_config(quick: bool):
    from transformers import LlamaConfig

    if quick:
        return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64, tie_word_embeddings=True)
    # the shape of SmolLM2-135M (its config.json), weights random
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                       max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=True)


def _llama_setup(quick: bool, device: torch.device, batches: int, batch: int, seq: int):
    from transformers import LlamaForCausalLM

    cfg = llama_config(quick)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device).eval()
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(batches):
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
        data.append({"input_ids": ids, "labels": ids})
    return model, data


def _rank(rank: int, world: int, port: int, opts: dict, out: str) -> None:
    """One rank: the unsharded reference (rank 0), then the same call on the sharded model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    cuda = opts["cuda"]
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    rec: dict = {"rank": rank}
    try:
        warnings.simplefilter("ignore")
        model, data = _llama_setup(opts["quick"], device, opts["batches"], opts["batch"],
                                   opts["seq"])
        rec["parameters"] = sum(p.numel() for p in model.parameters())
        if rank == 0:
            base = peak_start(device)
            r, t = _timed(lambda: qm.geodesic_sharpness(model, hf_loss, data, rho=RHO,
                                                         n_iter=opts["n_iter"]), device)
            rec.update(unsharded_s=t, unsharded_peak_mb=peak_since(device, base) / 2**20,
                       unsharded=r.value)
        dist.barrier()
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        base = peak_start(device)
        try:
            r, t = _timed(lambda: qm.geodesic_sharpness(model, hf_loss, data, rho=RHO,
                                                         n_iter=opts["n_iter"]), device)
            rec.update(status="ok", sharded_s=t, sharded=r.value,
                       sharded_peak_mb=peak_since(device, base) / 2**20)
        except Exception as e:  # noqa: BLE001 -- reported, not raised: before sharded support
            rec["status"] = f"not available: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    except Exception as e:  # noqa: BLE001
        rec["status"] = f"not available: {type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(rec))
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sharded_part(quick: bool, cuda: bool, n_iter: int, batches: int, batch: int, seq: int,
                 timeout: float) -> dict:
    import torch.multiprocessing as mp

    world = torch.cuda.device_count() if cuda else 2
    opts = {"quick": quick, "cuda": cuda, "n_iter": n_iter, "batches": batches,
            "batch": batch, "seq": seq}
    summary: dict = {"model": "Llama, SmolLM2-135M shape" if not quick else "Llama (tiny)",
                     "world_size": world, "backend": "nccl" if cuda else "gloo",
                     "n_iter": n_iter, "batches": batches, "batch": batch, "seq": seq}
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_rank, args=(world, _free_port(), opts, out), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.terminate()
                    summary["status"] = f"not available: timed out after {timeout:g} s"
                    break
        except Exception as e:  # noqa: BLE001 -- a rank died
            summary["status"] = f"not available: {type(e).__name__}: {str(e)[:300]}"
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    summary["ranks"] = ranks
    statuses = {r.get("status", "missing") for r in ranks}
    if "status" not in summary:
        summary["status"] = "ok" if statuses == {"ok"} and len(ranks) == world else next(
            (s for s in sorted(statuses) if s != "ok"), "not available: a rank reported nothing")
    r0 = next((r for r in ranks if r["rank"] == 0), {})
    if summary["status"] == "ok" and "unsharded" in r0:
        summary.update(
            unsharded_s=r0["unsharded_s"], sharded_s=max(r["sharded_s"] for r in ranks),
            unsharded_peak_mb=r0["unsharded_peak_mb"],
            sharded_peak_mb=max(r["sharded_peak_mb"] for r in ranks),
            sharded=r0["sharded"], unsharded=r0["unsharded"],
            rel_diff=abs(r0["sharded"] - r0["unsharded"]) / max(abs(r0["unsharded"]), 1e-300),
            ranks_agree=len({r["sharded"] for r in ranks}) == 1)
        summary["time_ratio"] = summary["sharded_s"] / summary["unsharded_s"]
        summary["memory_ratio"] = summary["sharded_peak_mb"] / max(
            summary["unsharded_peak_mb"], 1e-9)
    elif "unsharded" in r0:
        summary.update(unsharded_s=r0["unsharded_s"], unsharded=r0["unsharded"],
                       unsharded_peak_mb=r0["unsharded_peak_mb"])
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny configurations (CPU, seconds)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--n-iter", type=int, default=None, help="default 20 (--quick: 2)")
    ap.add_argument("--samples", type=int, default=None, help="BERT samples (default 1024)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds the sharded part may take (default 300; --quick 120)")
    ap.add_argument("--skip-bert", action="store_true")
    ap.add_argument("--skip-sharded", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1 if a.quick else max(torch.get_num_threads(), 1))
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    n_iter = a.n_iter if a.n_iter is not None else (2 if a.quick else 20)
    figures: dict = {"device": str(device) if device.type == "cpu" else
                     torch.cuda.get_device_name(device), "quick": a.quick}
    if not a.skip_bert:
        samples = a.samples or (8 if a.quick else 1024)
        batch, seq = (4, 8) if a.quick else (128, 128)
        b = bert_part(device, a.quick, samples, min(batch, samples), seq, n_iter)
        figures.update({f"bert_{k}": v for k, v in b.items()})
        print_table(["model", "samples", "iters", "time s", "floor ratio", "peak MB",
                     "peak / floor", "discovery s"],
                    [[b["model"], str(b["samples"]), str(n_iter), fmt(b["time_s"]),
                      fmt(b["floor_ratio"]), fmt(b["peak_mb"]), fmt(b["peak_over_floor"]),
                      fmt(b["discovery_s"])]],
                    title=f"geodesic sharpness on {figures['device']}: time vs {n_iter + 1} "
                          "forward+backward passes, peak memory vs one")
    if not a.skip_sharded:
        quick_shape = (1, 2, 8) if a.quick else (2, 8, 256)
        s = sharded_part(a.quick, device.type == "cuda", n_iter, *quick_shape,
                         timeout=a.timeout or (120.0 if a.quick else 300.0))
        figures.update({f"sharded_{k}": v for k, v in s.items() if k != "ranks"})
        figures["sharded_ranks"] = s["ranks"]
        print(f"\nFSDP2 fully_shard, {s['model']}, {s['world_size']} ranks ({s['backend']}): "
              f"{s['status']}")
        if s["status"] == "ok":
            print(f"  sharded {fmt(s['sharded_s'])} s vs unsharded {fmt(s['unsharded_s'])} s "
                  f"(x{fmt(s['time_ratio'])}); peak per rank {fmt(s['sharded_peak_mb'])} MB vs "
                  f"{fmt(s['unsharded_peak_mb'])} MB (x{fmt(s['memory_ratio'])}); value "
                  f"{s['sharded']:.6g} vs {s['unsharded']:.6g} (rel. diff "
                  f"{s['rel_diff']:.1e}; ranks agree: {s['ranks_agree']})")
    write_json(a.json, {**figures, **{f"env_{k}": v for k, v in environment().items()}})


if __name__ == "__main__":
    main()
