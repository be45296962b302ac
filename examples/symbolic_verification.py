"""Symbolic verification: the library's formulas proven from the metrics, and a typo rejected.

1. Derive the Christoffel symbols of the paper's scalar toy ``x ↦ GHx`` with the inv metric
   ``dG²/G² + dH²/H²`` (App. D) with :class:`quotient_manifolds.symbolic.CoordinateMetric`.
2. Prove library kernels against references derived from the metric alone
   (:mod:`quotient_manifolds.symbolic.checks`): Christoffel forms of diagonal nets and of GL(h)
   blocks (Eq. 11, 12 incl. the ``H`` part the paper omits) and the horizontal space of a GL(2)
   block (and, without ``--small``, the inv horizontal projection).
3. Feed the same checks wrong formulas: the paper's printed inv horizontal condition
   ``ξ_GᵀGQ = P Hᵀ ξ_Hᵀ``, a mix Christoffel form without its ``H`` part, and (without
   ``--small``) the paper's printed Sylvester equation ``AΛ + ΛAᵀ = B`` (both printed forms
   and their corrections: docs/corrections.md). Each is rejected with a counterexample, while
   the library's own formulas pass.

The full table (``python -m quotient_manifolds verify``) covers every check; see
docs/derivations.md. Run::

    python examples/symbolic_verification.py [--small]
"""

from __future__ import annotations

import argparse
import sys

import sympy as sp

from quotient_manifolds.symbolic import CheckResult, CoordinateMetric
from quotient_manifolds.symbolic.candidates import (
    christoffel_mix_without_h_part,
    paper_inv_horizontal_residual,
    paper_sylvester_lambda,
)
from quotient_manifolds.symbolic.checks import (
    check_christoffel_diagonal,
    check_christoffel_gl,
    check_projection_gl,
    check_vertical_gl,
)


def show(r: CheckResult, expect: bool) -> bool:
    verdict = "PROVEN  " if r.passed else "REJECTED"
    ok = r.passed == expect
    print(f"{verdict} {r.check:<19} {r.subject:<20} {r.sizes:<14} {r.seconds:6.2f} s  "
          f"{r.detail[:90]}")
    if not ok:
        print(f"  !! expected {'a proof' if expect else 'a rejection'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="smallest sizes only (CI)")
    args = parser.parse_args()

    G, H = sp.symbols("G H", nonzero=True)
    g = CoordinateMetric(sp.diag(1 / G**2, 1 / H**2), [G, H], name="scalar toy, inv")
    print(f"metric {g.name}: {g.matrix.tolist()}")
    for (lam, mu, nu), expr in g.christoffel().nonzero():
        print(f"  Γ^{g.coords[lam]}_{{{g.coords[mu]}{g.coords[nu]}}} = {expr}")
    print()

    good = [
        check_christoffel_diagonal(2, "inv"),
        check_christoffel_diagonal(2, "mix"),
        check_christoffel_gl(1, 1, 1, "mix"),
        check_vertical_gl(2, 2, 2, "inv"),
    ]
    bad = [
        check_vertical_gl(2, 2, 2, "inv", residual=paper_inv_horizontal_residual),
        check_christoffel_gl(1, 1, 1, "mix", candidate=christoffel_mix_without_h_part),
    ]
    if not args.small:  # about 30 s more
        good += [check_christoffel_gl(2, 2, 1, "inv"), check_projection_gl(2, 2, 2, "inv")]
        bad += [check_projection_gl(2, 2, 2, "inv", lam=paper_sylvester_lambda)]
    ok = all([show(r, True) for r in good] + [show(r, False) for r in bad])
    print("\nall proofs hold and every wrong formula is rejected" if ok else "\nUNEXPECTED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
