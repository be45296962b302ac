r"""GL(h) quotient of factor pairs ``(G, H)`` that act only through ``G Hᵀ``."""

from __future__ import annotations

import torch

from ..errors import RankDeficientError, ShapeError
from ..geometry import gl
from ..geometry.linalg import transpose
from .base import QuotientManifold, assert_broadcastable

__all__ = ["GLQuotient"]



class GLQuotient(QuotientManifold):
    r"""Quotient ``(R^{n×h}_* × R^{m×h}_*) / GL(h)`` of a factor pair.

    The pair ``(G, H)``, ``G ∈ R^{n×h}``, ``H ∈ R^{m×h}``, enters the network
    only through ``G Hᵀ``; the group acts by ``(G A⁻¹, H Aᵀ)`` (spec §3.3).
    This covers attention Q/K and V/O pairs per head (with appended bias rows,
    spec §3.4c), LoRA ``B A`` (``G = B``, ``H = Aᵀ``) and two-layer linear nets.

    A point is one tensor of shape ``(..., n + m, h)``: rows ``[:n]`` are
    ``G``, rows ``[n:]`` are ``H``.  Leading dimensions are a batch of
    independent blocks (heads, layers); every operation is batched.

    Parameters
    ----------
    n, m : int
        Rows of ``G`` and ``H``.
    metric : {"inv", "mix"}
        ``inv`` (Eq. 9): ``Tr(P⁻¹ η_Gᵀ ζ_G + Q⁻¹ η_Hᵀ ζ_H)``;
        ``mix`` (Eq. 10): ``Tr(Q η_Gᵀ ζ_G + P η_Hᵀ ζ_H)``, with
        ``P = GᵀG + εI`` and ``Q = HᵀH + εI``.
    eps : float
        Relaxation of every Gram matrix (spec §5.3.1); ``0`` requires full
        column rank.  With ``eps > 0`` the metric is no longer exactly
        GL(h)-invariant.
    retraction : {"first_order", "second_order", "exact"}
        What :meth:`retr` (and so every geoopt optimizer) uses: ``x + u``,
        ``x + u − ½Γ_x(u, u)`` (Eq. 5) or the geodesic integrated by RK4.
    steps : int
        RK4 steps of the exact geodesic (:meth:`expmap`).  The error is
        ``O((‖u‖/steps)⁴)``; see ``docs/benchmarks.md`` for measured values.
    validate : bool
        Check shapes and finiteness of inputs (one host sync per call).

    Notes
    -----
    * :meth:`proju` is the metric-orthogonal projection onto the horizontal
      space (§5.3.5): closed form for ``mix``; for ``inv`` the corrected
      Sylvester equation ``AΩ + ΩA = B``, ``A = PQ``, solved in the
      eigenbasis of ``A``.
    * :meth:`egrad2rgrad` is the horizontal Riemannian gradient (§5.3.6).
    * :meth:`projx` is the identity: points are never moved along orbits.
    * geoopt has no ``maximize``: for ascent, minimise the negated objective.
    """

    name = "GLQuotient"
    ndim = 2

    def __init__(
        self,
        n: int,
        m: int,
        metric: str = "inv",
        eps: float = 0.0,
        retraction: str = "second_order",
        *,
        steps: int = 8,
        validate: bool = True,
    ) -> None:
        super().__init__(retraction, validate)
        if metric not in gl.METRICS:
            raise ValueError(f"metric must be one of {gl.METRICS}, got {metric!r}")
        if int(n) < 1 or int(m) < 1:
            raise ValueError(f"n and m must be positive, got n={n}, m={m}")
        if eps < 0:
            raise ValueError(f"eps must be non-negative, got {eps}")
        if int(steps) < 1:
            raise ValueError(f"steps must be a positive integer, got {steps}")
        self.n, self.m = int(n), int(m)
        self.metric = metric
        self.eps = float(eps)
        self.steps = int(steps)

    def extra_repr(self) -> str:
        return (
            f"n={self.n}, m={self.m}, metric={self.metric!r}, eps={self.eps:g}, "
            f"{super().extra_repr()}"
        )

    # -- packing ---------------------------------------------------------------
    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(G, H)`` (or tangent components) of a packed tensor."""
        return t[..., : self.n, :], t[..., self.n :, :]

    unpack_tensor = split

    def pack_point(self, G: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
        """Pack ``G (…, n, h)`` and ``H (…, m, h)`` into one ``(…, n + m, h)`` tensor."""
        return self._join(G, H, torch.promote_types(G.dtype, H.dtype))

    def _join(self, G: torch.Tensor, H: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        batch = torch.broadcast_shapes(G.shape[:-2], H.shape[:-2])
        G = G.expand(*batch, *G.shape[-2:])
        H = H.expand(*batch, *H.shape[-2:])
        return torch.cat([G, H], dim=-2).to(dtype)

    # -- checks ---------------------------------------------------------------
    def _check_shape(self, shape: tuple[int], name: str) -> tuple[bool, str | None]:
        if len(shape) < 2:
            return False, f"`{name}` needs at least 2 dims (..., n + m, h), got {tuple(shape)}"
        if shape[-2] != self.n + self.m:
            return (
                False,
                f"`{name}` must have shape (..., n + m, h) = (..., {self.n + self.m}, h), "
                f"got {tuple(shape)}",
            )
        h = shape[-1]
        if h < 1:
            return False, f"`{name}` has h = {h}; a GL(h) block needs h >= 1"
        if self.eps == 0 and h > min(self.n, self.m):
            return (
                False,
                f"`{name}` has h = {h} > min(n, m) = {min(self.n, self.m)}: the factors "
                "cannot have full column rank; pass eps > 0",
            )
        return True, None

    def _assert_shapes(self, **tensors: torch.Tensor | None) -> None:
        shapes = {name: t.shape for name, t in tensors.items() if t is not None}
        for name, shape in shapes.items():
            ok, reason = self._check_shape(shape, name)
            if not ok:
                raise ShapeError(reason)
        assert_broadcastable(shapes, self.ndim)

    def _check_point_on_manifold(
        self, x: torch.Tensor, *, atol: float = 1e-5, rtol: float = 1e-5
    ) -> tuple[bool, str | None]:
        ok, reason = self._point_finite(x)
        if not ok:
            return ok, reason
        try:
            gl.grams(*self.split(x), self.eps)
        except RankDeficientError as e:
            return False, str(e)
        return True, None

    def _check_vector_on_tangent(
        self, x: torch.Tensor, u: torch.Tensor, *, atol: float = 1e-5, rtol: float = 1e-5
    ) -> tuple[bool, str | None]:
        G, H = self.split(x)
        uG, uH = self.split(u)
        gr = gl.grams(G, H, self.eps)
        res = gl.horizontal_residual(G, H, uG, uH, gr, self.metric)
        scale = gl.horizontal_residual_scale(G, H, uG, uH, gr, self.metric)
        if not bool((res.abs() <= atol + rtol * scale).all()):
            return False, (
                f"vector is not horizontal: the {self.metric} horizontal condition "
                f"has residual {res.abs().max().item():.3g} (atol={atol}, rtol={rtol})"
            )
        return True, None

    # -- geometry -------------------------------------------------------------
    def _prepare(self, x: torch.Tensor, *vectors: torch.Tensor | None):
        if self.validate:
            self._assert_shapes(x=x, **{f"u{i}": v for i, v in enumerate(vectors)})
        self._check_inputs(x, *vectors)
        G, H = self.split(x)
        return G, H, gl.grams(G, H, self.eps)

    def inner(
        self,
        x: torch.Tensor,
        u: torch.Tensor,
        v: torch.Tensor | None = None,
        *,
        keepdim: bool = False,
    ) -> torch.Tensor:
        r"""The metric ``⟨u, v⟩_x`` (Eq. 9 or 10), one value per block."""
        G, H, gr = self._prepare(x, u, v)
        uG, uH = self.split(u)
        vG, vH = (uG, uH) if v is None else self.split(v)
        out = gl.inner(G, H, uG, uH, vG, vH, gr, self.metric).to(u.dtype)
        if keepdim:
            out = out[..., None, None]
        return out

    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""Metric-orthogonal horizontal projection ``(u_G + GΛ, u_H − HΛᵀ)`` (§5.3.5)."""
        G, H, gr = self._prepare(x, u)
        pG, pH = gl.project(G, H, *self.split(u), gr, self.metric)
        return self._join(pG, pH, u.dtype)

    def egrad2rgrad(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""Horizontal Riemannian gradient of a Euclidean gradient ``u`` (§5.3.6).

        inv: ``Π(∇_G P, ∇_H Q)``; mix: ``Π(∇_G Q⁻¹, ∇_H P⁻¹)``.
        """
        G, H, gr = self._prepare(x, u)
        rG, rH = gl.egrad2rgrad(*self.split(u), gr, self.metric)
        pG, pH = gl.project(G, H, rG, rH, gr, self.metric)
        return self._join(pG, pH, u.dtype)

    def christoffel(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None
    ) -> torch.Tensor:
        r"""``Γ_x(u, v)`` (Eq. 11/12, polarised); ``Γ_x(u, u)`` if ``v`` is omitted."""
        G, H, gr = self._prepare(x, u, v)
        uG, uH = self.split(u)
        vG, vH = (None, None) if v is None else self.split(v)
        cG, cH = gl.christoffel(G, H, uG, uH, vG, vH, gr, self.metric)
        return self._join(cG, cH, u.dtype)

    def _acceleration(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        G, H = self.split(x)
        uG, uH = self.split(u)
        gr = gl.grams(G, H, self.eps)
        cG, cH = gl.christoffel(G, H, uG, uH, None, None, gr, self.metric)
        return -self._join(cG, cH, x.dtype)

    def _geodesic(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """RK4 in the ``2h``-dim span of ``[F, u_F]`` (:func:`~..geometry.gl.geodesic`).

        Equal, to rounding, to RK4 on ``(γ, γ̇)`` in the full space with :meth:`_acceleration`
        (``O(h³)`` instead of ``O(n h²)`` per stage, no host sync).
        """
        self._prepare(x, u)
        G, H = self.split(x)
        uG, uH = self.split(u)
        yG, yH = gl.geodesic(G, H, uG, uH, self.metric, self.eps, self.steps)
        return self._join(yG, yH, x.dtype)

    # -- group structure --------------------------------------------------------
    def vertical(self, x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
        r"""The vertical vector ``(GΩ, −HΩᵀ)`` for ``Ω ∈ R^{h×h}`` (§5.3.2)."""
        G, H = self.split(x)
        vG, vH = gl.vertical(G, H, omega.to(x.dtype))
        return self._join(vG, vH, x.dtype)

    def act(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        r"""Group action ``(G g⁻¹, H gᵀ)``; linear, so it also maps tangent vectors."""
        G, H = self.split(x)
        g = g.to(x.dtype)
        G_new = transpose(torch.linalg.solve(transpose(g), transpose(G)))  # G g⁻¹
        return self._join(G_new, H @ transpose(g), x.dtype)

    def invariant(self, x: torch.Tensor) -> torch.Tensor:
        """``G Hᵀ``, the only thing the network sees."""
        G, H = self.split(x)
        return G @ transpose(H)

    # -- sampling -------------------------------------------------------------
    def _random_tensor(self, shape, dtype, device) -> torch.Tensor:
        """Gaussian factors with entries ``N(0, 1/h)`` (full rank almost surely)."""
        return torch.randn(shape, dtype=dtype, device=device) / shape[-1] ** 0.5

    def _origin_tensor(self, shape, dtype, device) -> torch.Tensor:
        """``G = I_{n×h}``, ``H = I_{m×h}`` (truncated identities), broadcast to ``shape``."""
        h = shape[-1]
        eye = torch.cat(
            [torch.eye(self.n, h, dtype=dtype, device=device),
             torch.eye(self.m, h, dtype=dtype, device=device)],
            dim=0,
        )
        return eye.expand(shape).clone()
