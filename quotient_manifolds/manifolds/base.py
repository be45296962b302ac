r"""Shared machinery of the quotient manifolds: frozen tangent spaces, the retraction table,
checks and transport.

Every manifold implements its geometry once, in a
[`TangentSpace`][quotient_manifolds.manifolds.base.TangentSpace] built by `M.at(x0)` for one
base point. The manifold's geoopt methods (`inner`, `proju`,
`egrad2rgrad`, `retr`, `expmap`, …) build `self.at(x)` and call it, so geoopt optimizers and the
sharpness engine run the same code.
"""

from __future__ import annotations

from collections.abc import Sequence

import geoopt
import torch
from geoopt.utils import size2shape

from ..errors import NonFiniteError, ShapeError
from ..geometry.gl import check_finite

__all__ = ["RETRACTIONS", "QuotientManifold", "TangentSpace", "assert_broadcastable",
           "check_retraction", "into", "standard_normal"]

RETRACTIONS = ("first_order", "second_order", "exact")
r"""The retractions of every manifold, by name:

* `"first_order"`: $x + u$;
* `"second_order"`: $x + u - \tfrac12 \Gamma_x(u, u)$, the truncated geodesic of Eq. 5;
* `"exact"`: the geodesic $\gamma_u(1)$ (closed form or RK4, per manifold).
"""

Generator = torch.Generator | Sequence[torch.Generator] | None


def check_retraction(kind: str) -> str:
    """`kind` if it names a retraction of
    [`RETRACTIONS`][quotient_manifolds.manifolds.base.RETRACTIONS], else ValueError."""
    if kind not in RETRACTIONS:
        raise ValueError(f"retraction must be one of {RETRACTIONS}, got {kind!r}")
    return kind


def standard_normal(shape: Sequence[int], generator: Generator, dtype: torch.dtype,
                    device: torch.device | str | None) -> torch.Tensor:
    """Standard normal entries, drawn on the CPU and moved to `device`.

    Drawing on the generator's device (the CPU by default) gives the same samples whatever
    device the model is on. `generator` may be a sequence of generators, one per entry of the
    first dimension (one per independent problem), so a problem's draws do not depend on the
    other problems drawn with it.
    """
    shape = tuple(shape)
    if generator is None or isinstance(generator, torch.Generator):
        z = torch.randn(shape, generator=generator, dtype=dtype)
    else:
        gens = list(generator)
        if not shape or len(gens) != shape[0]:
            raise ShapeError(f"got {len(gens)} generators for samples of shape {shape}; pass one "
                             "generator per entry of the first dimension")
        z = torch.stack([torch.randn(shape[1:], generator=g, dtype=dtype) for g in gens])
    return z.to(device)


def into(t: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`t`, or `t` written into `out` (and `out` returned) if `out` is given.

    The `out=` keyword of the tangent spaces' methods: `out` may alias an input of the
    computation that produced `t`, which is complete before the copy.
    """
    if out is None or out is t:
        return t
    return out.copy_(t)


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


class TangentSpace:
    r"""The horizontal tangent space of a quotient manifold at one base point $x_0$.

    Made by `manifold.at(x0)`. It caches what the operations at $x_0$ share (Gram matrices,
    Cholesky factors, the Sylvester eigenbasis) and is what both the manifold's geoopt methods
    and the sharpness engine call. Tangent vectors have the shape of `x0` (or broadcast
    against it); the leading dimensions are a batch of independent blocks, and reductions
    (`inner`, `norm`) return one value per block.

    Attributes
    ----------
    manifold : QuotientManifold
        The manifold.
    x0 : Tensor
        The base point.
    """

    def __init__(self, manifold: QuotientManifold, x0: torch.Tensor) -> None:
        self.manifold = manifold
        self.x0 = x0

    # -- the metric -------------------------------------------------------------
    def inner(self, u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        r"""The metric $\langle u, v\rangle_{x_0}$ ($v = u$ if omitted), one value per block."""
        raise NotImplementedError

    def norm(self, u: torch.Tensor) -> torch.Tensor:
        r"""$\|u\|_{x_0} = \sqrt{\langle u, u\rangle_{x_0}}$, one value per block."""
        return self.inner(u).clamp_min(0).sqrt()

    # -- projections and gradients ----------------------------------------------
    def proju(self, u: torch.Tensor) -> torch.Tensor:
        r"""The metric-orthogonal projection $\Pi$ onto the horizontal space."""
        raise NotImplementedError

    def proju_weighted(self, u: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        r"""The projection onto the horizontal space that is orthogonal in the diagonal norm
        $\sum u^2 / w_2$ (the norm of the adaptive-norm ball, App. G (a)).

        `w2` has the shape of `x0` and positive entries.
        """
        raise NotImplementedError

    def egrad2rgrad(self, g: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The horizontal Riemannian gradient of a Euclidean gradient `g` (written into `out`,
        which may be `g`, if given)."""
        raise NotImplementedError

    def egrad2rgrad_and_norm2(self, g: torch.Tensor, *, out: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The Riemannian gradient $r$ of `g` (into `out`, which may be `g`, if given) and the
        terms of its squared norm $\|r\|^2_{x_0}$.

        The terms are a tensor with the leading dimensions of `x0` whose sum over its other
        dimensions is the squared norm of each problem. By default they are the entries of
        $\nabla L \odot r$ (`g * r`): for $r = \Pi(\mathcal G^{-1} \nabla L)$, with
        $\mathcal G$ the metric at $x_0$ and $\Pi$ its orthogonal projection onto the
        horizontal space, $\|r\|^2_{x_0} = \langle \mathcal G^{-1}\nabla L, r\rangle_{x_0} =
        \langle \nabla L, r\rangle_E$, which needs no metric product. A space whose
        `egrad2rgrad` writes over `g` before that pairing (`out` is `g`) answers with the
        metric instead.

        Returns
        -------
        r : Tensor
            The Riemannian gradient (`out` if given).
        norm2 : Tensor
            The terms of $\|r\|^2_{x_0}$.
        """
        r = self.egrad2rgrad(g)
        terms = g * r
        return into(r, out), terms

    # -- curvature and retractions ----------------------------------------------
    def christoffel(self, u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        r"""The Christoffel form $\Gamma_{x_0}(u, v)$; the quadratic form $\Gamma_{x_0}(u, u)$
        if `v` is omitted."""
        raise NotImplementedError

    def geodesic(self, u: torch.Tensor) -> torch.Tensor:
        r"""The geodesic $\gamma_u(1)$ from $x_0$."""
        raise NotImplementedError

    def retract(self, u: torch.Tensor, kind: str | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        r"""The point reached from $x_0$ along `u` by the retraction `kind`.

        `kind` is one of [`RETRACTIONS`][quotient_manifolds.manifolds.base.RETRACTIONS]; `None`
        uses the manifold's `retraction`. Differentiable in `u`, unless `out` is given: then
        the point is written into `out` (a tensor of the point's shape, which the caller may
        reuse from call to call; the first order $x_0 + u$ then allocates nothing), and `u`
        must not require a gradient.
        """
        kind = self.manifold.retraction if kind is None else kind
        if kind == "first_order":
            return self.x0 + u if out is None else torch.add(self.x0, u, out=out)
        if kind == "second_order":
            if out is None:
                return self.x0 + u - 0.5 * self.christoffel(u)
            return torch.sub(self.x0 + u, 0.5 * self.christoffel(u), out=out)
        if kind == "exact":
            return into(self.geodesic(u), out)
        check_retraction(kind)  # raises ValueError: kind is none of RETRACTIONS
        raise AssertionError(f"retraction {kind!r} is in RETRACTIONS but not handled")

    def clip_to_domain(self, u: torch.Tensor, kind: str | None = None) -> torch.Tensor:
        """`u` moved into the domain of the retraction `kind` (`None`: the manifold's); the
        identity unless the exact geodesic has a domain (the mix metric of diagonal nets)."""
        return u

    def outside_domain(self, u: torch.Tensor, kind: str | None = None) -> torch.Tensor | None:
        """Where the horizontal vector `u` leaves the domain of the retraction `kind`: a boolean
        tensor of shape `noise_shape`, true at the noise coordinates of `sample` whose part of
        `u` lies outside it; `None` when the retraction has no domain (every space but the mix
        metric of diagonal nets). A truncated Gaussian redraws the true coordinates."""
        return None

    # -- sampling -----------------------------------------------------------------
    def metric_sqrt_inv(self, z: torch.Tensor) -> torch.Tensor:
        r"""A square root $S$ of the inverse metric applied to `z`: if $z \sim N(0, I)$ then
        $S z \sim N(0, g^{-1})$ (before the horizontal projection)."""
        raise NotImplementedError

    @property
    def noise_shape(self) -> tuple[int, ...]:
        """Shape of the standard normal noise that `sample` maps to a tangent vector."""
        return tuple(self.x0.shape)

    def _noise(self, generator: Generator, noise: torch.Tensor | None) -> torch.Tensor:
        if noise is not None:
            return noise.to(self.x0.dtype)
        return standard_normal(self.noise_shape, generator, self.x0.dtype, self.x0.device)

    def sample(self, generator: Generator = None, *, noise: torch.Tensor | None = None
               ) -> torch.Tensor:
        r"""A standard Gaussian horizontal vector: covariance the inverse metric restricted to the
        horizontal space (unit radius), $\Pi(S z)$ with $z \sim N(0, I)$.

        `noise` (shape `noise_shape`) replaces the draw of $z$ from `generator`.
        """
        return self.proju(self.metric_sqrt_inv(self._noise(generator, noise)))

    def sample_weighted(self, w2: torch.Tensor, generator: Generator = None, *,
                        noise: torch.Tensor | None = None) -> torch.Tensor:
        r"""A standard Gaussian horizontal vector of the diagonal norm $\sum u^2/w_2$."""
        return self.proju_weighted(self._noise(generator, noise) * w2.sqrt(), w2)


class QuotientManifold(geoopt.manifolds.Manifold):
    r"""Base class: a metric with Christoffel form $\Gamma$ and a choice of retraction.

    Subclasses implement `at`, which
    returns the [`TangentSpace`][quotient_manifolds.manifolds.base.TangentSpace] of a base point;
    this class turns it into geoopt's `inner`, `proju`, `egrad2rgrad`, `retr` (chosen by
    `retraction`), `expmap` (always exact), `transp` (projection onto the horizontal space at
    the target point) and `retr_transp`.

    Retractions ([`RETRACTIONS`][quotient_manifolds.manifolds.base.RETRACTIONS]):

    * `"first_order"`: $x + u$;
    * `"second_order"`: $x + u - \tfrac12 \Gamma_x(u, u)$, the truncated geodesic of Eq. 5;
    * `"exact"`: the geodesic $\gamma_u(1)$.
    """

    __scaling__ = geoopt.manifolds.Manifold.__scaling__.copy()
    reversible = False

    def __init__(self, retraction: str, validate: bool = True) -> None:
        super().__init__()
        self.retraction = check_retraction(retraction)
        self.validate = validate

    # -- tangent spaces -----------------------------------------------------------
    def at(self, x: torch.Tensor) -> TangentSpace:
        """The frozen tangent space at `x` (validated when `validate`)."""
        raise NotImplementedError

    def _at(self, x: torch.Tensor, *vectors: torch.Tensor | None) -> TangentSpace:
        """``at(x)`` after checking the vectors (shapes, finiteness) when `validate`."""
        raise NotImplementedError

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

    # -- geometry, through the tangent space --------------------------------------
    def inner(
        self,
        x: torch.Tensor,
        u: torch.Tensor,
        v: torch.Tensor | None = None,
        *,
        keepdim: bool = False,
    ) -> torch.Tensor:
        r"""The metric $\langle u, v\rangle_x$, one value per block."""
        out = self._at(x, u, v).inner(u, v)
        return out[(...,) + (None,) * self.ndim] if keepdim else out

    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""The metric-orthogonal horizontal projection $\Pi_x(u)$."""
        return self._at(x, u).proju(u)

    def egrad2rgrad(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The horizontal Riemannian gradient of a Euclidean gradient `u`."""
        return self._at(x, u).egrad2rgrad(u)

    def christoffel(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None
    ) -> torch.Tensor:
        r"""Christoffel form $\Gamma_x(u, v)$; $\Gamma_x(u, u)$ when `v` is omitted."""
        return self._at(x, u, v).christoffel(u, v)

    def retr(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The retraction selected by `retraction` (optimizers call this)."""
        return self._at(x, u).retract(u, self.retraction)

    def retr_second_order(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""$x + u - \tfrac12 \Gamma_x(u, u)$ (Eq. 5), $\Gamma$ evaluated at the base point."""
        return self._at(x, u).retract(u, "second_order")

    def expmap(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r"""The exact geodesic $\gamma_u(1)$, whatever `retraction` says."""
        return self._at(x, u).retract(u, "exact")

    def transp(self, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Vector transport by horizontal projection at `y` (not an isometry)."""
        return self.proju(y, v)

    def retr_transp(
        self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.retr(x, u)
        return y, self.proju(y, v)

    def projx(self, x: torch.Tensor) -> torch.Tensor:
        """Identity: a point is never moved along its orbit."""
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
        self, *size: int | tuple[int], dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> geoopt.ManifoldTensor:
        """A random point of shape ``size`` (see ``_random_tensor`` of each manifold)."""
        shape = size2shape(*size)
        self._assert_check_shape(shape, "x")
        return geoopt.ManifoldTensor(self._random_tensor(shape, dtype, device), manifold=self)

    def origin(
        self,
        *size: int | tuple[int],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        seed: int | None = 42,
    ) -> geoopt.ManifoldTensor:
        """A deterministic point of shape ``size`` (see ``_origin_tensor``); ``seed`` is unused."""
        shape = size2shape(*size)
        self._assert_check_shape(shape, "x")
        return geoopt.ManifoldTensor(self._origin_tensor(shape, dtype, device), manifold=self)
