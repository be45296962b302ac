r"""The elementwise "adaptive" geometry used for every weight outside a GL block."""

from __future__ import annotations

from functools import cached_property

import torch

from ..errors import ShapeError, ZeroWeightError
from ..geometry import adaptive as am
from ..geometry.linalg import compute_dtype
from .base import QuotientManifold, TangentSpace, into

__all__ = ["AdaptiveEuclidean", "AdaptiveTangentSpace"]

_CHUNK = 1 << 16
"""Entries per chunk of the flat-vector operations (256 KiB of float32: stays in cache)."""


def _chunks(n: int) -> range:
    return range(0, n, _CHUNK)


class AdaptiveTangentSpace(TangentSpace):
    r"""The tangent space of [`AdaptiveEuclidean`][quotient_manifolds.manifolds.AdaptiveEuclidean]
    at $w$: the metric $\sum \xi\zeta/c^2$ with $c^2 = w^2 + \varepsilon$ (cached), no
    vertical space.

    Computations run in the working dtype (float32, or float64 for float64 points).

    Entries with $c^2 = 0$ (zero weights with $\varepsilon = 0$, possible only through a
    manifold with `validate=False`; a validating manifold raises `ZeroWeightError`) are frozen:
    the metric is infinite there, so every gradient, sample and step is 0 on them, and `inner`
    ignores them (their components are 0 in every vector this space produces).
    """

    def __init__(self, manifold: AdaptiveEuclidean, x0: torch.Tensor) -> None:
        super().__init__(manifold, x0)
        self.eps, self.ndim = manifold.eps, manifold.ndim
        self.dtype = compute_dtype(x0.dtype)
        self.w = x0.to(self.dtype)

    # The metric weights are made on first use, not here: a space whose operations never run
    # (the full packing of a call whose iterations run on active rows) holds only `w`.
    @cached_property
    def c2(self) -> torch.Tensor:
        r"""$c^2 = w^2 + \varepsilon$, the inverse metric coefficient of every weight."""
        return am.scale2(self.w, self.eps)

    @cached_property
    def frozen(self) -> bool:
        """Whether some entry has $c^2 = 0$ (frozen)."""
        if "c2" in self.__dict__ or not self._flat:
            return not bool((self.c2 > 0).all()) if self.c2.numel() else False
        buf = self._chunk_buffers()[0]
        return any(not bool((self._c2_chunk(s, buf) > 0).all()) for s in _chunks(self.w.numel()))

    @property
    def _flat(self) -> bool:
        """A 1-D point: the hot-path operations run chunk by chunk, from `w`."""
        return self.ndim == 1 and self.w.dim() == 1

    def _chunk_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = min(_CHUNK, self.w.numel())
        return (torch.empty(n, dtype=self.dtype, device=self.w.device),
                torch.empty(n, dtype=self.dtype, device=self.w.device))

    def _c2_chunk(self, s: int, buf: torch.Tensor) -> torch.Tensor:
        r"""$c^2$ of the entries `s : s + _CHUNK`, from `c2` when it is stored, else computed
        into `buf` (the same values: $w \cdot w + \varepsilon$)."""
        e = min(s + _CHUNK, self.w.numel())
        if "c2" in self.__dict__:
            return self.c2[s:e]
        out = torch.mul(self.w[s:e], self.w[s:e], out=buf[: e - s])
        return out.add_(self.eps) if self.eps else out

    def _inv_c2_chunk(self, s: int, buf: torch.Tensor) -> torch.Tensor:
        """$1/c^2$ of the entries `s : s + _CHUNK` (0 where frozen), as `inv_c2`."""
        if "inv_c2" in self.__dict__:
            return self.inv_c2[s : s + _CHUNK]
        c2 = self._c2_chunk(s, buf)
        out = torch.reciprocal(c2, out=buf[: c2.numel()])
        # c² = 0 (frozen) gives +inf, a NaN weight NaN: both are 0 in `inv_c2`
        return out.nan_to_num_(nan=0.0, posinf=0.0) if self.frozen else out

    @property
    def live(self) -> torch.Tensor:
        """`c² > 0`, per entry (made when asked for; stored only for a frozen space)."""
        return self._live if self.frozen else self.c2 > 0

    @cached_property
    def _live(self) -> torch.Tensor:
        return self.c2 > 0

    @cached_property
    def inv_c2(self) -> torch.Tensor:
        r"""$1 / c^2$, 0 on the frozen entries."""
        inv = self.c2.reciprocal()
        if self.frozen:
            inv.masked_fill_(~self._live, 0.0)
        return inv

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.ndim > 0:
            t = t.sum(dim=tuple(range(-self.ndim, 0)))
            x_shape = self.x0.shape[: self.x0.dim() - self.ndim]
        else:
            x_shape = self.x0.shape
        return t.expand(torch.broadcast_shapes(x_shape, t.shape))

    def inner(self, u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        r"""$\sum u v / (w^2 + \varepsilon)$ over the trailing `ndim` dimensions."""
        v = u if v is None else v
        if (self.ndim == 1 and self.x0.dim() == 1 and u.shape == v.shape == self.x0.shape
                and u.dtype == v.dtype == self.dtype
                and not (torch.is_grad_enabled() and (u.requires_grad or v.requires_grad))):
            # one vector: Σ (u ⊙ c⁻²) v chunk by chunk, c⁻² made from w per chunk (no
            # vector-sized temporary or stored weight: a fresh one costs page faults, a kept
            # one the memory of a vector)
            b1, b2 = self._chunk_buffers()
            total = u.new_zeros(())
            for s in _chunks(u.numel()):
                inv = self._inv_c2_chunk(s, b1)
                e = s + inv.numel()
                total += torch.dot(torch.mul(u[s:e], inv, out=b2[: e - s]), v[s:e])
            return total
        u_, v_ = u.to(self.dtype), v.to(self.dtype)
        return self._reduce(u_ * v_ * self.inv_c2).to(u.dtype)

    def proju(self, u: torch.Tensor) -> torch.Tensor:
        """Identity (no vertical space), broadcast to the shape of the point."""
        return u.expand(torch.broadcast_shapes(self.x0.shape, u.shape))

    def proju_weighted(self, u: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """Identity: every vector is horizontal, whatever the norm."""
        return self.proju(u)

    def egrad2rgrad(self, g: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        r"""$(w^2 + \varepsilon) \odot \nabla L$ (into `out`, which may be `g`, if given)."""
        if out is not None and g.dtype == self.dtype:
            if self._flat and g.shape == out.shape == self.w.shape:
                buf = self._chunk_buffers()[0]
                for s in _chunks(g.numel()):
                    c2 = self._c2_chunk(s, buf)
                    e = s + c2.numel()
                    torch.mul(g[s:e], c2, out=out[s:e])
                return out
            return torch.mul(g, self.c2, out=out)
        return into((self.c2 * g.to(self.dtype)).to(g.dtype), out)

    def egrad2rgrad_and_norm2(self, g: torch.Tensor, *, out: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""$r = (w^2 + \varepsilon) \odot \nabla L$ (into `out`, which may be `g`, if given)
        and $\|r\|^2_w$ from the metric, one value per block (`g` may be overwritten
        before the pairing)."""
        r = self.egrad2rgrad(g, out=out)
        return r, self.inner(r)

    def _frozen_zero(self, t: torch.Tensor, where_frozen: torch.Tensor | float) -> torch.Tensor:
        return torch.where(self.live, t, where_frozen) if self.frozen else t

    def christoffel(self, u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        r"""$\Gamma_w(u, v) = -w u v / (w^2 + \varepsilon)$."""
        u_ = u.to(self.dtype)
        v_ = u_ if v is None else v.to(self.dtype)
        return self._frozen_zero(am.christoffel(self.w, u_, v_, self.eps), 0.0).to(u.dtype)

    def geodesic(self, u: torch.Tensor) -> torch.Tensor:
        r"""$w e^{\xi/w}$ ($\varepsilon = 0$), else the flat-coordinate form."""
        return self._frozen_zero(am.geodesic(self.w, u.to(self.dtype), self.eps),
                                 self.w).to(self.x0.dtype)

    def metric_sqrt_inv(self, z: torch.Tensor) -> torch.Tensor:
        r"""$z \odot \sqrt{w^2 + \varepsilon}$."""
        return z * self.c2.sqrt().to(z.dtype)


class AdaptiveEuclidean(QuotientManifold):
    r"""``R_*^N`` with the metric ``⟨ξ, ζ⟩_w = Σ ξ ζ / (w² + ε)``.

    This is the geometry behind adaptive sharpness (App. F; App. C.1): its norm
    is ``‖ξ ⊘ |w|‖₂`` and its Riemannian gradient ``w² ⊙ ∇L``.  Each weight is
    an independent one-dimensional manifold, so there is no vertical space:
    [`proju`][quotient_manifolds.manifolds.adaptive.AdaptiveEuclidean.proju] is the identity.
    [`act`][quotient_manifolds.manifolds.adaptive.AdaptiveEuclidean.act] is the elementwise scaling
    ``w ↦ α ⊙ w``, an isometry of the metric (not a symmetry of a network).

    Parameters
    ----------
    eps : float
        ``ε`` in ``w² + ε``; guards zero weights.  With ``ε = 0`` a zero
        weight raises [`ZeroWeightError`][quotient_manifolds.errors.ZeroWeightError].
    retraction : {"first_order", "second_order", "exact"}
        ``w + ξ`` (adaptive sharpness), ``w + ξ + ½ w ξ²/(w² + ε)`` or the
        geodesic $w e^{ξ/w}$ (``√ε sinh(asinh(w/√ε) + ξ/√(w² + ε))`` for ε > 0).
    ndim : int
        Trailing dimensions reduced by
        [`inner`][quotient_manifolds.manifolds.adaptive.AdaptiveEuclidean.inner], as in
        ``geoopt.Euclidean``.
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

    def _check_shape(self, shape: tuple[int, ...], name: str) -> tuple[bool, str | None]:
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

    # -- tangent spaces ----------------------------------------------------------
    def at(self, x: torch.Tensor) -> AdaptiveTangentSpace:
        """The tangent space at `x` (zero weights with `eps = 0` raise ZeroWeightError)."""
        return self._at(x)

    def _at(self, x: torch.Tensor, *vectors: torch.Tensor | None) -> AdaptiveTangentSpace:
        if self.validate:
            if len(x.shape) < self.ndim:
                raise ShapeError(self._check_shape(x.shape, "x")[1])
            self._check_inputs(x, *vectors)
            ok, reason = self._zero_free(x)
            if not ok:
                raise ZeroWeightError(reason)
        return AdaptiveTangentSpace(self, x)

    def inner(
        self,
        x: torch.Tensor,
        u: torch.Tensor,
        v: torch.Tensor | None = None,
        *,
        keepdim: bool = False,
    ) -> torch.Tensor:
        r"""$\sum u v / (w^2 + \varepsilon)$ over the trailing `ndim` dimensions."""
        return super().inner(x, u, v, keepdim=keepdim)

    def component_inner(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elementwise metric terms (so RiemannianAdam adapts per weight, like Adam)."""
        ts = self._at(x, u, v)
        u_ = u.to(ts.dtype)
        v_ = u_ if v is None else v.to(ts.dtype)
        out = u_ * v_ / ts.c2
        return out.expand(torch.broadcast_shapes(x.shape, out.shape)).to(u.dtype)

    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Identity (no vertical space), broadcast to the shape of ``x``."""
        return u.expand(torch.broadcast_shapes(x.shape, u.shape))

    def egrad2rgrad(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""$(w^2 + \varepsilon) \odot \nabla L$ (defined at zero weights too)."""
        if self.validate:
            self._check_inputs(x, u)
        return AdaptiveTangentSpace(self, x).egrad2rgrad(u)

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
