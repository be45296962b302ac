r"""Symbolic verification of the quotient geometry with SymPy.

The library proves its own formulas: every Christoffel symbol, horizontal
space, projection and Riemannian gradient is *derived* from the metric alone,
written as a SymPy matrix in coordinates, and compared with the library's
kernels evaluated on SymPy inputs; numeric bridges tie the symbolic results
to the torch implementation at larger sizes.

Layers (imports point one way: this package uses
`quotient_manifolds.geometry` and `quotient_manifolds.manifolds`,
never the reverse):

* [`algebra`][quotient_manifolds.symbolic.algebra] — exact zero tests (refute at random rationals,
  prove by ``together``/``expand`` in ``QQ[x]``);
* [`riemann`][quotient_manifolds.symbolic.riemann] — Christoffel symbols, geodesic equations,
  vertical and horizontal spaces from a
  [`CoordinateMetric`][quotient_manifolds.symbolic.riemann.CoordinateMetric];
* [`tensor`][quotient_manifolds.symbolic.tensor] —
  [`SymTensor`][quotient_manifolds.symbolic.tensor.SymTensor], which runs the torch kernels on SymPy
  expressions;
* [`models`][quotient_manifolds.symbolic.models] — the metrics and group actions of the paper, in
  coordinates;
* [`candidates`][quotient_manifolds.symbolic.candidates] — Λ solvers and deliberately wrong formulas
  (paper typos);
* [`checks`][quotient_manifolds.symbolic.checks] — the checks, each taking the formula under test as
  an argument;
* [`bridge`][quotient_manifolds.symbolic.bridge] — numeric bridges to the torch classes;
* [`cli`][quotient_manifolds.symbolic.cli] — ``python -m quotient_manifolds.symbolic``
  ([`main`][quotient_manifolds.symbolic.cli.main]);
* [`latex`][quotient_manifolds.symbolic.latex] — the derivations as Markdown/LaTeX (``--latex``).
"""

from .checks import CheckResult
from .cli import main
from .riemann import ChristoffelSymbols, CoordinateMetric

__all__ = ["CheckResult", "ChristoffelSymbols", "CoordinateMetric", "main"]
