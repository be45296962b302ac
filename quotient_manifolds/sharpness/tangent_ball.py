r"""The tangent ball: horizontal tangent vectors of norm at most ρ at a fixed base point.

:class:`TangentBall` turns the inner maximisation of geodesic sharpness (Eq. 4)
into an ordinary geoopt problem: its points are tangent vectors ``ξ`` at the
fixed base point ``x₀`` with ``ξ`` horizontal and ``‖ξ‖_{x₀} ≤ ρ``.  The metric,
projection and Riemannian gradient are those of the underlying manifold at
``x₀`` (constant in ``ξ``: the ball lives in one tangent space, spec §7.3), and
:meth:`TangentBall.retr` is the exact metric projection onto the ball:
horizontal projection, then radial rescale.  Any geoopt optimizer can
therefore run the maximisation (minimise ``−L``; geoopt has no ``maximize``).
"""

from __future__ import annotations

import geoopt
import torch

from ..errors import InvalidRadiusError, ShapeError

__all__ = ["TangentBall"]


class TangentBall(geoopt.manifolds.Manifold):
    r"""``{ξ ∈ H_{x₀} : ‖ξ‖_{x₀} ≤ ρ}`` as a geoopt manifold.

    Parameters
    ----------
    manifold : geoopt Manifold
        A quotient manifold (``GLQuotient``, ``AdaptiveEuclidean``, …).
    base_point : Tensor
        ``x₀``; a batch of blocks counts as one point (the ball constrains the
        total norm over the whole tensor).
    radius : float
        ``ρ > 0``.

    Notes
    -----
    ``proju(ξ, u)`` and ``egrad2rgrad(ξ, u)`` ignore ``ξ`` and use ``x₀``.
    ``retr(ξ, u) = P(Π_{x₀}(ξ + u))`` with ``P`` the radial rescale
    ``min(1, ρ/‖·‖)``; ``projx`` is the same projection (idempotent, the
    identity inside the ball).
    """

    name = "TangentBall"
    ndim = 0
    reversible = False

    def __init__(self, manifold, base_point: torch.Tensor, radius: float) -> None:
        super().__init__()
        radius = float(radius)
        if not (radius > 0 and radius < float("inf")):
            raise InvalidRadiusError(f"radius must be positive and finite, got {radius}")
        self.manifold = manifold
        self.register_buffer("base_point", base_point.detach())
        self.radius = radius

    def extra_repr(self) -> str:
        return f"radius={self.radius:g}, manifold={self.manifold.name}"

    def _check_shape(self, shape, name):
        if tuple(shape) != tuple(self.base_point.shape):
            want = tuple(self.base_point.shape)
            return False, f"`{name}` must have the base point's shape {want}"
        return True, None

    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        nrm = float(self.norm_at_base(x))
        if nrm > self.radius * (1 + rtol) + atol:
            return False, f"‖ξ‖ = {nrm:.6g} exceeds the radius {self.radius:g}"
        return self.manifold._check_vector_on_tangent(self.base_point, x, atol=atol, rtol=rtol)

    def _check_vector_on_tangent(self, x, u, *, atol=1e-5, rtol=1e-5):
        return self.manifold._check_vector_on_tangent(self.base_point, u, atol=atol, rtol=rtol)

    def norm_at_base(self, u: torch.Tensor) -> torch.Tensor:
        """Total norm ``‖u‖_{x₀}`` (summed over every block of the tensor)."""
        return self.manifold.inner(self.base_point, u).sum().clamp_min(0).sqrt()

    def inner(self, x, u, v=None, *, keepdim=False):
        """The metric of ``x₀`` (independent of ``x``)."""
        return self.manifold.inner(self.base_point, u, v, keepdim=keepdim)

    def proju(self, x, u):
        """Horizontal projection at ``x₀``."""
        return self.manifold.proju(self.base_point, u)

    def egrad2rgrad(self, x, u):
        """Horizontal Riemannian gradient at ``x₀``."""
        return self.manifold.egrad2rgrad(self.base_point, u)

    def projx(self, x):
        """Metric projection onto the ball: Π, then ``ξ · min(1, ρ/‖ξ‖)``."""
        x = self.manifold.proju(self.base_point, x)
        nrm = self.norm_at_base(x)
        return x * torch.clamp(self.radius / nrm.clamp_min(torch.finfo(x.dtype).tiny), max=1.0)

    def retr(self, x, u):
        """``projx(x + u)``: a step in the tangent space, then back into the ball."""
        if u.shape != x.shape:
            raise ShapeError(f"step shape {tuple(u.shape)} != point shape {tuple(x.shape)}")
        return self.projx(x + u)

    expmap = retr

    def transp(self, x, y, v):
        """Identity up to horizontal projection (one tangent space)."""
        return self.proju(y, v)

    def retr_transp(self, x, u, v):
        y = self.retr(x, u)
        return y, self.transp(x, y, v)

    expmap_transp = retr_transp

    def origin(self, *size, dtype=None, device=None, seed=42):
        """The zero vector (the centre of the ball)."""
        return geoopt.ManifoldTensor(torch.zeros_like(self.base_point), manifold=self)

    def random(self, *size, dtype=None, device=None):
        """A random horizontal vector of norm ``ρ/2``."""
        z = self.manifold.proju(self.base_point, torch.randn_like(self.base_point))
        z = z * (0.5 * self.radius / self.norm_at_base(z))
        return geoopt.ManifoldTensor(z, manifold=self)
