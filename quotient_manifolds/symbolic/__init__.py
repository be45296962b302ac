r"""Symbolic verification of the quotient geometry with SymPy (spec §5, §6, §10, §14).

The library proves its own formulas: every Christoffel symbol, horizontal
space, projection and Riemannian gradient is *derived* from the metric alone,
written as a SymPy matrix in coordinates, and compared with the library's
kernels evaluated on SymPy inputs; numeric bridges tie the symbolic results
to the torch implementation at larger sizes.

Layers (imports point one way: this package uses
:mod:`quotient_manifolds.geometry` and :mod:`quotient_manifolds.manifolds`,
never the reverse):

* :mod:`.algebra` — exact zero tests (refute at random rationals, prove by
  ``together``/``expand`` in ``QQ[x]``);
* :mod:`.riemann` — Christoffel symbols, geodesic equations, vertical and
  horizontal spaces from a :class:`~.riemann.CoordinateMetric`;
* :mod:`.tensor` — :class:`~.tensor.SymTensor`, which runs the torch kernels
  on SymPy expressions;
* :mod:`.models` — the metrics and group actions of the paper, in coordinates;
* :mod:`.candidates` — Λ solvers and deliberately wrong formulas (paper typos);
* :mod:`.checks` — the checks, each taking the formula under test as an argument;
* :mod:`.bridge` — numeric bridges to the torch classes;
* :mod:`.cli` — ``python -m quotient_manifolds.symbolic`` (:func:`main`);
* :mod:`.latex` — the derivations as Markdown/LaTeX (``--latex``).
"""

from .checks import CheckResult
from .cli import main
from .riemann import ChristoffelSymbols, CoordinateMetric

__all__ = ["CheckResult", "ChristoffelSymbols", "CoordinateMetric", "main"]
