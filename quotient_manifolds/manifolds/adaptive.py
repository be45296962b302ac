r"""The elementwise "adaptive" geometry used for every weight outside a GL block."""

from __future__ import annotations

import torch
from geoopt.utils import broadcast_shapes

from ..errors import ShapeError, ZeroWeightError
from ..geometry import adaptive as am
from ..geometry.linalg import compute_dtype
from .base import QuotientManifold

__all__ = ["AdaptiveEuclidean"]


class AdaptiveEuclidean(QuotientManifold):
    r"""``R_*^N`` with the metric ``⟨ξ, ζ⟩_w = Σ ξ ζ / (w² + ε)``.

    This is the geometry behind adaptive sharpness (spec §6.6, §7.3): its norm
    is ``‖ξ ⊘ |w|‖₂`` and its Riemannian gradient ``w² ⊙ ∇L``.  Each weight is
    an independent one-dimensional manifold, so there is no vertical space:
    :meth:`proju` is the identity.  :meth:`act` is the elementwise scaling
    ``w ↦ α ⊙ w``, an isometry of the metric (not a symmetry of a network).

    Parameters
    ----------
    eps : float
        ``ε`` in ``w² + ε``; guards zero weights.  With ``ε = 0`` a zero
        weight raises :class:`~quotient_manifolds.errors.ZeroWeightError`.
    retraction : {"first_order", "second_order", "exact"}
        ``w + ξ`` (adaptive sharpness), ``w + ξ + ½ w ξ²/(w² + ε)`` or the
        geodesic ``w e^{ξ/w}`` (``√ε sinh(asinh(w/√ε) + ξ/√(w² + ε))`` for ε > 0).
    ndim : int
        Trailing dimensions reduced by :meth:`inner`, as in ``geoopt.Euclidean``.
    validate : bool
        Check finiteness and zero weights.
    """

    name = "AdaptiveEuclidean"

    def __init__(
        self,
        eps: float = 0.0,
        retraction: str = "first_order",
        *,
        ndim: int = 0,
        validate: bool = True,
    ) -> None:
        super().__init__(retraction, validate)
        if eps < 0:
            raise ValueError(f"eps must be non-negative, got {eps}")
        if ndim < 0:
            raise ValueError(f"ndim must be non-negative, got {ndim}")
        self.eps = float(eps)
        self.ndim = int(ndim)

    def extra_repr(self) -> str:
        return f"eps={self.eps:g}, ndim={self.ndim}, {super().extra_repr()}"

    def _check_shape(self, shape: tuple[int], name: str) -> tuple[bool, str | None]:
        if len(shape) < self.ndim:
            return False, f"`{name}` needs at least ndim={self.ndim} dims, got {tuple(shape)}"
        return True, None

    def _zero_free(self, x: torch.Tensor) -> tuple[bool, str | None]:
        if self.eps == 0 and bool((am.scale2(x, 0.0) == 0).any()):
            return False, (
                "zero weight with eps = 0 (w = 0, or |w| so small that w² underflows): the "
                "adaptive metric ξ²/w² is undefined there; pass eps > 0 to use ξ²/(w² + eps)"
            )
        return True, None

    def _check_point_on_manifold(
        self, x: torch.Tensor, *, atol: float = 1e-5, rtol: float = 1e-5
    ) -> tuple[bool, str | None]:
        ok, reason = self._point_finite(x)
        return self._zero_free(x) if ok else (ok, reason)

    def _check_vector_on_tangent(
        self, x: torch.Tensor, u: torch.Tensor, *, atol: float = 1e-5, rtol: float = 1e-5
    ) -> tuple[bool, str | None]:
        return True, None

    def _prepare(self, x: torch.Tensor, *vectors: torch.Tensor | None, divides: bool = True):
        if self.validate:
            if len(x.shape) < self.ndim:
                raise ShapeError(self._check_shape(x.shape, "x")[1])
            self._check_inputs(x, *vectors)
            if divides:
                ok, reason = self._zero_free(x)
                if not ok:
                    raise ZeroWeightError(reason)
        dt = compute_dtype(x.dtype)
        return tuple(None if t is None else t.to(dt) for t in (x,) + vectors)

    def _reduce(self, t: torch.Tensor, x: torch.Tensor, keepdim: bool) -> torch.Tensor:
        if self.ndim > 0:
            t = t.sum(dim=tuple(range(-self.ndim, 0)), keepdim=keepdim)
            x_shape = x.shape[: -self.ndim] + (1,) * self.ndim * keepdim
        else:
            x_shape = x.shape
        return t.expand(broadcast_shapes(x_shape, t.shape))

    def inner(
        self,
        x: torch.Tensor,
        u: torch.Tensor,
        v: torch.Tensor | None = None,
        *,
        keepdim: bool = False,
    ) -> torch.Tensor:
        r"""``Σ u v / (w² + ε)`` over the trailing ``ndim`` dimensions."""
        w, u_, v_ = self._prepare(x, u, v)
        v_ = u_ if v_ is None else v_
        return self._reduce(u_ * v_ / am.scale2(w, self.eps), x, keepdim).to(u.dtype)

    def component_inner(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elementwise metric terms (so RiemannianAdam adapts per weight, like Adam)."""
        w, u_, v_ = self._prepare(x, u, v)
        v_ = u_ if v_ is None else v_
        out = u_ * v_ / am.scale2(w, self.eps)
        return out.expand(broadcast_shapes(x.shape, out.shape)).to(u.dtype)

    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Identity (no vertical space), broadcast to the shape of ``x``."""
        return u.expand(broadcast_shapes(x.shape, u.shape))

    def egrad2rgrad(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""``(w² + ε) ⊙ ∇L``."""
        w, g = self._prepare(x, u, divides=False)
        return am.egrad2rgrad(w, g, self.eps).to(u.dtype)

    def christoffel(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None
    ) -> torch.Tensor:
        r"""``Γ_w(u, v) = −w u v / (w² + ε)``."""
        w, u_, v_ = self._prepare(x, u, v)
        return am.christoffel(w, u_, u_ if v_ is None else v_, self.eps).to(u.dtype)

    def _geodesic(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        w, u_ = self._prepare(x, u)
        return am.geodesic(w, u_, self.eps).to(x.dtype)

    # -- group structure --------------------------------------------------------
    def vertical(self, x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
        """Zero: the adaptive geometry quotients out no symmetry."""
        return torch.zeros_like(x)

    def act(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Elementwise scaling ``g ⊙ x``, an isometry of the metric."""
        return g * x

    def invariant(self, x: torch.Tensor) -> torch.Tensor:
        """The weights themselves."""
        return x
