r"""The tangent ball of one manifold as a geoopt manifold.

[`TangentBall`][quotient_manifolds.sharpness.tangent_ball.TangentBall] turns the inner
maximisation of geodesic sharpness (Eq. 4) at a single manifold point into an ordinary geoopt
problem: its points are tangent vectors $\xi$ at the fixed base point $x_0$, horizontal and with
$\|\xi\|_{x_0} \le \rho$. It is the
[`MetricBall`][quotient_manifolds.sharpness.feasible.MetricBall] of `manifold.at(x0)` seen
through [`FeasibleSetManifold`][quotient_manifolds.sharpness.solvers.FeasibleSetManifold], with
points shaped like $x_0$.
"""

from __future__ import annotations

import torch

from ..manifolds.base import QuotientManifold
from ..manifolds.product import ProductTangentSpace
from .checks import check_rho
from .feasible import MetricBall
from .solvers import FeasibleSetManifold

__all__ = ["TangentBall"]


class TangentBall(FeasibleSetManifold):
    r"""$\{\xi \in \mathcal H_{x_0} : \|\xi\|_{x_0} \le \rho\}$ as a geoopt manifold.

    Parameters
    ----------
    manifold : QuotientManifold
        A quotient manifold (`GLQuotient`, `AdaptiveEuclidean`, …).
    base_point : Tensor
        $x_0$; a batch of blocks counts as one point (the ball constrains the total norm over
        the whole tensor).
    radius : float
        $\rho > 0$.

    Notes
    -----
    `proju(ξ, u)` and `egrad2rgrad(ξ, u)` ignore ξ and use $x_0$; `retr(ξ, u)` is the metric
    projection of $\xi + u$ onto the ball ($\Pi$, then the radial shrink $\min(1,
    \rho/\|\cdot\|)$), and `projx` is the same projection. `.to(...)` moves the base point and
    rebuilds the tangent space.
    """

    name = "TangentBall"

    def __init__(self, manifold: QuotientManifold, base_point: torch.Tensor,
                 radius: float) -> None:
        radius = check_rho(radius, "radius")
        base_point = base_point.detach()
        super().__init__(self._ball(manifold, base_point, radius), shape=base_point.shape)
        self.manifold = manifold
        self.register_buffer("base_point", base_point)

    @staticmethod
    def _ball(manifold, base_point: torch.Tensor, radius: float) -> MetricBall:
        return MetricBall(ProductTangentSpace([manifold.at(base_point)]), radius)

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self.feasible = self._ball(self.manifold, self.base_point, self.feasible.rho)
        return out

    def extra_repr(self) -> str:
        return f"radius={self.radius:g}, manifold={self.manifold.name}"
