r"""Diagonal networks ``β = u ⊙ v`` modulo the re-scaling group GL(1)^d."""

from __future__ import annotations

import torch

from ..errors import RankDeficientError, ShapeError
from ..geometry import diagonal as dm
from ..geometry.gl import METRICS
from ..geometry.linalg import compute_dtype
from .base import QuotientManifold, assert_broadcastable

__all__ = ["DiagonalQuotient"]


class DiagonalQuotient(QuotientManifold):
    r"""Quotient ``(R_*^d × R_*^d) / GL(1)^d`` of diagonal networks (spec §5.2).

    A point has shape ``(..., 2, d)``: row 0 is ``u``, row 1 is ``v``; the
    network sees ``β = u ⊙ v``.  The group acts by ``(α ⊙ u, α⁻¹ ⊙ v)``.

    Parameters
    ----------
    metric : {"inv", "mix"}
        inv (Eq. 6): ``Σ η_u ν_u / u² + η_v ν_v / v²``;
        mix (Eq. 7): ``Σ η_u ν_u v² + η_v ν_v u²``.
    retraction : {"first_order", "second_order", "exact"}
        ``exact`` (default) uses the closed-form geodesics: inv
        ``(u e^{ξ_u/u}, v e^{ξ_v/v})``; mix a straight line in the flat
        coordinates ``(|uv|, log|u/v|)``, which for horizontal ``ξ = (bu, bv)``
        is ``(u√(1+2b), v√(1+2b))`` (Eq. 24).
    validate : bool
        Check shapes, finiteness and nonzero entries of inputs.

    Notes
    -----
    The horizontal space ``{η_u/u = η_v/v}`` and the projection
    ``Π(η) = (b u, b v)``, ``b = ½(η_u/u + η_v/v)``, are the same for both
    metrics.  Horizontal norms: ``‖ξ‖²_inv = 2‖b‖²`` and
    ``‖ξ‖²_mix = 2‖β ⊙ b‖²``.
    """

    name = "DiagonalQuotient"
    ndim = 2

    def __init__(
        self, metric: str = "inv", retraction: str = "exact", *, validate: bool = True
    ) -> None:
        super().__init__(retraction, validate)
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        self.metric = metric

    def extra_repr(self) -> str:
        return f"metric={self.metric!r}, {super().extra_repr()}"

    # -- packing ---------------------------------------------------------------
    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(u, v)`` of a packed ``(..., 2, d)`` tensor."""
        return t[..., 0, :], t[..., 1, :]

    unpack_tensor = split

    def pack_point(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Stack ``u`` and ``v`` (each ``(..., d)``) into ``(..., 2, d)``."""
        return torch.stack(torch.broadcast_tensors(u, v), dim=-2)

    def _join(self, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.pack_point(a, b).to(dtype)

    # -- checks ---------------------------------------------------------------
    def _check_shape(self, shape: tuple[int], name: str) -> tuple[bool, str | None]:
        if len(shape) < 2 or shape[-2] != 2:
            return False, f"`{name}` must have shape (..., 2, d) (rows u, v), got {tuple(shape)}"
        return True, None

    def _nonzero(self, x: torch.Tensor) -> tuple[bool, str | None]:
        if bool((x == 0).any()):
            return False, (
                "a diagonal-net point has a zero entry in u or v; the GL(1)^d quotient "
                "needs u_i, v_i != 0 (perturb the zero weights or drop those coordinates)"
            )
        return True, None

    def _check_point_on_manifold(
        self, x: torch.Tensor, *, atol: float = 1e-5, rtol: float = 1e-5
    ) -> tuple[bool, str | None]:
        ok, reason = self._point_finite(x)
        return self._nonzero(x) if ok else (ok, reason)

    def _check_vector_on_tangent(
        self, x: torch.Tensor, u: torch.Tensor, *, atol: float = 1e-5, rtol: float = 1e-5
    ) -> tuple[bool, str | None]:
        (a, c), (xa, xc) = self.split(x), self.split(u)
        lhs, rhs = xa * c, xc * a  # η_u/u = η_v/v  ⇔  η_u v = η_v u
        if not torch.allclose(lhs, rhs, atol=atol, rtol=rtol):
            return False, (
                "vector is not horizontal: η_u/u != η_v/v "
                f"(max |η_u v − η_v u| = {(lhs - rhs).abs().max().item():.3g})"
            )
        return True, None

    def _prepare(self, x: torch.Tensor, *vectors: torch.Tensor | None):
        if self.validate:
            for name, t in (("x", x),) + tuple((f"u{i}", v) for i, v in enumerate(vectors)):
                if t is not None:
                    ok, reason = self._check_shape(t.shape, name)
                    if not ok:
                        raise ShapeError(reason)
            assert_broadcastable(
                {"x": x.shape}
                | {f"u{i}": v.shape for i, v in enumerate(vectors) if v is not None},
                self.ndim,
            )
            self._check_inputs(x, *vectors)
            ok, reason = self._nonzero(x)
            if not ok:
                raise RankDeficientError(reason)
        dt = compute_dtype(x.dtype)
        return tuple(None if t is None else self.split(t.to(dt)) for t in (x,) + vectors)

    # -- geometry -------------------------------------------------------------
    def inner(
        self,
        x: torch.Tensor,
        u: torch.Tensor,
        v: torch.Tensor | None = None,
        *,
        keepdim: bool = False,
    ) -> torch.Tensor:
        r"""The metric (Eq. 6 or 7), summed over the ``d`` coordinates."""
        (a, c), (ua, uc), vv = self._prepare(x, u, v)
        va, vc = (ua, uc) if vv is None else vv
        out = dm.inner_terms(a, c, ua, uc, va, vc, self.metric).sum(-1).to(u.dtype)
        return out[..., None, None] if keepdim else out

    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""``(b ⊙ u, b ⊙ v)`` with ``b = ½(η_u/u + η_v/v)``."""
        (a, c), (ua, uc) = self._prepare(x, u)
        return self._join(*dm.project(a, c, ua, uc), u.dtype)

    def egrad2rgrad(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""inv: ``Π(u² ∂_u L, v² ∂_v L)``; mix: ``Π(∂_u L / v², ∂_v L / u²)``."""
        (a, c), (ga, gc) = self._prepare(x, u)
        return self._join(*dm.egrad2rgrad(a, c, ga, gc, self.metric), u.dtype)

    def christoffel(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None
    ) -> torch.Tensor:
        r"""``Γ_x(u, v)``; see :func:`quotient_manifolds.geometry.diagonal.christoffel`."""
        (a, c), (ua, uc), vv = self._prepare(x, u, v)
        va, vc = (ua, uc) if vv is None else vv
        return self._join(*dm.christoffel(a, c, ua, uc, va, vc, self.metric), u.dtype)

    def _geodesic(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        (a, c), (ua, uc) = self._prepare(x, u)
        return self._join(*dm.geodesic(a, c, ua, uc, self.metric), x.dtype)

    def horizontal_coefficient(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""``b = ½(η_u/u + η_v/v)``: the horizontal part of ``u`` as a ``(..., d)`` tensor."""
        (a, c), (ua, uc) = self._prepare(x, u)
        return dm.horizontal_coefficient(a, c, ua, uc).to(u.dtype)

    # -- group structure --------------------------------------------------------
    def vertical(self, x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
        r"""The vertical vector ``(ω ⊙ u, −ω ⊙ v)`` for ``ω ∈ R^d``."""
        a, c = self.split(x)
        return self._join(omega * a, -omega * c, x.dtype)

    def act(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        r"""Group action ``(α ⊙ u, α⁻¹ ⊙ v)`` for ``α = g ∈ (R_*)^d``."""
        a, c = self.split(x)
        return self._join(g * a, c / g, x.dtype)

    def invariant(self, x: torch.Tensor) -> torch.Tensor:
        """``β = u ⊙ v``."""
        a, c = self.split(x)
        return a * c
