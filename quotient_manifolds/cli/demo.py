"""The built-in default job: measure the geometry facts the library rests on.

``quotient-manifolds demo`` (or ``make demo``) prints, for both metrics of a
random GL(h) block: the invariance of the metric and of the second-order
perturbed product under a random group element, the orthogonality of the
horizontal projection, and the error orders of the three retractions against a
geodesic integrated independently by SciPy (§5.2; Eq. 5).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from ..manifolds import GLQuotient
from ..manifolds.checks import reference_geodesic

__all__ = ["geometry_facts", "format_facts"]


def _block(M: GLQuotient, h: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(M.n + M.m, h, generator=gen, dtype=torch.float64)


def geometry_facts(n: int = 4, m: int = 3, h: int = 2, seed: int = 0) -> list[dict]:
    """Measure invariance, horizontality and retraction orders for both metrics."""
    gen = torch.Generator().manual_seed(seed)
    steps = [0.4, 0.2, 0.1, 0.05]
    facts = []
    for metric in ("inv", "mix"):
        t0 = time.perf_counter()
        M = GLQuotient(n, m, metric=metric, retraction="second_order")
        x = _block(M, h, gen)
        u, v = (M.proju(x, _block(M, h, gen)) for _ in range(2))
        u = u / M.norm(x, u)
        A = torch.randn(h, h, generator=gen, dtype=torch.float64) * 10.0
        xa, ua, va = M.act(x, A), M.act(u, A), M.act(v, A)
        omega = torch.randn(h, h, generator=gen, dtype=torch.float64)
        w = M.vertical(x, omega)
        errs: dict[str, list[float]] = {"first_order": [], "second_order": [], "exact": []}
        for s in steps:
            ref = reference_geodesic(M, x, s * u)
            for kind in errs:
                R = GLQuotient(n, m, metric=metric, retraction=kind)
                errs[kind].append((R.retr(x, s * u) - ref).abs().max().item())
        slope = {k: float(np.polyfit(np.log(steps), np.log(e), 1)[0]) for k, e in errs.items()}
        facts.append(
            {
                "metric": metric,
                "sizes": f"n={n}, m={m}, h={h}",
                "metric_invariance": abs(M.inner(xa, ua, va) - M.inner(x, u, v)).item()
                / max(abs(M.inner(x, u, v).item()), 1e-300),
                "projection_orthogonality": abs(M.inner(x, M.proju(x, u), w).item())
                / (M.norm(x, u) * M.norm(x, w)).item(),
                "second_order_GHt_invariance": (
                    M.invariant(M.retr(xa, 0.3 * ua)) - M.invariant(M.retr(x, 0.3 * u))
                ).abs().max().item(),
                "first_order_slope": slope["first_order"],
                "second_order_slope": slope["second_order"],
                "exact_max_error": max(errs["exact"]),
                "seconds": time.perf_counter() - t0,
            }
        )
    return facts


def format_facts(facts: list[dict]) -> str:
    """A plain-text table of `geometry_facts`."""
    rows = [
        ("metric invariance ⟨u,v⟩ under (G A⁻¹, H Aᵀ), rel. error", "metric_invariance", "{:.1e}"),
        ("horizontal projection ⟂ vertical space, rel.", "projection_orthogonality", "{:.1e}"),
        ("G Hᵀ after second-order step, invariance error", "second_order_GHt_invariance", "{:.1e}"),
        ("first-order retraction error order (expect 2)", "first_order_slope", "{:.2f}"),
        ("second-order retraction error order (expect 3)", "second_order_slope", "{:.2f}"),
        ("exact retraction (RK4, 8 steps), max error", "exact_max_error", "{:.1e}"),
        ("seconds", "seconds", "{:.2f}"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"GL(h) quotient geometry, {facts[0]['sizes']}, float64, seed-fixed random block",
             f"{'':{width}}  " + "  ".join(f"{f['metric']:>9}" for f in facts)]
    for label, key, fmt in rows:
        vals = "  ".join(f"{fmt.format(f[key]):>9}" for f in facts)
        lines.append(f"{label:{width}}  {vals}")
    ok = all(
        f["metric_invariance"] < 1e-8
        and f["projection_orthogonality"] < 1e-10
        and f["second_order_GHt_invariance"] < 1e-8
        and math.isclose(round(f["first_order_slope"]), 2)
        and math.isclose(round(f["second_order_slope"]), 3)
        for f in facts
    )
    lines.append("all facts hold" if ok else "SOME FACTS FAILED")
    return "\n".join(lines)
