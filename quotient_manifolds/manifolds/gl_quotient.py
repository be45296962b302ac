r"""GL(h) quotient of factor pairs $(G, H)$ that act only through $G H^\top$."""

from __future__ import annotations

from functools import cached_property

import torch

from ..errors import RankDeficientError, ShapeError
from ..geometry import gl, subgroup
from ..geometry.linalg import GRAM_DTYPE, transpose
from .base import QuotientManifold, TangentSpace, assert_broadcastable, into

__all__ = ["GLQuotient", "GLTangentSpace", "SubgroupTangentSpace", "group_action"]

#: relative residual at which the conjugate-gradient solve of `proju_weighted` stops
CG_TOL = 1e-12


def _join(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = a.expand(*batch, *a.shape[-2:])
    b = b.expand(*batch, *b.shape[-2:])
    return torch.cat([a, b], dim=-2).to(dtype)


def group_action(x: torch.Tensor, g: torch.Tensor, n: int, *, one_sided: bool = False
                 ) -> torch.Tensor:
    r"""The GL(h) action $(G, H) \mapsto (G g^{-1}, H g^\top)$ on packed points `[G; H]`.

    `x` is `(..., n + m, h)` with $G$ its first `n` rows, `g` is `(..., h, h)` (invertible,
    broadcast against the batch). With `one_sided=True` only $G \mapsto G g^{-1}$: not a
    symmetry, the control of a function-preservation probe.
    """
    G, H = x[..., :n, :], x[..., n:, :]
    g = g.to(x.dtype)
    G_new = transpose(torch.linalg.solve(transpose(g), transpose(G)))  # G g⁻¹
    return _join(G_new, H if one_sided else H @ transpose(g), x.dtype)


class GLTangentSpace(TangentSpace):
    r"""The horizontal tangent space of [`GLQuotient`][quotient_manifolds.manifolds.GLQuotient]
    at one point $x_0 = [G; H]$ (or a batch of blocks), for the quotient by the full GL(h).

    The Gram matrices $P = G^\top G + \varepsilon I$, $Q = H^\top H + \varepsilon I$, their
    inverses and Cholesky factors are computed once (float64); the Sylvester eigenbasis of the
    projection and the Cholesky factors of the sampler on first use.

    The vertical space is $\{(GX, -HX^\top) : X \in \mathfrak{gl}(h)\}$ (Def. 3.1). The
    quotient by a subgroup is the subclass
    [`SubgroupTangentSpace`][quotient_manifolds.manifolds.gl_quotient.SubgroupTangentSpace],
    which replaces the projection, the horizontal condition and the restriction of the
    weighted projection's system to the subalgebra; the metric, $\Gamma$ and the retractions
    are the same.
    """

    def __init__(self, manifold: GLQuotient, x0: torch.Tensor) -> None:
        super().__init__(manifold, x0)
        self.n, self.metric, self.eps = manifold.n, manifold.metric, manifold.eps
        self.G, self.H = x0[..., : self.n, :], x0[..., self.n :, :]
        self.grams = gl.grams(self.G, self.H, self.eps)

    def split(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return u[..., : self.n, :], u[..., self.n :, :]

    @cached_property
    def basis(self) -> gl.SylvesterBasis | None:
        """The eigenbasis of the projection equation (inv, or ε > 0); None for mix at ε = 0."""
        if self.metric == "inv" or self.eps > 0:
            return gl.sylvester_basis(self.grams, self.metric)
        return None

    @cached_property
    def _sampler(self) -> tuple[torch.Tensor, torch.Tensor]:
        gr = self.grams
        a, b = (gr.P, gr.Q) if self.metric == "inv" else (gr.Q_inv, gr.P_inv)
        return torch.linalg.cholesky(a), torch.linalg.cholesky(b)

    def _metric_matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        r"""$(M_G, M_H)$ with $\langle u, v\rangle = Tr(M_G u_G^\top v_G + M_H u_H^\top v_H)$."""
        gr = self.grams
        return (gr.P_inv, gr.Q_inv) if self.metric == "inv" else (gr.Q, gr.P)

    # -- geometry ---------------------------------------------------------------
    def inner(self, u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        r"""Eq. 9 (inv) or Eq. 10 (mix), one value per block."""
        uG, uH = self.split(u)
        vG, vH = (uG, uH) if v is None else self.split(v)
        return gl.inner(self.G, self.H, uG, uH, vG, vH, self.grams, self.metric).to(u.dtype)

    def _project(self, uG: torch.Tensor, uH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gl.project(self.G, self.H, uG, uH, self.grams, self.metric, self.basis)

    def _restrict(self, X: torch.Tensor) -> torch.Tensor:
        r"""$\pi_{\mathfrak k}$, the Frobenius-orthogonal projection onto the Lie algebra of the
        group: the identity on $\mathfrak{gl}(h)$."""
        return X

    def _cg_preconditioner(self, G: torch.Tensor, H: torch.Tensor, wG: torch.Tensor,
                           wH: torch.Tensor, MG: torch.Tensor, MH: torch.Tensor,
                           b: torch.Tensor) -> torch.Tensor:
        r"""The Jacobi preconditioner of the weighted projection's system: the diagonal of
        $Y \mapsto R(w_2 \odot R^*(Y))$ (float64, zeros replaced by 1)."""
        d = transpose(G * G) @ wG @ (MG * MG) + (MH * MH) @ transpose(wH) @ (H * H)
        return torch.where(d > 0, d, 1.0)

    def proju(self, u: torch.Tensor) -> torch.Tensor:
        r"""$(u_G + G\Lambda, u_H - H\Lambda^\top)$, metric-orthogonal onto the horizontal space."""
        return _join(*self._project(*self.split(u)), u.dtype)

    def egrad2rgrad(self, g: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        r"""inv: $\Pi(\nabla_G P, \nabla_H Q)$; mix: $\Pi(\nabla_G Q^{-1}, \nabla_H P^{-1})$
        (into `out`, which may be `g`, if given)."""
        rG, rH = gl.egrad2rgrad(*self.split(g), self.grams, self.metric)
        return into(_join(*self._project(rG, rH), g.dtype), out)

    def proju_weighted(self, u: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        r"""The horizontal projection orthogonal in $\sum u^2 / w_2$, by conjugate gradients.

        With $R(u) = G^\top u_G M_G - M_H u_H^\top H$ (so that $\langle u, V(X)\rangle =
        \langle R(u), X\rangle_F$ for the vertical vectors $V(X) = (GX, -HX^\top)$, and
        $u$ is horizontal iff $R(u) = 0$), the projection is

        $$
        \eta = u + w_2 \odot R^*(Y), \qquad R(w_2 \odot R^*(Y)) = -R(u),
        $$

        with $R^*(Y) = (G Y M_G, -H Y^\top M_H)$. The $h \times h$ system (on the Lie algebra
        of the group: all of $\mathfrak{gl}(h)$ here, $\mathfrak k$ in
        [`SubgroupTangentSpace`][quotient_manifolds.manifolds.gl_quotient.SubgroupTangentSpace])
        is symmetric positive definite and is solved by batched conjugate gradients in float64
        (Jacobi-preconditioned on $\mathfrak{gl}(h)$) to a relative residual of `CG_TOL` (or
        until it stalls).
        """
        out_dt = u.dtype
        uG, uH = (t.to(GRAM_DTYPE) for t in self.split(u))
        wG, wH = (t.to(GRAM_DTYPE) for t in self.split(w2.expand_as(u)))
        G, H = self.G.to(GRAM_DTYPE), self.H.to(GRAM_DTYPE)
        MG, MH = self._metric_matrices()
        proj = self._restrict

        def R(aG, aH):
            return transpose(G) @ aG @ MG - MH @ transpose(aH) @ H

        def R_star(Y):
            return G @ Y @ MG, -(H @ transpose(Y) @ MH)

        def A(Y):
            sG, sH = R_star(Y)
            return proj(R(wG * sG, wH * sH))

        b = -proj(R(uG, uH))
        d = self._cg_preconditioner(G, H, wG, wH, MG, MH, b)
        Y = _cg(A, b, d, tol=CG_TOL, max_iter=10 * b.shape[-1] ** 2 + 100)
        sG, sH = R_star(Y)
        return _join(uG + wG * sG, uH + wH * sH, out_dt)

    def christoffel(self, u: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        r"""$\Gamma_{x_0}(u, v)$ (Eq. 11/12, polarised); $\Gamma_{x_0}(u, u)$ if `v` is omitted."""
        uG, uH = self.split(u)
        vG, vH = (None, None) if v is None else self.split(v)
        cG, cH = gl.christoffel(self.G, self.H, uG, uH, vG, vH, self.grams, self.metric)
        return _join(cG, cH, u.dtype)

    def retract(self, u: torch.Tensor, kind: str | None = None, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        r"""As [`TangentSpace.retract`][quotient_manifolds.manifolds.base.TangentSpace.retract];
        the second order runs as one fused kernel
        (`quotient_manifolds.geometry.gl.second_order_packed`), equal to
        $x_0 + u - \tfrac12 \Gamma_{x_0}(u, u)$, unless the base point itself requires a
        gradient."""
        kind = self.manifold.retraction if kind is None else kind
        if kind != "second_order" or (torch.is_grad_enabled() and self.x0.requires_grad):
            # the fused kernel differentiates in u only; a base point that needs a gradient
            # takes the autograd path through x0 + u − ½Γ(u, u)
            return super().retract(u, kind, out=out)
        return into(gl.second_order_packed(self.x0, u, self.n, self.grams, self.metric), out)

    def geodesic(self, u: torch.Tensor) -> torch.Tensor:
        """RK4 in the $2h$-dim span of $[F, u_F]$
        (`quotient_manifolds.geometry.gl.geodesic`)."""
        yG, yH = gl.geodesic(self.G, self.H, *self.split(u), self.metric, self.eps,
                             self.manifold.steps)
        return _join(yG, yH, self.x0.dtype)

    def metric_sqrt_inv(self, z: torch.Tensor) -> torch.Tensor:
        r"""inv: $(z_G L_P^\top, z_H L_Q^\top)$; mix: with $Q^{-1}$, $P^{-1}$."""
        LG, LH = self._sampler
        zG, zH = self.split(z)
        return _join(zG @ transpose(LG).to(z.dtype), zH @ transpose(LH).to(z.dtype), z.dtype)

    def horizontal_residual(self, u: torch.Tensor) -> torch.Tensor:
        """The `h×h` matrix (float64) that vanishes exactly on horizontal vectors."""
        return gl.horizontal_residual(self.G, self.H, *self.split(u), self.grams, self.metric)

    def horizontal_residual_scale(self, u: torch.Tensor) -> torch.Tensor:
        """The scale of the terms of `horizontal_residual` (what its relative tolerance
        multiplies)."""
        return gl.horizontal_residual_scale(self.G, self.H, *self.split(u), self.grams,
                                            self.metric)


class SubgroupTangentSpace(GLTangentSpace):
    r"""The horizontal tangent space of a
    [`GLQuotient`][quotient_manifolds.manifolds.GLQuotient] with a `subalgebra`
    $\mathfrak k$: the quotient by the connected subgroup $\exp(\mathfrak k) \subseteq GL(h)$.

    The vertical space shrinks to $\{(GX, -HX^\top) : X \in \mathfrak k\}$, so the horizontal
    space grows; the metric, the Christoffel form, the retractions and the sampler's square
    root are those of [`GLTangentSpace`][quotient_manifolds.manifolds.gl_quotient.GLTangentSpace]
    (both metrics are GL(h)-invariant, hence invariant under the subgroup). The projection
    solves the system of `quotient_manifolds.geometry.subgroup.subgroup_system`, built once per
    point on first use.

    Attributes
    ----------
    subalgebra : Subalgebra
        $\mathfrak k$, acting on the `h` columns of the point.
    """

    def __init__(self, manifold: GLQuotient, x0: torch.Tensor) -> None:
        sub = manifold.subalgebra
        if sub is None:
            raise ValueError("a SubgroupTangentSpace needs a manifold with a subalgebra")
        if sub.h != x0.shape[-1]:
            raise ShapeError(f"the subalgebra acts on h = {sub.h}, but the point "
                             f"has h = {x0.shape[-1]}")
        super().__init__(manifold, x0)
        self.subalgebra: subgroup.Subalgebra = sub

    @cached_property
    def sub_system(self) -> subgroup.SubgroupSystem:
        """The per-point system of the subgroup projection."""
        return subgroup.subgroup_system(self.G, self.H, self.grams, self.metric,
                                        self.subalgebra)

    def _project(self, uG: torch.Tensor, uH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return subgroup.project(self.G, self.H, uG, uH, self.grams, self.metric,
                                self.subalgebra, self.sub_system)

    def _restrict(self, X: torch.Tensor) -> torch.Tensor:
        r"""$\pi_{\mathfrak k}$, the Frobenius-orthogonal projection onto the subalgebra."""
        return self.subalgebra.project(X)

    def _cg_preconditioner(self, G: torch.Tensor, H: torch.Tensor, wG: torch.Tensor,
                           wH: torch.Tensor, MG: torch.Tensor, MH: torch.Tensor,
                           b: torch.Tensor) -> torch.Tensor:
        r"""No preconditioning (all ones): the diagonal of the system restricted to
        $\mathfrak k$ is not that of the full one."""
        return torch.ones_like(b)

    def horizontal_residual(self, u: torch.Tensor) -> torch.Tensor:
        r"""$\pi_{\mathfrak k} D(u)$ (float64, `h×h`), which vanishes exactly on
        $\mathfrak k$-horizontal vectors."""
        return subgroup.horizontal_residual(self.G, self.H, *self.split(u), self.grams,
                                            self.metric, self.subalgebra)

    def horizontal_residual_scale(self, u: torch.Tensor) -> torch.Tensor:
        """The scale of the terms of `horizontal_residual`."""
        return subgroup.horizontal_residual_scale(self.G, self.H, *self.split(u), self.grams,
                                                  self.metric, self.subalgebra)


def _cg(A, b: torch.Tensor, d: torch.Tensor, *, tol: float, max_iter: int) -> torch.Tensor:
    """Batched preconditioned conjugate gradients for `A(Y) = b` over `(..., h, h)` matrices.

    `A` is symmetric positive definite on the span of `b`; `d` is a positive diagonal
    preconditioner. Stops when every block's relative residual is below `tol` or when the
    largest one has not decreased for 50 iterations.
    """

    def dot(x, y):
        return (x * y).sum((-2, -1), keepdim=True)

    bnorm = b.norm(dim=(-2, -1), keepdim=True)
    safe = torch.where(bnorm > 0, bnorm, 1.0)
    Y = torch.zeros_like(b)
    r = b.clone()
    z = r / d
    p = z.clone()
    rz = dot(r, z)
    best, stall = float("inf"), 0
    for _ in range(max_iter):
        Ap = A(p)
        pAp = dot(p, Ap)
        alpha = torch.where(pAp > 0, rz / torch.where(pAp > 0, pAp, 1.0), 0.0)
        Y = Y + alpha * p
        r = r - alpha * Ap
        rel = float((r.norm(dim=(-2, -1), keepdim=True) / safe).max()) if r.numel() else 0.0
        if rel < tol:
            break
        if rel < best:
            best, stall = rel, 0
        else:
            stall += 1
            if stall >= 50:
                break
        z = r / d
        rz_new = dot(r, z)
        beta = torch.where(rz > 0, rz_new / torch.where(rz > 0, rz, 1.0), 0.0)
        p = z + beta * p
        rz = rz_new
    return Y


class GLQuotient(QuotientManifold):
    r"""Quotient $(R^{n\times h}_* \times R^{m\times h}_*) / GL(h)$ of a factor pair.

    The pair ``(G, H)``, $G \in R^{n\times h}$, $H \in R^{m\times h}$, enters the network
    only through ``G Hᵀ``; the group acts by ``(G A⁻¹, H Aᵀ)`` (Def. 3.1).
    This covers attention Q/K and V/O pairs per head (with appended bias rows,
    Example A.1; [bias rows][bias-rows]), LoRA ``B A`` (``G = B``, ``H = Aᵀ``) and two-layer linear
    nets.

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
        Relaxation of every Gram matrix ([relaxation][eps-relaxation]); ``0`` requires full
        column rank.  With ``eps > 0`` the metric is no longer exactly
        GL(h)-invariant.
    retraction : {"first_order", "second_order", "exact"}
        What [`retr`][quotient_manifolds.manifolds.gl_quotient.GLQuotient.retr] (and so every geoopt
        optimizer) uses: ``x + u``, ``x + u − ½Γ_x(u, u)`` (Eq. 5) or the geodesic integrated by
        RK4.
    steps : int
        RK4 steps of the exact geodesic
        ([`expmap`][quotient_manifolds.manifolds.gl_quotient.GLQuotient.expmap]).  The error is
        ``O((‖u‖/steps)⁴)``; see ``docs/benchmarks.md`` for measured values.
    validate : bool
        Check shapes and finiteness of inputs (one host sync per call).
    subalgebra : Subalgebra, optional
        Quotient by the connected subgroup $\exp(\mathfrak k)$ of GL(h) instead of GL(h):
        the vertical space is $\{(GX, -HX^\top) : X \in \mathfrak k\}$, the metric and
        $\Gamma$ are unchanged. `None` (default) is the full GL(h).

    Notes
    -----
    Every operation at a point runs through its tangent space, `M.at(x)`
    ([`GLTangentSpace`][quotient_manifolds.manifolds.gl_quotient.GLTangentSpace], or its
    subclass [`SubgroupTangentSpace`][quotient_manifolds.manifolds.gl_quotient.SubgroupTangentSpace]
    with a `subalgebra`).

    * [`proju`][quotient_manifolds.manifolds.gl_quotient.GLQuotient.proju] is the metric-orthogonal
      projection onto the horizontal space ([projection][horizontal-projection]): closed form
      for ``mix``; for ``inv`` the corrected Sylvester equation ``AΩ + ΩA = B``, ``A = PQ``,
      solved in the eigenbasis of ``A``.
    * [`egrad2rgrad`][quotient_manifolds.manifolds.gl_quotient.GLQuotient.egrad2rgrad] is the
      horizontal Riemannian gradient (Alg. 1 line 10, App. C.2).
    * [`projx`][quotient_manifolds.manifolds.gl_quotient.GLQuotient.projx] is the identity: points
      are never moved along orbits.
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
        subalgebra: subgroup.Subalgebra | None = None,
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
        self.subalgebra = subalgebra

    def extra_repr(self) -> str:
        return (
            f"n={self.n}, m={self.m}, metric={self.metric!r}, eps={self.eps:g}, "
            + ("" if self.subalgebra is None else f"subalgebra={self.subalgebra!r}, ")
            + f"{super().extra_repr()}"
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
    def _check_shape(self, shape: tuple[int, ...], name: str) -> tuple[bool, str | None]:
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
        ts = self._space(x)
        res = ts.horizontal_residual(u)
        scale = ts.horizontal_residual_scale(u)
        if not bool((res.abs() <= atol + rtol * scale).all()):
            return False, (
                f"vector is not horizontal: the {self.metric} horizontal condition "
                f"has residual {res.abs().max().item():.3g} (atol={atol}, rtol={rtol})"
            )
        return True, None

    # -- tangent spaces ----------------------------------------------------------
    def at(self, x: torch.Tensor) -> GLTangentSpace:
        """The tangent space at `x` (`(…, n + m, h)`), with its Gram matrices computed once."""
        return self._at(x)

    def _at(self, x: torch.Tensor, *vectors: torch.Tensor | None) -> GLTangentSpace:
        if self.validate:
            self._assert_shapes(x=x, **{f"u{i}": v for i, v in enumerate(vectors)})
            self._check_inputs(x, *vectors)
        return self._space(x)

    def _space(self, x: torch.Tensor) -> GLTangentSpace:
        """The tangent space at `x`, unchecked: a
        [`GLTangentSpace`][quotient_manifolds.manifolds.gl_quotient.GLTangentSpace], or a
        [`SubgroupTangentSpace`][quotient_manifolds.manifolds.gl_quotient.SubgroupTangentSpace]
        with a `subalgebra`."""
        if self.subalgebra is None:
            return GLTangentSpace(self, x)
        return SubgroupTangentSpace(self, x)

    # -- group structure --------------------------------------------------------
    def vertical(self, x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
        r"""The vertical vector ``(GΩ, −HΩᵀ)`` for $Ω \in R^{h\times h}$
        ([vertical space][vertical-space])."""
        G, H = self.split(x)
        vG, vH = gl.vertical(G, H, omega.to(x.dtype))
        return self._join(vG, vH, x.dtype)

    def act(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        r"""Group action ``(G g⁻¹, H gᵀ)``; linear, so it also maps tangent vectors."""
        return group_action(x, g, self.n)

    def invariant(self, x: torch.Tensor) -> torch.Tensor:
        """``G Hᵀ``, the only thing the network sees."""
        G, H = self.split(x)
        return G @ transpose(H)

    # -- sampling -------------------------------------------------------------
    def _random_tensor(self, shape, dtype, device) -> torch.Tensor:
        """Gaussian factors with entries ``N(0, 1/h)`` (full rank almost surely)."""
        return torch.randn(shape, dtype=dtype, device=device) / shape[-1] ** 0.5

    def _origin_tensor(self, shape, dtype, device) -> torch.Tensor:
        r"""$G = I_{n\times h}$, $H = I_{m\times h}$ (truncated identities), broadcast to
        ``shape``."""
        h = shape[-1]
        eye = torch.cat(
            [torch.eye(self.n, h, dtype=dtype, device=device),
             torch.eye(self.m, h, dtype=dtype, device=device)],
            dim=0,
        )
        return eye.expand(shape).clone()
