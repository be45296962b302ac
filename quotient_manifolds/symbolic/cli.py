r"""``python -m quotient_manifolds.symbolic``: run the symbolic verification suite.

Prints one table row per check (check, subject, sizes, symbolic or numeric,
result, seconds) as the checks finish, and exits non-zero if any fails.

Options
-------
``--quick``
    The fast subset (well under a minute on one core); the default test suite
    runs the same subset.
``-k PATTERN``
    Only rows whose ``check subject sizes`` text contains ``PATTERN``.
``--list``
    List the checks without running them.
``--markdown``
    Print the table as Markdown (for ``docs/derivations.md``).
``--latex``
    Print the derivations (SymPy-rendered LaTeX, Markdown) instead of checking.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TextIO

import sympy as sp

from .bridge import (
    christoffel_bridge,
    geodesic_bridge_adaptive,
    geodesic_bridge_diagonal,
    projection_bridge,
    retraction_bridge,
    transcription_bridge,
)
from .checks import (
    CheckResult,
    check_christoffel_adaptive,
    check_christoffel_diagonal,
    check_christoffel_gl,
    check_christoffel_gl_quadratic,
    check_christoffel_scalar_toy,
    check_geodesic_adaptive,
    check_geodesic_diagonal,
    check_geodesic_diagonal_general_inv,
    check_invariance_diagonal,
    check_invariance_gl,
    check_projection_diagonal,
    check_projection_gl,
    check_retraction_diagonal,
    check_rgrad_diagonal,
    check_rgrad_gl,
    check_vertical_diagonal,
    check_vertical_gl,
)
from .models import scalar_toy
from .subgroups import (
    check_projection_subgroup,
    check_rotary_commutant,
    check_vertical_subgroup,
    documented_x,
    subalgebra_label,
    subgroup_projection_bridge,
)

__all__ = ["Entry", "SUITE", "select", "run_suite", "format_table", "main"]

EPS = sp.Symbol("epsilon", positive=True)


@dataclass(frozen=True)
class Entry:
    """One registered check: a label for listing, a thunk, and the quick flag."""

    label: str
    run: Callable[[], CheckResult]
    quick: bool


def _suite() -> list[Entry]:
    E = Entry
    out: list[Entry] = [
        E("christoffel scalar toy inv GL(1)", check_christoffel_scalar_toy, True),
        E("christoffel adaptive ε d=1", check_christoffel_adaptive, True),
    ]
    for metric in ("inv", "mix"):
        out.append(
            E(
                f"christoffel diagonal {metric} d=2",
                partial(check_christoffel_diagonal, 2, metric),
                True,
            )
        )
    for (n, m, h), quick in (((2, 2, 1), True), ((3, 2, 2), True), ((4, 3, 2), False)):
        for metric in ("inv", "mix"):
            out.append(
                E(
                    f"christoffel GL {metric} n={n},m={m},h={h}",
                    partial(check_christoffel_gl, n, m, h, metric),
                    quick,
                )
            )
    for (n, m, h), quick in (((2, 2, 1), True), ((3, 2, 2), False)):
        for metric in ("inv", "mix"):
            out.append(
                E(
                    f"christoffel GL {metric} n={n},m={m},h={h},ε",
                    partial(check_christoffel_gl, n, m, h, metric, eps=EPS),
                    quick,
                )
            )
    for (n, m, h), quick in (((2, 2, 1), True), ((2, 2, 2), True), ((3, 2, 2), False)):
        for metric in ("inv", "mix"):
            out.append(
                E(
                    f"christoffel GL {metric} quadratic n={n},m={m},h={h}",
                    partial(check_christoffel_gl_quadratic, n, m, h, metric),
                    quick,
                )
            )
    for metric in ("inv", "mix"):
        out.append(
            E(
                f"christoffel GL {metric} quadratic n=2,m=2,h=1,ε",
                partial(check_christoffel_gl_quadratic, 2, 2, 1, metric, eps=EPS),
                True,
            )
        )
        out.append(
            E(
                f"retraction GL {metric} second order (bridge) n=6,m=5,h=3",
                partial(retraction_bridge, 6, 5, 3, metric),
                True,
            )
        )
        out.append(
            E(
                f"retraction GL {metric} second order (bridge) n=6,m=5,h=3,eps=0.1",
                partial(retraction_bridge, 6, 5, 3, metric, eps=0.1),
                False,
            )
        )
    for metric in ("inv", "mix"):
        out.append(
            E(
                f"sympy=torch GL {metric} kernels n=3,m=2,h=2",
                partial(transcription_bridge, "gl", metric),
                True,
            )
        )
        out.append(
            E(
                f"sympy=torch diagonal {metric} kernels d=2",
                partial(transcription_bridge, "diagonal", metric),
                True,
            )
        )
    for (n, m, h), quick in (((6, 5, 3), True), ((8, 6, 4), False)):
        for metric in ("inv", "mix"):
            out.append(
                E(
                    f"christoffel GL {metric} (bridge) n={n},m={m},h={h}",
                    partial(christoffel_bridge, n, m, h, metric),
                    quick,
                )
            )
    for metric in ("inv", "mix"):
        out.append(
            E(
                f"christoffel GL {metric} (bridge) n=6,m=5,h=3,eps=0.1",
                partial(christoffel_bridge, 6, 5, 3, metric, eps=0.1),
                False,
            )
        )
    # geodesics
    out.append(
        E("geodesic scalar toy inv d=1", lambda: check_geodesic_diagonal(scalar_toy(), "inv"), True)
    )
    for metric in ("inv", "mix"):
        out.append(
            E(
                f"geodesic diagonal {metric} d=2",
                partial(check_geodesic_diagonal, None, metric),
                True,
            )
        )
    out.append(E("geodesic diagonal inv, any ξ d=2", check_geodesic_diagonal_general_inv, True))
    out.append(E("geodesic adaptive ε d=1", check_geodesic_adaptive, True))
    for eps in (0.0, 0.1):
        out.append(
            E(
                f"geodesic adaptive (bridge) eps={eps:g}",
                partial(geodesic_bridge_adaptive, eps),
                True,
            )
        )
    for metric in ("inv", "mix"):
        out.append(
            E(
                f"geodesic diagonal {metric} expmap (bridge) d=2",
                partial(geodesic_bridge_diagonal, metric),
                True,
            )
        )
    for metric in ("inv", "mix"):
        out.append(
            E(
                f"retraction diagonal {metric} d=2",
                partial(check_retraction_diagonal, 2, metric),
                True,
            )
        )
    # invariance
    for metric in ("inv", "mix"):
        out.append(
            E(
                f"invariance diagonal {metric} d=2",
                partial(check_invariance_diagonal, 2, metric),
                True,
            )
        )
    for (n, m, h), quick in (((2, 2, 1), True), ((2, 2, 2), True), ((3, 2, 2), False)):
        for metric in ("inv", "mix"):
            out.append(
                E(
                    f"invariance GL {metric} n={n},m={m},h={h}",
                    partial(check_invariance_gl, n, m, h, metric),
                    quick,
                )
            )
    # vertical / horizontal spaces
    for metric in ("inv", "mix"):
        out.append(
            E(
                f"vertical+horizontal diagonal {metric} d=2",
                partial(check_vertical_diagonal, 2, metric),
                True,
            )
        )
    for (n, m, h), quick in (((2, 2, 1), True), ((2, 2, 2), True), ((3, 2, 2), False)):
        for metric in ("inv", "mix"):
            out.append(
                E(
                    f"vertical+horizontal GL {metric} n={n},m={m},h={h}",
                    partial(check_vertical_gl, n, m, h, metric),
                    quick,
                )
            )
    # projections
    for metric in ("inv", "mix"):
        out.append(
            E(
                f"projection diagonal {metric} d=2",
                partial(check_projection_diagonal, 2, metric),
                True,
            )
        )
    for (n, m, h), metric, mode, quick in (
        ((2, 2, 1), "inv", "auto", True),
        ((2, 2, 1), "mix", "auto", True),
        ((2, 2, 2), "inv", "auto", True),
        ((2, 2, 2), "mix", "factored", True),
        ((2, 2, 2), "mix", "direct", False),
        ((3, 2, 2), "inv", "auto", False),
        ((3, 2, 2), "mix", "auto", False),
    ):
        out.append(
            E(
                f"projection GL {metric} n={n},m={m},h={h} ({mode})",
                partial(check_projection_gl, n, m, h, metric, mode=mode),
                quick,
            )
        )
    for metric in ("inv", "mix"):
        out.append(
            E(
                f"projection GL {metric} n=2,m=2,h=1,ε",
                partial(check_projection_gl, 2, 2, 1, metric, eps=EPS),
                True,
            )
        )
    for (n, m, h, eps), quick in (
        ((3, 2, 2, 0.0), True),
        ((3, 2, 2, 0.1), True),
        ((6, 5, 3, 0.0), False),
        ((6, 5, 3, 0.1), False),
    ):
        for metric in ("inv", "mix"):
            tag = f",eps={eps:g}" if eps else ""
            out.append(
                E(
                    f"projection GL {metric} (bridge) n={n},m={m},h={h}{tag}",
                    partial(projection_bridge, n, m, h, metric, eps),
                    quick,
                )
            )
    # Riemannian gradients
    for metric in ("inv", "mix"):
        out.append(
            E(f"rgrad diagonal {metric} d=2", partial(check_rgrad_diagonal, 2, metric), True)
        )
    for (n, m, h), metrics, quick in (
        ((2, 2, 1), ("inv", "mix"), True),
        ((2, 2, 2), ("inv",), True),
        ((2, 2, 2), ("mix",), False),
        ((3, 2, 2), ("inv", "mix"), False),
    ):
        for metric in metrics:
            out.append(
                E(
                    f"rgrad GL {metric} n={n},m={m},h={h}",
                    partial(check_rgrad_gl, n, m, h, metric),
                    quick,
                )
            )
    for metric in ("inv", "mix"):
        out.append(
            E(
                f"rgrad GL {metric} n=2,m=2,h=1,ε",
                partial(check_rgrad_gl, 2, 2, 1, metric, eps=EPS),
                True,
            )
        )
    out += _subgroup_suite()
    return out


def _subgroup_suite() -> list[Entry]:
    """Subgroup quotients: the rotary commutant (RoPE) and its projection."""
    from ..geometry.subgroup import RotaryCommutant as RC

    E = Entry
    full4, inter4, half3, half4 = (RC.rotate_half(4), RC.interleaved(4), RC.rotate_half(3, 2),
                                   RC.rotate_half(4, 2))
    out: list[Entry] = []
    for sub, quick in ((RC.rotate_half(2), True), (full4, True), (inter4, False),
                       (half3, True), (half4, False)):
        out.append(E(f"rotary commutant {subalgebra_label(sub)}",
                     partial(check_rotary_commutant, sub), quick))
    for (n, m, sub), quick in (((2, 2, RC.rotate_half(2)), True), ((3, 3, half3), False),
                               ((2, 2, full4), False), ((2, 2, half4), False)):
        for metric in ("inv", "mix"):
            out.append(E(f"vertical+horizontal subgroup {metric} {subalgebra_label(sub)}",
                         partial(check_vertical_subgroup, n, m, sub, metric), quick))
    for (n, m, sub, solve), quick in (((2, 2, RC.rotate_half(2), documented_x), True),
                                      ((2, 2, half3, documented_x), False),
                                      ((2, 2, full4, None), True), ((2, 2, inter4, None), False),
                                      ((2, 2, half4, None), False)):
        for metric in ("inv", "mix"):
            out.append(E(
                f"projection subgroup {metric} {subalgebra_label(sub)}"
                + (" +solver" if solve else ""),
                partial(check_projection_subgroup, n, m, sub, metric, solve=solve),
                quick and (metric == "inv" or solve is not None)))
    for metric in ("inv", "mix"):
        out.append(E(f"projection subgroup {metric} ε h=2,rotate_half",
                     partial(check_projection_subgroup, 2, 2, RC.rotate_half(2), metric,
                             solve=documented_x, eps=EPS), False))
    for (n, m, sub, metric, eps), quick in (
        ((3, 2, RC.rotate_half(2), "inv", 0.0), True),
        ((5, 4, half4, "mix", 0.1), True),
        ((5, 5, inter4, "inv", 0.0), False),
        ((5, 4, half4, "inv", 0.1), False),
        ((7, 6, RC.rotate_half(6, 4), "mix", 0.0), False),
    ):
        tag = f",eps={eps:g}" if eps else ""
        out.append(E(f"projection subgroup {metric} (bridge) {subalgebra_label(sub)}{tag}",
                     partial(subgroup_projection_bridge, n, m, sub, metric, eps), quick))
    return out


SUITE: list[Entry] = _suite()


def select(quick: bool = False, pattern: str | None = None) -> list[Entry]:
    """The registered checks, optionally only the quick ones and/or matching ``pattern``."""
    return [
        e
        for e in SUITE
        if (e.quick or not quick) and (pattern is None or pattern.lower() in e.label.lower())
    ]


HEADER = ("check", "subject", "sizes", "mode", "result", "seconds")


def _row(r: CheckResult) -> tuple[str, ...]:
    return (r.check, r.subject, r.sizes, r.mode, "PASS" if r.passed else "FAIL", f"{r.seconds:.2f}")


_WIDTHS = (20, 34, 24, 9, 6, 8)


def _fmt(cells: Sequence[str]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, _WIDTHS)).rstrip()


def format_table(results: Sequence[CheckResult], markdown: bool = False) -> str:
    """The result table as plain text or Markdown (failure details appended)."""
    if markdown:
        lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(_row(r)) + " |" for r in results]
    else:
        lines = [_fmt(HEADER), _fmt(["-" * (w - 1) for w in _WIDTHS])]
        lines += [_fmt(_row(r)) for r in results]
    for r in results:
        if not r.passed:
            lines.append(f"FAIL {r.check} {r.subject} {r.sizes}: {r.detail}")
    return "\n".join(lines)


def run_suite(
    entries: Sequence[Entry], stream: TextIO | None = None, markdown: bool = False
) -> list[CheckResult]:
    """Run ``entries`` in order, printing each row to ``stream`` as it finishes."""
    results = []
    if stream is not None and not markdown:
        print(_fmt(HEADER), file=stream)
        print(_fmt(["-" * (w - 1) for w in _WIDTHS]), file=stream, flush=True)
    for e in entries:
        r = e.run()
        results.append(r)
        if stream is not None and not markdown:
            print(_fmt(_row(r)), file=stream, flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0: every check passed)."""
    parser = argparse.ArgumentParser(
        prog="python -m quotient_manifolds.symbolic",
        description="Symbolic (SymPy) verification of the quotient-geometry formulas.",
    )
    parser.add_argument("--quick", action="store_true", help="run the fast subset only")
    parser.add_argument("-k", dest="pattern", default=None, help="only checks matching PATTERN")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--latex", action="store_true", help="print the derivations (Markdown)")
    args = parser.parse_args(None if argv is None else list(argv))

    import torch

    torch.set_num_threads(1)
    if args.latex:
        from .latex import derivations_markdown

        print(derivations_markdown())
        return 0
    entries = select(args.quick, args.pattern)
    if args.list:
        for e in entries:
            print(("quick  " if e.quick else "full   ") + e.label)
        return 0
    if not entries:
        print("no check matches", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = run_suite(entries, sys.stdout, args.markdown)
    failed = [r for r in results if not r.passed]
    if args.markdown:
        print(format_table(results, markdown=True))
    else:
        for r in failed:
            print(f"FAIL {r.check} {r.subject} {r.sizes}: {r.detail}")
    total = time.perf_counter() - t0
    print(f"\n{len(results) - len(failed)}/{len(results)} passed in {total:.1f} s")
    return 1 if failed else 0
