r"""Diagonal networks ``β = u ⊙ v`` modulo the re-scaling group GL(1)^d."""

from __future__ import annotations

import torch

from ..errors import RankDeficientError, ShapeError
from ..geometry import diagonal as dm
from ..geometry.gl import METRICS
from ..geometry.linalg import compute_dtype
from .base import Generator, QuotientManifold, TangentSpace, assert_broadcastable, into

__all__ = ["DiagonalQuotient", "DiagonalTangentSpace"]


class DiagonalTangentSpace(TangentSpace):
    r"""The tangent space of [`DiagonalQuotient`][quotient_manifolds.manifolds.DiagonalQuotient]
    at $(u, v)$.

    Horizontal vectors are $(b \odot u, b \odot v)$, $b \in \mathbb R^d$; the projection and
    the weighted projection have closed forms, and samples are drawn in $b$ (so a sample needs
    $d$ normal numbers per point, not $2d$).
    """

    def __init__(self, manifold: DiagonalQuotient, x0: torch.Tensor) -> None:
        super().__init__(manifold, x0)
        self.metric = manifold.metric
        self.dtype = compute_dtype(x0.dtype)
        self.u, self.v = manifold.split(x0.to(self.dtype))

    def _split(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.manifold.split(t.to(self.dtype))

    def _join(self, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.manifold.pack_point(a, b).to(dtype)

    def inner(self, u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        r"""Eq. 6 (inv) or Eq. 7 (mix), summed over the $d$ coordinates."""
        ua, uc = self._split(u)
        va, vc = (ua, uc) if v is None else self._split(v)
        return dm.inner_terms(self.u, self.v, ua, uc, va, vc, self.metric).sum(-1).to(u.dtype)

    def horizontal_coefficient(self, u: torch.Tensor) -> torch.Tensor:
        r"""$b = \tfrac12(\eta_u/u + \eta_v/v)$."""
        return dm.horizontal_coefficient(self.u, self.v, *self._split(u)).to(u.dtype)

    def proju(self, u: torch.Tensor) -> torch.Tensor:
        r"""$(b \odot u, b \odot v)$ with $b = \tfrac12(\eta_u/u + \eta_v/v)$ (both metrics)."""
        return self._join(*dm.project(self.u, self.v, *self._split(u)), u.dtype)

    def proju_weighted(self, u: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        r"""$(b u, b v)$ with $b = (\eta_u u/w_u + \eta_v v/w_v) / (u^2/w_u + v^2/w_v)$,
        the horizontal vector closest to $\eta$ in $\sum \eta^2/w_2$."""
        ea, ec = self._split(u)
        wa, wc = self._split(w2.expand_as(u))
        b = (ea * self.u / wa + ec * self.v / wc) / (self.u**2 / wa + self.v**2 / wc)
        return self._join(b * self.u, b * self.v, u.dtype)

    def egrad2rgrad(self, g: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        r"""inv: $\Pi(u^2 \partial_u L, v^2 \partial_v L)$; mix: $\Pi(\partial_u L / v^2,
        \partial_v L / u^2)$ (into `out`, which may be `g`, if given)."""
        return into(self._join(*dm.egrad2rgrad(self.u, self.v, *self._split(g), self.metric),
                               g.dtype), out)

    def christoffel(self, u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        r"""$\Gamma_x(u, v)$ of
        `quotient_manifolds.geometry.diagonal.christoffel`."""
        ua, uc = self._split(u)
        va, vc = (ua, uc) if v is None else self._split(v)
        return self._join(*dm.christoffel(self.u, self.v, ua, uc, va, vc, self.metric), u.dtype)

    def geodesic(self, u: torch.Tensor) -> torch.Tensor:
        """The closed-form geodesic (Eq. 24 for horizontal velocities)."""
        return self._join(*dm.geodesic(self.u, self.v, *self._split(u), self.metric),
                          self.x0.dtype)

    def clip_to_domain(self, u: torch.Tensor, kind: str | None = None) -> torch.Tensor:
        r"""mix with the exact retraction: the horizontal coefficient clamped to
        $b \ge -\tfrac12 + \delta$ (the geodesic $u\sqrt{1 + 2b}$ needs $1 + 2b > 0$;
        $\delta$ = `domain_margin`), for horizontal `u`; otherwise the identity."""
        kind = self.manifold.retraction if kind is None else kind
        if self.metric != "mix" or kind != "exact":
            return u
        b = dm.horizontal_coefficient(self.u, self.v, *self._split(u))
        b = b.clamp_min(-0.5 + self.manifold.domain_margin)
        return self._join(b * self.u, b * self.v, u.dtype)

    def outside_domain(self, u: torch.Tensor, kind: str | None = None) -> torch.Tensor | None:
        r"""mix with the exact retraction: $b < -\tfrac12 + \delta$, coordinatewise (the
        coordinates `clip_to_domain` moves; one per noise coordinate of `sample`); otherwise
        `None`."""
        kind = self.manifold.retraction if kind is None else kind
        if self.metric != "mix" or kind != "exact":
            return None
        return self.horizontal_coefficient(u) < -0.5 + self.manifold.domain_margin

    @property
    def noise_shape(self) -> tuple[int, ...]:
        """`(..., d)`: one normal number per coordinate (the horizontal dimension)."""
        return tuple(self.u.shape)

    def _horizontal(self, b: torch.Tensor) -> torch.Tensor:
        return self._join(b * self.u, b * self.v, self.x0.dtype)

    def sample(self, generator: Generator = None, *, noise: torch.Tensor | None = None
               ) -> torch.Tensor:
        r"""Standard Gaussian horizontal vector: $b = z/\sqrt 2$ (inv, $\|\xi\|^2 = 2\|b\|^2$)
        or $b = z/(\sqrt 2 |uv|)$ (mix, $\|\xi\|^2 = 2\|uv \odot b\|^2$), $z \sim N(0, I_d)$."""
        z = self._noise(generator, noise).to(self.dtype)
        scale = 2**0.5 * ((self.u * self.v).abs() if self.metric == "mix" else 1.0)
        return self._horizontal(z / scale)

    def sample_weighted(self, w2: torch.Tensor, generator: Generator = None, *,
                        noise: torch.Tensor | None = None) -> torch.Tensor:
        r"""Standard Gaussian horizontal vector of $\sum \eta^2/w_2$: $b = z / \sqrt{u^2/w_u +
        v^2/w_v}$."""
        z = self._noise(generator, noise).to(self.dtype)
        wa, wc = self._split(w2.expand_as(self.x0))
        return self._horizontal(z / (self.u**2 / wa + self.v**2 / wc).sqrt())


class DiagonalQuotient(QuotientManifold):
    r"""Quotient ``(R_*^d × R_*^d) / GL(1)^d`` of diagonal networks (§5.1, Eq. 6/7).

    A point has shape ``(..., 2, d)``: row 0 is ``u``, row 1 is ``v``; the
    network sees ``β = u ⊙ v``.  The group acts by ``(α ⊙ u, α⁻¹ ⊙ v)``.

    Parameters
    ----------
    metric : {"inv", "mix"}
        inv (Eq. 6): ``Σ η_u ν_u / u² + η_v ν_v / v²``;
        mix (Eq. 7): ``Σ η_u ν_u v² + η_v ν_v u²``.
    retraction : {"first_order", "second_order", "exact"}
        ``exact`` (default) uses the closed-form geodesics: inv
        $(u e^{ξ_u/u}, v e^{ξ_v/v})$; mix a straight line in the flat
        coordinates ``(|uv|, log|u/v|)``, which for horizontal ``ξ = (bu, bv)``
        is ``(u√(1+2b), v√(1+2b))`` (Eq. 24).
    validate : bool
        Check shapes, finiteness and nonzero entries of inputs.
    domain_margin : float
        $\delta$ of the mix domain $b \ge -\tfrac12 + \delta$ used by `clip_to_domain`.

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
        self, metric: str = "inv", retraction: str = "exact", *, validate: bool = True,
        domain_margin: float = 1e-6,
    ) -> None:
        super().__init__(retraction, validate)
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
        self.metric = metric
        self.domain_margin = float(domain_margin)

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
    def _check_shape(self, shape: tuple[int, ...], name: str) -> tuple[bool, str | None]:
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

    # -- tangent spaces ----------------------------------------------------------
    def at(self, x: torch.Tensor) -> DiagonalTangentSpace:
        """The tangent space at `x` (`(…, 2, d)`, rows `u`, `v`; entries nonzero)."""
        return self._at(x)

    def _at(self, x: torch.Tensor, *vectors: torch.Tensor | None) -> DiagonalTangentSpace:
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
        return DiagonalTangentSpace(self, x)

    def horizontal_coefficient(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""$b = \tfrac12(\eta_u/u + \eta_v/v)$: the horizontal part of `u`, `(..., d)`."""
        return self._at(x, u).horizontal_coefficient(u)

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
