"""Shared machinery of the quotient manifolds: retraction choice, checks, transport."""

from __future__ import annotations

import geoopt
import torch
from geoopt.utils import size2shape

from ..errors import NonFiniteError, ShapeError
from ..geometry.gl import check_finite

__all__ = ["RETRACTIONS", "QuotientManifold", "assert_broadcastable"]

RETRACTIONS = ("first_order", "second_order", "exact")


def assert_broadcastable(shapes: dict, ndim: int) -> None:
    """Points and vectors must share their trailing ``ndim`` dims and broadcast in front."""
    points = {tuple(s[-ndim:]) for s in shapes.values()}
    try:
        torch.broadcast_shapes(*(s[:-ndim] for s in shapes.values()))
    except RuntimeError:
        points = set()
    if len(points) != 1:
        listed = ", ".join(f"{k}: {tuple(v)}" for k, v in shapes.items())
        raise ShapeError(f"point and tangent vectors do not match ({listed})")


class QuotientManifold(geoopt.manifolds.Manifold):
    r"""Base class: a metric with Christoffel form ``Γ`` and a choice of retraction.

    Subclasses implement the geometry kernels ``inner``, ``proju``,
    ``egrad2rgrad``, :meth:`christoffel` and the exact geodesic
    ``_geodesic``.  This class turns them into geoopt's ``retr`` (chosen by
    ``retraction``), ``expmap`` (always exact), ``transp`` (projection onto the
    horizontal space at the target point, spec §15) and ``retr_transp``.

    Retractions (spec §6.3):

    * ``"first_order"``: ``x + u``;
    * ``"second_order"``: ``x + u − ½ Γ_x(u, u)``, the truncated geodesic of Eq. 5;
    * ``"exact"``: the geodesic ``γ_u(1)``.
    """

    __scaling__ = geoopt.manifolds.Manifold.__scaling__.copy()
    reversible = False

    def __init__(self, retraction: str, validate: bool = True) -> None:
        super().__init__()
        if retraction not in RETRACTIONS:
            raise ValueError(f"retraction must be one of {RETRACTIONS}, got {retraction!r}")
        self.retraction = retraction
        self.validate = validate

    # -- checks ---------------------------------------------------------------
    def _check_inputs(self, *tensors: torch.Tensor | None) -> None:
        if self.validate:
            check_finite(*(t for t in tensors if t is not None))

    def _point_finite(self, x: torch.Tensor) -> tuple[bool, str | None]:
        try:
            check_finite(x, what="point")
        except NonFiniteError as e:
            return False, str(e)
        return True, None

    # -- geometry provided by subclasses --------------------------------------
    def christoffel(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None
    ) -> torch.Tensor:
        r"""Christoffel form ``Γ_x(u, v)``; ``Γ_x(u, u)`` when ``v`` is omitted."""
        raise NotImplementedError

    def _geodesic(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # -- retractions ----------------------------------------------------------
    def retr(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The retraction selected by ``retraction`` (optimizers call this)."""
        if self.retraction == "first_order":
            self._check_inputs(x, u)
            return x + u
        if self.retraction == "second_order":
            return self.retr_second_order(x, u)
        return self._geodesic(x, u)

    def retr_second_order(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""``x + u − ½ Γ_x(u, u)`` (Eq. 5), Γ evaluated at the base point."""
        return x + u - 0.5 * self.christoffel(x, u)

    def expmap(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The exact geodesic ``γ_u(1)``, whatever ``retraction`` says."""
        return self._geodesic(x, u)

    def transp(self, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Vector transport by horizontal projection at ``y`` (not an isometry)."""
        return self.proju(y, v)

    def retr_transp(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.retr(x, u)
        return y, self.proju(y, v)

    def projx(self, x: torch.Tensor) -> torch.Tensor:
        """Identity: a point is never moved along its orbit (geoopt-notes §2.4)."""
        return x

    def extra_repr(self) -> str:
        return f"retraction={self.retraction!r}"

    # -- sampling -------------------------------------------------------------
    def _random_tensor(self, shape, dtype, device) -> torch.Tensor:
        """Standard Gaussian entries (nonzero almost surely)."""
        return torch.randn(shape, dtype=dtype, device=device)

    def _origin_tensor(self, shape, dtype, device) -> torch.Tensor:
        """All ones."""
        return torch.ones(shape, dtype=dtype, device=device)

    def random(
        self, *size: int | tuple[int], dtype: torch.dtype | None = None, device=None
    ) -> geoopt.ManifoldTensor:
        """A random point of shape ``size`` (see ``_random_tensor`` of each manifold)."""
        shape = size2shape(*size)
        self._assert_check_shape(shape, "x")
        return geoopt.ManifoldTensor(self._random_tensor(shape, dtype, device), manifold=self)

    def origin(
        self,
        *size: int | tuple[int],
        dtype: torch.dtype | None = None,
        device=None,
        seed: int | None = 42,
    ) -> geoopt.ManifoldTensor:
        """A deterministic point of shape ``size`` (see ``_origin_tensor``); ``seed`` is unused."""
        shape = size2shape(*size)
        self._assert_check_shape(shape, "x")
        return geoopt.ManifoldTensor(self._origin_tensor(shape, dtype, device), manifold=self)
