r"""Feasible sets of the inner maximisation: the perturbation balls of every sharpness measure.

Each set lives in one product tangent space
([`ProductTangentSpace`][quotient_manifolds.manifolds.product.ProductTangentSpace]) on flat packed
vectors of shape `(*problems, D)`, with one radius $\rho$ for every problem:

| set | constraint | projection | ascent direction |
|---|---|---|---|
| [`MetricBall`][quotient_manifolds.sharpness.feasible.MetricBall] | $\xi \in \mathcal H$, $\|\xi\|_w \le \rho$ (App. C) | $\Pi$, then radial | $\Pi(g^{-1}\nabla)/\|\cdot\|_w$ |
| [`AdaptiveNormBall`][quotient_manifolds.sharpness.feasible.AdaptiveNormBall] | $\xi \in \mathcal H$, $\|\xi \oslash c\|_2 \le \rho$ (App. G (a)) | $\Pi^{c}$, then radial | $\Pi^{c}(c^2 \odot \nabla)/\|\cdot \oslash c\|_2$ |
| [`Ellipsoid`][quotient_manifolds.sharpness.feasible.Ellipsoid] | $\|\delta \oslash c\|_2 \le \rho$ (Eq. 1) | Euclidean, by bisection | $c \odot \nabla / \|\nabla\|_2$ |
| [`Box`][quotient_manifolds.sharpness.feasible.Box] | $\|\delta \oslash c\|_\infty \le \rho$ | clipping | $c \odot \operatorname{sign}\nabla$ |

Here $c^2 = w^2 + \varepsilon$, $\Pi$ is the metric-orthogonal horizontal projection and
$\Pi^{c}$ the horizontal projection orthogonal in $\|\cdot \oslash c\|_2$
([`proju_weighted`][quotient_manifolds.manifolds.base.TangentSpace.proju_weighted]). The metric
and adaptive-norm balls are the intersection of the horizontal subspace with a ball of the same
inner product, so "project orthogonally onto the subspace, then shrink radially" is their exact
projection. The ellipsoid and the box are the reference adaptive-sharpness algorithm of
Andriushchenko et al. (2023); they have no horizontal constraint and are used without GL blocks.

Every set offers `project`, `direction` (the normalised steepest-ascent direction of the set's
norm), `rgrad` (the unnormalised one: the gradient in `inner`), `proju`, `inner`, `norm`, `norms`,
`sample` (the Gaussian of the average case, at radius $\rho$; truncated to the domain of the
space's retractions where they have one, the exact mix geodesic of diagonal nets) and
`random_start` (a random start of Auto-PGD, at radius $\rho/2$). `mask` (0/1, shaped like a
tangent vector) freezes entries at 0. A sequence of generators, one per problem, gives every
problem its own random stream.
"""  # noqa: E501

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from ..manifolds.base import Generator, TangentSpace, standard_normal
from ..manifolds.product import ProductTangentSpace

__all__ = ["BALLS", "FeasibleSet", "MetricBall", "AdaptiveNormBall", "Ellipsoid", "Box",
           "make_feasible"]

BALLS = ("metric", "adaptive", "ellipsoid", "box")
"""The feasible sets of `make_feasible`, by name."""


_Set = TypeVar("_Set", bound="FeasibleSet")


def _scalar(t: torch.Tensor) -> bool:
    return t.dim() == 0


class FeasibleSet:
    r"""Base class: a set of tangent vectors in one product tangent space, of radius `rho`.

    Parameters
    ----------
    space : ProductTangentSpace
        The tangent space (base point, metric, horizontal projection, retractions).
    rho : float
        The radius.
    mask : Tensor, optional
        0/1 entries shaped like a tangent vector; the entries at 0 never move.
    """

    name = "set"

    def __init__(self, space: ProductTangentSpace, rho: float,
                 mask: torch.Tensor | None = None) -> None:
        self.space = space
        self.rho = float(rho)
        self.mask = None if mask is None else mask.to(space.dtype)

    @property
    def problems(self) -> tuple[int, ...]:
        return self.space.problems

    def zeros(self) -> torch.Tensor:
        """The centre of the set, `(*problems, D)`."""
        return self.space.zeros()

    def _masked(self, u: torch.Tensor) -> torch.Tensor:
        return u if self.mask is None else u * self.mask

    def _scale(self, u: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """`u * s` with one factor `s` per problem."""
        return u * s if _scalar(s) else u * s.unsqueeze(-1)

    def _normalise(self, u: torch.Tensor, n: torch.Tensor, inplace: bool = False
                   ) -> torch.Tensor:
        """`u / n` per problem, 0 where `n = 0` (in `u`'s memory if `inplace`)."""
        if _scalar(n):
            v = float(n)
            if inplace:
                return u.mul_(1.0 / v) if v > 0 else u.zero_()
            return u / v if v > 0 else torch.zeros_like(u)
        s = torch.where(n > 0, 1.0 / torch.where(n > 0, n, 1.0), 0.0)
        return u.mul_(s.unsqueeze(-1)) if inplace else self._scale(u, s)

    def _radial(self, u: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        r"""$u \min(1, \rho/\|u\|)$ per problem (no copy when nothing moves; in `u`'s memory
        if `inplace`)."""
        n = self.norm(u)
        if _scalar(n):
            v = float(n)
            if v <= self.rho or v == 0.0:
                return u
            return u.mul_(self.rho / v) if inplace else u * (self.rho / v)
        tiny = torch.finfo(n.dtype).tiny
        s = torch.clamp(self.rho / n.clamp_min(tiny), max=1.0)
        return u.mul_(s.unsqueeze(-1)) if inplace else self._scale(u, s)

    # -- the interface ----------------------------------------------------------
    def inner(self, u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        """The inner product in which `rgrad` is the gradient, one value per problem."""
        raise NotImplementedError

    def norm(self, xi: torch.Tensor) -> torch.Tensor:
        """The set's norm of `xi` (the set is `norm(xi) <= rho`), one value per problem."""
        raise NotImplementedError

    def horizontal_distance(self, xi: torch.Tensor) -> torch.Tensor:
        """`norm(proju(xi) - xi)`: how far `xi` is from the horizontal space, per problem."""
        moved = self.proju(xi)  # minus ξ, in place where it is a vector of its own
        own = moved.untyped_storage().data_ptr() != xi.untyped_storage().data_ptr()
        return self.norm(moved.sub_(xi) if own else moved - xi)

    def norms(self, xi: torch.Tensor) -> dict[str, torch.Tensor]:
        """The set's norm of `xi` split into its parts (`"total"` and, where the norm is a sum
        of squares, one entry per part label, e.g. `"blocks"`, `"adaptive"`)."""
        return {"total": self.norm(xi)}

    def proju(self, u: torch.Tensor) -> torch.Tensor:
        """The projection onto the linear span of the set (the horizontal space)."""
        return self._masked(u)

    def rgrad(self, egrad: torch.Tensor) -> torch.Tensor:
        """The ascent direction field before normalisation (the gradient in `inner`)."""
        raise NotImplementedError

    def direction(self, xi: torch.Tensor, egrad: torch.Tensor, *,
                  inplace: bool = False) -> torch.Tensor:
        """The normalised steepest-ascent direction of the set's norm (0 where `egrad` is 0).

        `inplace=True` allows the result to be written into `egrad`'s memory.
        """
        r = self.rgrad(egrad)
        return self._normalise(r, self.norm(r))

    def project(self, xi: torch.Tensor) -> torch.Tensor:
        """The projection $P_S$ onto the set."""
        raise NotImplementedError

    def _axpy(self, xi: torch.Tensor, d: torch.Tensor, eta: torch.Tensor | float,
              inplace: bool = False) -> torch.Tensor:
        r"""$\xi + \eta d$ with one $\eta$ per problem (in `d`'s memory if `inplace`)."""
        if not torch.is_tensor(eta) or _scalar(eta):
            if inplace:
                return d.mul_(float(eta)).add_(xi)
            return torch.add(xi, d, alpha=float(eta))
        if inplace:
            return d.mul_(eta.unsqueeze(-1)).add_(xi)
        return torch.addcmul(xi, d, eta.unsqueeze(-1))

    def step(self, xi: torch.Tensor, d: torch.Tensor, eta: torch.Tensor | float, *,
             inplace: bool = False) -> torch.Tensor:
        r"""$P_S(\xi + \eta d)$ for a feasible `xi` and a direction `d` of `direction`
        (`inplace=True` allows the result to be written into `d`'s memory)."""
        return self.project(self._axpy(xi, d, eta, inplace))

    def sample(self, generator: Generator = None) -> torch.Tensor:
        """A random perturbation of the average case, at radius `rho`, inside the domain of the
        space's retractions."""
        raise NotImplementedError

    def _start_draw(self, generator: Generator) -> torch.Tensor:
        """The random vector that `random_start` shrinks (`sample`, unless a set says otherwise)."""
        return self.sample(generator)

    def random_start(self, generator: Generator = None) -> torch.Tensor:
        r"""A random start of Auto-PGD: a draw of the average case's distribution, shrunk radially
        to half the radius, $\xi \rho / (2 \|\xi\|)$ per problem.

        The draw is not truncated to the domain of the retraction:
        [`apgd`][quotient_manifolds.sharpness.apgd.apgd] projects its start onto the set.
        """
        z = self._start_draw(generator)
        n = self.norm(z)
        return self._scale(z, 0.5 * self.rho / n.clamp_min(torch.finfo(z.dtype).tiny))

    def restrict(self: _Set, space: ProductTangentSpace,
                 take: Callable[[torch.Tensor], torch.Tensor]) -> _Set:
        """The same set on the entries that `take` keeps, the other entries fixed at 0.

        `space` is the tangent space of the kept entries and `take` maps a vector of this
        set's packing to them; every per-entry attribute (`mask`, the weights) goes through
        `take`. Meant for dropping adaptive entries only: every operation of the four sets acts
        on those entry by entry, so on vectors that are 0 on the dropped entries the
        restricted set gives the same norms, directions and projections (up to the order of
        summation).
        """
        new = copy.copy(self)
        new.space = space
        new.mask = None if self.mask is None else take(self.mask)
        return new


def _redraw(z: torch.Tensor, generator: Generator, bad: torch.Tensor) -> torch.Tensor:
    """Fresh standard normals shaped like `z`: all of them from one generator; from one
    generator per problem, only the problems (entries of the first dimension) with a `bad`
    coordinate draw, the others are 0."""
    if generator is None or isinstance(generator, torch.Generator):
        return standard_normal(z.shape, generator, z.dtype, z.device)
    out = torch.zeros_like(z)
    rows = bad.reshape(bad.shape[0], -1).any(-1)
    for i, g in enumerate(generator):
        if bool(rows[i]):
            out[i] = torch.randn(z.shape[1:], generator=g, dtype=z.dtype).to(z.device)
    return out


class _HorizontalBall(FeasibleSet):
    """A ball of an inner product, intersected with the horizontal space (exact projection:
    orthogonal projection onto the subspace, then radial shrink)."""

    redraws = 50
    """The most redraws of the truncated Gaussian (`sample`) before the rest is clipped."""

    def _proj(self, u: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _from_noise(self, noise: Sequence[torch.Tensor]) -> torch.Tensor:
        r"""The sample of the standard normal `noise` (one tensor per factor of the space, of its
        `noise_shape`): $\rho$ times the set's standard Gaussian on the horizontal space."""
        raise NotImplementedError

    def _gaussian(self, generator: Generator) -> torch.Tensor:
        r"""$\rho$ times the set's standard Gaussian, not truncated."""
        raise NotImplementedError

    def _start_draw(self, generator: Generator) -> torch.Tensor:
        return self._gaussian(generator)

    def sample(self, generator: Generator = None) -> torch.Tensor:
        r"""$\rho$ times the set's standard Gaussian on the horizontal space, truncated to the
        domain of the space's retractions.

        Where a factor's retraction has a domain (the exact mix geodesic $\beta(1 + 2b)$ of
        diagonal nets needs $b \ge -\tfrac12 + \delta$), the noise coordinates whose part of the
        sample leaves it are redrawn, at most `redraws` times, and what is still outside is
        clipped (`clip_to_domain`). With one generator per problem, only the problems with a
        coordinate outside draw again, so a problem's sample does not depend on the others.
        """
        spaces = self.space.spaces
        if all(type(s).outside_domain is TangentSpace.outside_domain for s in spaces):
            return self._gaussian(generator)
        zs = [standard_normal(s.noise_shape, generator, s.x0.dtype, s.x0.device) for s in spaces]
        xi = self._from_noise(zs)
        kinds = self.space.kinds
        for _ in range(self.redraws):
            bads = [s.outside_domain(part, k)
                    for s, part, k in zip(spaces, self.space.split(xi), kinds, strict=True)]
            if all(b is None for b in bads):  # no factor's retraction has a domain
                return xi
            if not any(bool(b.any()) for b in bads if b is not None):
                break
            zs = [z if b is None else torch.where(b, _redraw(z, generator, b), z)
                  for z, b in zip(zs, bads, strict=True)]
            xi = self._from_noise(zs)
        return self.space.clip_to_domain(xi)

    def proju(self, u: torch.Tensor) -> torch.Tensor:
        return self._masked(self._proj(self._masked(u)))

    def norm(self, xi: torch.Tensor) -> torch.Tensor:
        return self.inner(xi).clamp_min(0).sqrt()

    def project(self, xi: torch.Tensor) -> torch.Tensor:
        return self._radial(self.space.clip_to_domain(self.proju(xi)))

    def step(self, xi: torch.Tensor, d: torch.Tensor, eta: torch.Tensor | float, *,
             inplace: bool = False) -> torch.Tensor:
        r"""$P_S(\xi + \eta d)$ without the horizontal projection: `xi` (feasible) and `d` (a
        `direction`) are horizontal and masked, hence so is $\xi + \eta d$."""
        y = self.space.clip_to_domain(self._axpy(xi, d, eta, inplace))
        return self._radial(y, inplace)


class MetricBall(_HorizontalBall):
    r"""$\{\xi \in \mathcal H_w : \|\xi\|_w \le \rho\}$ in the Riemannian metric (App. C).

    The ascent direction is the normalised Riemannian gradient $\Pi(g^{-1}\nabla L) /
    \|\Pi(g^{-1}\nabla L)\|_w$ (Alg. 1 lines 10, 12), the projection $\Pi$ then the radial
    shrink. Samples are $\rho$ times a standard Gaussian of the metric on $\mathcal H$.
    """

    name = "metric"

    def inner(self, u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        return self.space.inner(u, v)

    def norms(self, xi: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = self.space.inner_by_label(xi)
        out = {k: v.clamp_min(0).sqrt() for k, v in parts.items()}
        out["total"] = self.norm(xi)
        return out

    def _proj(self, u: torch.Tensor) -> torch.Tensor:
        return self.space.proju(u)

    def horizontal_distance(self, xi: torch.Tensor) -> torch.Tensor:
        if self.mask is not None:
            return super().horizontal_distance(xi)
        return self.space.vertical_norm2(xi).clamp_min(0).sqrt()  # no vector of size D

    def rgrad(self, egrad: torch.Tensor) -> torch.Tensor:
        return self._masked(self.space.egrad2rgrad(self._masked(egrad)))

    def direction(self, xi: torch.Tensor, egrad: torch.Tensor, *,
                  inplace: bool = False) -> torch.Tensor:
        if not inplace or self.mask is not None:
            return super().direction(xi, egrad)
        r, n2 = self.space.egrad2rgrad_and_norm2(egrad)
        return self._normalise(r, n2.clamp_min(0).sqrt(), inplace=True)

    def _gaussian(self, generator: Generator) -> torch.Tensor:
        return self._masked(self.space.sample(generator)) * self.rho

    def _from_noise(self, noise: Sequence[torch.Tensor]) -> torch.Tensor:
        parts = [s.sample(noise=z) for s, z in zip(self.space.spaces, noise, strict=True)]
        return self._masked(self.space.join(parts)) * self.rho


class AdaptiveNormBall(_HorizontalBall):
    r"""$\{\xi \in \mathcal H_w : \|\xi \oslash c\|_2 \le \rho\}$: the adaptive norm on every
    entry, GL blocks included, with $\xi$ horizontal (App. G ablation (a)).

    The projection is exact in the set's own norm: the horizontal projection orthogonal in
    $\|\cdot \oslash c\|_2$
    ([`proju_weighted`][quotient_manifolds.manifolds.base.TangentSpace.proju_weighted]),
    then the radial shrink. The ascent direction is the gradient of that norm made horizontal
    the same way, $\Pi^{c}(c^2 \odot \nabla L)$, normalised.

    Parameters
    ----------
    w2 : Tensor
        $c^2 = w^2 + \varepsilon$ of every entry, shaped like a tangent vector, positive.
    """

    name = "adaptive"

    def __init__(self, space: ProductTangentSpace, rho: float, w2: torch.Tensor,
                 mask: torch.Tensor | None = None) -> None:
        super().__init__(space, rho, mask)
        self.w2 = w2
        self.inv_w2 = torch.where(w2 > 0, 1.0 / torch.where(w2 > 0, w2, 1.0), 0.0)

    def inner(self, u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        v = u if v is None else v
        return (u * v * self.inv_w2).sum(-1)

    def norms(self, xi: torch.Tensor) -> dict[str, torch.Tensor]:
        terms = self.space.split(xi * xi * self.inv_w2)
        out: dict[str, torch.Tensor] = {}
        p = len(self.problems)
        for lab, t in zip(self.space.labels, terms, strict=True):
            s = t.sum(dim=tuple(range(p, t.dim()))) if t.dim() > p else t
            out[lab] = out[lab] + s if lab in out else s
        out = {k: v.clamp_min(0).sqrt() for k, v in out.items()}
        out["total"] = self.norm(xi)
        return out

    def _proj(self, u: torch.Tensor) -> torch.Tensor:
        return self.space.proju_weighted(u, self.w2)

    def rgrad(self, egrad: torch.Tensor) -> torch.Tensor:
        return self.proju(self.w2 * egrad)

    def _gaussian(self, generator: Generator) -> torch.Tensor:
        return self._masked(self.space.sample_weighted(self.w2, generator)) * self.rho

    def _from_noise(self, noise: Sequence[torch.Tensor]) -> torch.Tensor:
        parts = [s.sample_weighted(w, noise=z) for s, w, z in
                 zip(self.space.spaces, self.space.split(self.w2), noise, strict=True)]
        return self._masked(self.space.join(parts)) * self.rho

    def restrict(self: _Set, space: ProductTangentSpace,
                 take: Callable[[torch.Tensor], torch.Tensor]) -> _Set:
        new = super().restrict(space, take)
        assert isinstance(new, AdaptiveNormBall) and isinstance(self, AdaptiveNormBall)
        new.w2, new.inv_w2 = take(self.w2), take(self.inv_w2)
        return new


class _Elementwise(FeasibleSet):
    """Sets without a horizontal constraint, scaled entrywise by `c` (the reference algorithm)."""

    def __init__(self, space: ProductTangentSpace, rho: float, c: torch.Tensor,
                 mask: torch.Tensor | None = None) -> None:
        super().__init__(space, rho, mask)
        self.c = c
        # entries with c = 0 (zero weights, ε = 0) are frozen: every step is 0 there
        self.inv_c = torch.where(c > 0, 1.0 / torch.where(c > 0, c, 1.0), 0.0)

    def inner(self, u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        r"""$\sum u v / c$: the inner product in which $c \odot \nabla$ (the reference step) is
        the gradient."""
        v = u if v is None else v
        return (u * v * self.inv_c).sum(-1)

    def rgrad(self, egrad: torch.Tensor) -> torch.Tensor:
        return self._masked(egrad * self.c)

    def restrict(self: _Set, space: ProductTangentSpace,
                 take: Callable[[torch.Tensor], torch.Tensor]) -> _Set:
        new = super().restrict(space, take)
        assert isinstance(new, _Elementwise) and isinstance(self, _Elementwise)
        new.c, new.inv_c = take(self.c), take(self.inv_c)
        return new


class Ellipsoid(_Elementwise):
    r"""$\{\delta : \|\delta \oslash c\|_2 \le \rho\}$, the reference ℓ2 algorithm (Eq. 1).

    Direction $c \odot \nabla L / \|\nabla L\|_2$ (the gradient normalised by its global ℓ2
    norm, then scaled by $c$), projection: the Euclidean projection onto the ellipsoid,
    $\delta(\lambda) = y / (1 + 2\lambda/c^2)$ with $\lambda$ found by bisection (start 0.1,
    upper bound 10, doubled while infeasible) until $|\|\delta \oslash c\| - \rho| <
    10^{-5}\rho$, then shrunk radially onto the ellipsoid if just outside; samples
    $\rho\, c \odot N(0, I)$. The tolerance `tol` is relative to $\rho$ (the reference
    code's $10^{-5}$ is absolute, which at $\rho \le 10^{-5}$ stops the bisection anywhere
    inside the ellipsoid).

    The fixed points of this step and projection satisfy $\nabla L \parallel \delta / c^3$,
    not the KKT condition $\nabla L \parallel \delta / c^2$ of the ellipsoid: the reference
    algorithm's maximiser is not the exact maximiser of Eq. 1 (the geoopt path, with the same
    `rgrad` and projection, has the same fixed points).
    """

    name = "ellipsoid"
    tol = 1e-5
    r"""Relative tolerance of the bisection: it stops at $|\|\delta \oslash c\| - \rho| <
    \mathrm{tol}\,\rho$."""
    max_iter = 200

    def norm(self, xi: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(xi * self.inv_c, dim=-1)

    def direction(self, xi: torch.Tensor, egrad: torch.Tensor, *,
                  inplace: bool = False) -> torch.Tensor:
        g = self._masked(egrad)
        n = torch.linalg.vector_norm(g, dim=-1)
        if inplace and self.mask is None:
            return self._normalise(g.mul_(self.c), n, inplace=True)
        return self._normalise(g * self.c, n)

    def project(self, xi: torch.Tensor) -> torch.Tensor:
        return self._masked(_ellipsoid_projection(self._masked(xi), self.c, self.rho,
                                                  self.tol, self.max_iter))

    def sample(self, generator: Generator = None) -> torch.Tensor:
        z = standard_normal(self.c.shape, generator, self.c.dtype, self.c.device)
        return self._masked(self.rho * self.c * z)


class Box(_Elementwise):
    r"""$\{\delta : \|\delta \oslash c\|_\infty \le \rho\}$, the reference ℓ∞ algorithm.

    Direction $c \odot \operatorname{sign}\nabla L$, projection: clipping to
    $[-\rho c, \rho c]$; samples $\rho\, c \odot U(-1, 1)$.
    """

    name = "box"

    def norm(self, xi: torch.Tensor) -> torch.Tensor:
        if xi.shape[-1] == 0:
            return xi.new_zeros(xi.shape[:-1])
        return (xi * self.inv_c).abs().amax(-1)

    def direction(self, xi: torch.Tensor, egrad: torch.Tensor, *,
                  inplace: bool = False) -> torch.Tensor:
        if inplace and self.mask is None:
            return egrad.sign_().mul_(self.c)
        return self._masked(egrad.sign() * self.c)

    def project(self, xi: torch.Tensor) -> torch.Tensor:
        r = self.rho * self.c
        return self._masked(torch.maximum(torch.minimum(xi, r), -r))

    def sample(self, generator: Generator = None) -> torch.Tensor:
        if generator is None or isinstance(generator, torch.Generator):
            u = torch.rand(self.c.shape, generator=generator, dtype=self.c.dtype)
        else:
            u = torch.stack([torch.rand(self.c.shape[1:], generator=g, dtype=self.c.dtype)
                             for g in generator])
        return self._masked(self.rho * self.c * (u.to(self.c.device) * 2 - 1))


def _ellipsoid_projection(y: torch.Tensor, c: torch.Tensor, rho: float, tol: float = 1e-5,
                          max_iter: int = 200) -> torch.Tensor:
    r"""Euclidean projection onto $\{\delta : \|\delta \oslash c\|_2 \le \rho\}$ by bisection,
    per problem (leading dimensions), to the relative tolerance `tol` (see `Ellipsoid`).

    $\delta(\lambda) = y / (1 + \lambda b)$ with $b = 2/c^2$; the bisection evaluates
    $\|a / (1 + \lambda b)\|$, $a = y/c$, in a reused buffer. Entries with $c = 0$ are frozen
    ($y = 0$ there). The upper bound of $\lambda$ is doubled at most up to
    $2(\|a\|/\rho)/\min b + 10$, where the point is surely inside (no absolute cap).
    """
    live = c > 0
    a = torch.where(live, y / torch.where(live, c, 1.0), 0.0)
    b = torch.where(live, 2 / torch.where(live, c * c, 1.0), 0.0)
    lead = y.shape[:-1]
    dt = torch.float64
    buf = torch.empty_like(a)  # reused: fresh 10⁷-entry tensors cost page faults on CPU

    def wnorm(lam: torch.Tensor) -> torch.Tensor:  # ‖δ(λ) ⊘ c‖ = ‖a / (1 + λb)‖, per problem
        if lam.dim() == 0:
            torch.mul(b, float(lam), out=buf).add_(1.0)
        else:
            torch.mul(b, lam.to(y.dtype).unsqueeze(-1), out=buf).add_(1.0)
        return torch.linalg.vector_norm(torch.div(a, buf, out=buf), dim=-1).to(dt)

    zero = torch.zeros(lead, dtype=dt, device=y.device)
    v0 = wnorm(zero)
    inside = v0 <= rho
    if bool(inside.all()):
        return y
    # at λ ≥ (‖a‖/ρ)/min b every ‖a / (1 + λb)‖ ≤ ρ: the most the upper bound needs to grow
    bmin = torch.where(live, b, torch.inf).amin(-1).to(dt)
    cap = 2 * (v0 / rho) / bmin + 10.0
    lo = zero.clone()
    hi = torch.full(lead, 10.0, dtype=dt, device=y.device)
    while True:
        grow = (wnorm(hi) > rho) & (hi < cap)
        if not bool(grow.any()):
            break
        hi = torch.where(grow, hi * 2, hi)
    lam = torch.full(lead, 0.1, dtype=dt, device=y.device)
    done = inside.clone()
    for _ in range(max_iter):
        v = wnorm(lam)
        done = done | ((v - rho).abs() < tol * rho)  # relative: ρ may be below tol
        if bool(done.all()):
            break
        lo = torch.where(~done & (v > rho), lam, lo)
        hi = torch.where(~done & (v <= rho), lam, hi)
        lam = torch.where(done, lam, 0.5 * (lo + hi))
    lam = torch.where(inside, 0.0, lam)
    # done from outside (‖δ ⊘ c‖ ≤ ρ(1 + tol)): shrink onto the boundary radially, not back
    # to `hi`, which may lie far inside
    v = wnorm(lam)
    shrink = torch.where(v > rho, rho / v, 1.0).to(y.dtype).unsqueeze(-1)
    return y / (1 + lam.to(y.dtype).unsqueeze(-1) * b) * shrink


def make_feasible(ball: str, space: ProductTangentSpace, rho: float, *,
                  w2: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                  horizontal: Sequence[bool] | bool = True) -> FeasibleSet:
    """The feasible set `ball` (one of `BALLS`).

    `w2` ($c^2$ of every entry) is needed by every ball but `"metric"`; `horizontal` says
    whether the space has a vertical part (then `"ellipsoid"` and `"box"`, which have no
    horizontal constraint, are refused).
    """
    if ball not in BALLS:
        raise ValueError(f"ball must be one of {BALLS}, got {ball!r}")
    if ball == "metric":
        return MetricBall(space, rho, mask)
    if w2 is None:
        raise ValueError(f"ball={ball!r} needs the weights w2 = w² + eps of every entry")
    if ball == "adaptive":
        return AdaptiveNormBall(space, rho, w2, mask)
    if horizontal:
        raise ValueError(
            f"ball={ball!r} is the reference adaptive-sharpness algorithm, which has no "
            "horizontal constraint; use it without GL blocks (metric=None), or use "
            "ball='metric' or 'adaptive'"
        )
    cls = Ellipsoid if ball == "ellipsoid" else Box
    return cls(space, rho, w2.sqrt(), mask)
