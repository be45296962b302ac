"""Where the translation projection's memory goes: the peak-RSS increase of one sharpness call
and of each call of the constrained adaptive space inside it (`proju`, `proju_weighted`,
`egrad2rgrad`, `egrad2rgrad_and_norm2`), with what each call leaves allocated.

Each outermost call of those methods returns the allocator's free memory to the system
(`malloc_trim`), resets the peak-RSS counter (`/proc/self/clear_refs`) and reports the increase
of the peak RSS (`VmHWM`) and of the RSS (`VmRSS`) over the RSS at its start: the peak the call
adds and what it keeps (its result, caches). A call that keeps memory for the rest of the sharpness
call is what raises the peak of the later backward passes. Linux only; MiniLM (batch 32 × 32,
float32), symmetries discovered before, 2 APGD iterations, one thread.

    .venv/bin/python benchmarks/constraint_memory.py [--config geodesic_inv_complete] [--quick]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sharpness_cost as cost  # noqa: E402
import torch  # noqa: E402

METHODS = ("proju", "proju_weighted", "egrad2rgrad", "egrad2rgrad_and_norm2")


def _reset_peak() -> int:
    cost._trim()
    rss = cost._status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss


def _instrument(stats: dict) -> None:
    from quotient_manifolds.manifolds.constrained import ConstrainedAdaptiveTangentSpace as C

    depth = [0]
    for name in METHODS:
        f = getattr(C, name)

        @functools.wraps(f)
        def g(*args, _f=f, _name=name, **kwargs):
            if depth[0]:  # nested: counted in the outer call
                return _f(*args, **kwargs)
            depth[0] += 1
            before = _reset_peak()
            try:
                return _f(*args, **kwargs)
            finally:
                stats[_name].append(((cost._status("VmHWM") - before) / 2**20,
                                     (cost._status("VmRSS") - before) / 2**20))
                depth[0] -= 1

        setattr(C, name, g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="geodesic_inv_complete", choices=sorted(cost.CONFIGS))
    ap.add_argument("--quick", action="store_true", help="MiniLM at batch 8 x 16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import quotient_manifolds as qm

    model, loss, data, what = cost.minilm_setup(args.quick)
    geometry = cost.geometry_of(args.config, model, loss, data)
    stats: dict = collections.defaultdict(list)
    _instrument(stats)
    before = _reset_peak()
    qm.geodesic_sharpness(model, loss, data, rho=cost.RHO, n_iter=2, geometry=geometry)
    print(f"{what}, {args.config}: peak RSS increase of the call "
          f"{(cost._status('VmHWM') - before) / 2**20:.0f} MB")
    for name in METHODS:
        calls = stats.get(name, [])
        if calls:
            shown = ", ".join(f"+{p:.0f}/{r:.0f}" for p, r in calls[:6])
            print(f"  {name:24s} {len(calls):3d} calls, peak/kept MB: {shown}")


if __name__ == "__main__":
    main()
