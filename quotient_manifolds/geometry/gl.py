r"""Pure tensor kernels for the GL(h) quotient of factor pairs ``(G, H)``.

A block is a pair $G \in R^{n\times h}$, $H \in R^{m\times h}$ that a network uses only
through ``G Hᵀ``.  The group GL(h) acts by ``(G A⁻¹, H Aᵀ)``.  Every function
here takes the two factors (and tangent components) separately, batches over
all leading dimensions and never loops over blocks.  The thin manifold class
in `manifolds.gl_quotient` packs and unpacks them.

Notation: ``P = GᵀG + εI`` and ``Q = HᵀH + εI`` are the ([relaxed][eps-relaxation])
Gram matrices.  Gram matrices, their factorisations and all ``h×h`` solves run
in float64 whatever the input dtype; the large ``n×h`` products run in float32
(float64 for float64 inputs), and results come back in the dtype of the tangent
inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import NonFiniteError, RankDeficientError
from .linalg import GRAM_DTYPE, compute_dtype, eye_like, sym, transpose

__all__ = [
    "METRICS",
    "Grams",
    "SylvesterBasis",
    "grams",
    "sylvester_basis",
    "inner",
    "horizontal_residual",
    "horizontal_residual_scale",
    "horizontal_lambda",
    "vertical",
    "project",
    "egrad2rgrad",
    "christoffel",
    "second_order",
    "second_order_packed",
    "geodesic",
    "check_finite",
]

METRICS = ("inv", "mix")


class Grams(NamedTuple):
    """Gram matrices of a block, their inverses and Cholesky factors, in float64."""

    P: torch.Tensor
    Q: torch.Tensor
    P_inv: torch.Tensor
    Q_inv: torch.Tensor
    L_P: torch.Tensor  # lower Cholesky factor of P
    L_Q: torch.Tensor  # lower Cholesky factor of Q
    eps: float


class SylvesterBasis(NamedTuple):
    r"""Diagonalising bases of the projection equation for ``Ω = Λᵀ``
    ([derivation][sylvester-equation]).

    The equation becomes elementwise in ``Ω̃ = S⁻¹ Ω T``:
    ``Ω = S ((S⁻¹ C T) ⊘ denom) T⁻¹``.
    """

    S: torch.Tensor
    S_inv: torch.Tensor
    T: torch.Tensor
    T_inv: torch.Tensor
    denom: torch.Tensor


def check_finite(*tensors: torch.Tensor, what: str = "input") -> None:
    """Raise [`NonFiniteError`][quotient_manifolds.errors.NonFiniteError] if any tensor holds NaN
    or Inf."""
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        lo, hi = torch.aminmax(t.detach())  # one pass; NaN propagates into both
        if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
            raise NonFiniteError(
                f"{what} contains NaN or Inf; check the point and tangent vectors "
                "(e.g. a diverged optimizer step) before calling the manifold."
            )


def _cholesky_checked(M: torch.Tensor, factor: str, eps: float) -> torch.Tensor:
    L, info = torch.linalg.cholesky_ex(M)
    h = M.shape[-1]
    pivots = torch.diagonal(L, dim1=-2, dim2=-1) ** 2
    scale = torch.diagonal(M, dim1=-2, dim2=-1).amax(-1, keepdim=True).clamp_min(
        torch.finfo(M.dtype).tiny
    )
    tol = 10 * h * torch.finfo(M.dtype).eps
    bad = (info > 0).any() | (pivots <= tol * scale).any() | ~torch.isfinite(L).all()
    if bool(bad):
        hint = (
            "pass eps > 0 to use the relaxation GᵀG + eps·I (the ε relaxation of the Gram matrices)"
            if eps == 0
            else f"eps = {eps:g} is too small for this block; increase it"
        )
        raise RankDeficientError(
            f"factor {factor} of a GL(h) block is rank deficient (h = {h}); "
            f"the quotient geometry needs full column rank: {hint}."
        )
    return L


def grams(G: torch.Tensor, H: torch.Tensor, eps: float = 0.0) -> Grams:
    r"""Gram matrices ``P = GᵀG + εI``, ``Q = HᵀH + εI`` and their inverses.

    Raises [`RankDeficientError`][quotient_manifolds.errors.RankDeficientError] when a factor has no
    full column rank (Assumption 5.1) and the relaxation does not fix it.
    """
    G = G.to(GRAM_DTYPE)
    H = H.to(GRAM_DTYPE)
    I = eye_like(G)
    P = transpose(G) @ G + eps * I
    Q = transpose(H) @ H + eps * I
    L_P = _cholesky_checked(P, "G", eps)
    L_Q = _cholesky_checked(Q, "H", eps)
    # cholesky_solve, not cholesky_inverse: the latter's forward-mode derivative
    # (torch.func.jvp/jacfwd) is wrong in torch 2.14; reverse mode agrees for both.
    return Grams(P, Q, torch.cholesky_solve(I, L_P), torch.cholesky_solve(I, L_Q), L_P, L_Q, eps)


def _similarity_eig(L: torch.Tensor, K: torch.Tensor):
    """Diagonalise ``L Lᵀ K`` via the symmetric ``Lᵀ K L = U D Uᵀ``; return ``(L U, D, U)``."""
    d, U = torch.linalg.eigh(sym(transpose(L) @ K @ L))
    return L @ U, d, U


def sylvester_basis(gr: Grams, metric: str) -> SylvesterBasis:
    r"""Bases that make the horizontal-projection equation elementwise.

    Metric-orthogonality of ``ξ + (GΛ, −HΛᵀ)`` to the vertical space gives, with
    ``Ω = Λᵀ``, ``P̂ = GᵀG = P − εI`` and ``Q̂ = HᵀH = Q − εI``:

    * inv: ``(P Q̂) Ω + Ω (P̂ Q) = B``, ``B = P Hᵀ ξ_H − ξ_Gᵀ G Q``.  At ``ε = 0``
      this is the corrected Sylvester equation ``AΩ + ΩA = B``, ``A = PQ``.
      ``PQ̂ = S D₁ S⁻¹`` with ``S = L_P U₁`` from ``L_Pᵀ Q̂ L_P = U₁ D₁ U₁ᵀ``
      (the [eigendecomposition solver][sylvester-equation], with the Cholesky factor
      in place of $P^{1/2}$), and ``P̂Q = T D₂ T⁻¹`` with ``T = L_Q⁻ᵀ U₂``
      from ``L_Qᵀ P̂ L_Q = U₂ D₂ U₂ᵀ`` (at ``ε = 0``, ``T = S``).
    * mix: ``Q Ω P̂ + Q̂ Ω P = C``, ``C = Hᵀ ξ_H P − Q ξ_Gᵀ G``.  ``Q, Q̂`` and
      ``P, P̂`` commute, so the eigenvectors of ``Q`` and ``P`` diagonalise it.

    With ``ε > 0`` this is the exact metric-orthogonal projection for the
    relaxed metric (idempotent and self-adjoint).
    """
    eps = gr.eps
    if metric == "inv":
        I = eye_like(gr.P)
        Q_hat = gr.Q - eps * I if eps else gr.Q
        S, d1, U1 = _similarity_eig(gr.L_P, Q_hat)
        L_P_inv = torch.linalg.solve_triangular(gr.L_P, I, upper=False)
        S_inv = transpose(U1) @ L_P_inv
        if not eps:
            return SylvesterBasis(S, S_inv, S, S_inv, d1.unsqueeze(-1) + d1.unsqueeze(-2))
        # P̂ Q = L_Q⁻ᵀ (L_Qᵀ P̂ L_Q) L_Qᵀ = T D₂ T⁻¹ with T = L_Q⁻ᵀ U₂.
        _, d2, U2 = _similarity_eig(gr.L_Q, gr.P - eps * I)
        L_Q_inv = torch.linalg.solve_triangular(gr.L_Q, I, upper=False)
        T = transpose(L_Q_inv) @ U2
        T_inv = transpose(U2) @ transpose(gr.L_Q)
        return SylvesterBasis(S, S_inv, T, T_inv, d1.unsqueeze(-1) + d2.unsqueeze(-2))
    q, V_Q = torch.linalg.eigh(gr.Q)
    p, V_P = torch.linalg.eigh(gr.P)
    denom = q.unsqueeze(-1) * (p - eps).unsqueeze(-2) + (q - eps).unsqueeze(-1) * p.unsqueeze(-2)
    return SylvesterBasis(V_Q, transpose(V_Q), V_P, transpose(V_P), denom)


def _tr_inner(a: torch.Tensor, M: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``Tr(M aᵀ b) = <a M, b>_F`` for symmetric ``M``, reduced over the last two dims."""
    return ((a @ M) * b).sum((-2, -1))


def _work(*tensors: torch.Tensor) -> tuple[torch.dtype, list[torch.Tensor]]:
    """The dtype of the large ``n×h`` products (float32, or float64 for float64 inputs)."""
    dt = compute_dtype(tensors[0].dtype)
    return dt, [t.to(dt) for t in tensors]


def inner(
    G: torch.Tensor,
    H: torch.Tensor,
    uG: torch.Tensor,
    uH: torch.Tensor,
    vG: torch.Tensor,
    vH: torch.Tensor,
    gr: Grams,
    metric: str,
) -> torch.Tensor:
    r"""The metric (Eq. 9/10).

    $$
    \langle η, ζ\rangle ^{\text{inv}} = \operatorname{Tr}(P^{-1} η_G^{\top} ζ_G + Q^{-1} η_H^{\top}
    ζ_H), \qquad
    \langle η, ζ\rangle ^{\text{mix}} = \operatorname{Tr}(Q η_G^{\top} ζ_G + P η_H^{\top} ζ_H).
    $$
    """
    out_dt = uG.dtype
    dt, (uG, uH, vG, vH) = _work(uG, uH, vG, vH)
    MG, MH = (gr.P_inv, gr.Q_inv) if metric == "inv" else (gr.Q, gr.P)
    out = _tr_inner(uG, MG.to(dt), vG) + _tr_inner(uH, MH.to(dt), vH)
    return out.to(out_dt)


def _residual_terms(G, H, uG, uH, gr: Grams, metric: str) -> tuple[torch.Tensor, torch.Tensor]:
    # The two h×h terms whose difference is the horizontal residual, in float64.
    dt, (G, H, uG, uH) = _work(G, H, uG, uH)
    if metric == "inv":
        HtuH, uGtG = (t.to(GRAM_DTYPE) for t in (transpose(H) @ uH, transpose(uG) @ G))
        return gr.P @ HtuH, uGtG @ gr.Q
    GtuG, uHtH = (t.to(GRAM_DTYPE) for t in (transpose(G) @ uG, transpose(uH) @ H))
    return GtuG @ gr.Q, gr.P @ uHtH


def horizontal_residual(
    G: torch.Tensor,
    H: torch.Tensor,
    uG: torch.Tensor,
    uH: torch.Tensor,
    gr: Grams,
    metric: str,
) -> torch.Tensor:
    r"""The ``h×h`` matrix (float64) that vanishes exactly on horizontal vectors
    ([derivation][inv-horizontal]).

    inv: ``P Hᵀ ξ_H − ξ_Gᵀ G Q``;  mix: ``Gᵀ ξ_G Q − P ξ_Hᵀ H``.
    """
    a, b = _residual_terms(G, H, uG, uH, gr, metric)
    return a - b


def horizontal_residual_scale(
    G: torch.Tensor,
    H: torch.Tensor,
    uG: torch.Tensor,
    uH: torch.Tensor,
    gr: Grams,
    metric: str,
) -> torch.Tensor:
    """Elementwise size of the two terms of the residual, for relative tolerances."""
    a, b = _residual_terms(G, H, uG, uH, gr, metric)
    return a.abs() + b.abs()


def horizontal_lambda(
    G: torch.Tensor,
    H: torch.Tensor,
    uG: torch.Tensor,
    uH: torch.Tensor,
    gr: Grams,
    metric: str,
    basis: SylvesterBasis | None = None,
) -> torch.Tensor:
    r"""``Λ`` (``h×h``, float64) such that ``(ξ_G + GΛ, ξ_H − HΛᵀ)`` is horizontal
    ([derivation][horizontal-projection]).

    mix (closed form): ``Λ = ½(ξ_Hᵀ H Q⁻¹ − P⁻¹ Gᵀ ξ_G)``.

    inv (corrected Sylvester equation): ``AΩ + ΩA = B`` with ``A = PQ``,
    ``B = P Hᵀ ξ_H − ξ_Gᵀ G Q`` and ``Λ = Ωᵀ``; solved in the eigenbasis of
    ``A`` as ``Ω̃_ij = B̃_ij / (d_i + d_j)``.  With ``ε > 0`` (and for mix with
    ``ε > 0``) the equation of [`sylvester_basis`][quotient_manifolds.geometry.gl.sylvester_basis]
    is solved instead, so the result is the exact projection for the relaxed metric.
    """
    if metric == "mix" and not gr.eps:
        dt, (G, H, uG, uH) = _work(G, H, uG, uH)
        uHtH, GtuG = (t.to(GRAM_DTYPE) for t in (transpose(uH) @ H, transpose(G) @ uG))
        return 0.5 * (uHtH @ gr.Q_inv - gr.P_inv @ GtuG)
    if basis is None:
        basis = sylvester_basis(gr, metric)
    rhs = horizontal_residual(G, H, uG, uH, gr, metric)
    if metric == "mix":
        rhs = -transpose(rhs)  # C = Hᵀ ξ_H P − Q ξ_Gᵀ G
    rhs_t = basis.S_inv @ rhs @ basis.T
    # A zero denominator means both factors are degenerate there: no vertical direction.
    safe = basis.denom.abs() > torch.finfo(GRAM_DTYPE).tiny
    omega_t = torch.where(safe, rhs_t / torch.where(safe, basis.denom, 1.0), 0.0)
    return transpose(basis.S @ omega_t @ basis.T_inv)


def vertical(
    G: torch.Tensor, H: torch.Tensor, lam: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The vertical vector ``(GΛ, −HΛᵀ)`` ([derivation][vertical-space]), in the dtype of ``G``."""
    lam = lam.to(G.dtype)
    return G @ lam, -(H @ transpose(lam))


def project(
    G: torch.Tensor,
    H: torch.Tensor,
    uG: torch.Tensor,
    uH: torch.Tensor,
    gr: Grams,
    metric: str,
    basis: SylvesterBasis | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Metric-orthogonal projection onto the horizontal space
    ([derivation][horizontal-projection]).

    ``Π(ξ) = (ξ_G + GΛ, ξ_H − HΛᵀ)`` with ``Λ`` from
    [`horizontal_lambda`][quotient_manifolds.geometry.gl.horizontal_lambda]. Returned in the dtype
    of ``uG``.
    """
    out_dt = uG.dtype
    lam = horizontal_lambda(G, H, uG, uH, gr, metric, basis)
    dt, (G, H, uG, uH) = _work(G, H, uG, uH)
    vG, vH = vertical(G, H, lam)
    return (uG + vG).to(out_dt), (uH + vH).to(out_dt)


def egrad2rgrad(
    gG: torch.Tensor, gH: torch.Tensor, gr: Grams, metric: str
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Riemannian gradient in the total space, before the horizontal projection.

    inv: ``(∇_G P, ∇_H Q)``; mix: ``(∇_G Q⁻¹, ∇_H P⁻¹)`` (Alg. 1 line 10, App. C.2).
    For a GL-invariant loss the result is already horizontal.
    """
    out_dt = gG.dtype
    dt, (gG, gH) = _work(gG, gH)
    MG, MH = (gr.P, gr.Q) if metric == "inv" else (gr.Q_inv, gr.P_inv)
    return (gG @ MG.to(dt)).to(out_dt), (gH @ MH.to(dt)).to(out_dt)


def _christoffel_inv_factor(
    F: torch.Tensor, M_inv: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None
) -> torch.Tensor:
    # Γ(ξ,η)_F = −½[ξ M⁻¹(ηᵀF + Fᵀη) + η M⁻¹(ξᵀF + Fᵀξ)] + ½ F M⁻¹(ξᵀη + ηᵀξ)
    # (quadratic form, η = ξ: −ξ M⁻¹(ξᵀF + Fᵀξ) + F M⁻¹ ξᵀξ)
    if v is None:
        S = transpose(u) @ F
        return F @ (M_inv @ (transpose(u) @ u)) - u @ (M_inv @ (S + transpose(S)))
    Ft = transpose(F)
    a = u @ (M_inv @ (transpose(v) @ F + Ft @ v))
    b = v @ (M_inv @ (transpose(u) @ F + Ft @ u))
    c = F @ (M_inv @ (transpose(u) @ v + transpose(v) @ u))
    return 0.5 * (c - a - b)


def _christoffel_mix_factor(
    F: torch.Tensor,
    K: torch.Tensor,
    K_inv: torch.Tensor,
    uF: torch.Tensor,
    vF: torch.Tensor | None,
    uK: torch.Tensor,
    vK: torch.Tensor | None,
) -> torch.Tensor:
    # Γ(ξ,η)_G = ½[ξ_G(η_HᵀH + Hᵀη_H) + η_G(ξ_HᵀH + Hᵀξ_H)]Q⁻¹ − ½ G(ξ_Hᵀη_H + η_Hᵀξ_H)Q⁻¹
    # (quadratic form: ξ_G(ξ_HᵀH + Hᵀξ_H)Q⁻¹ − G ξ_Hᵀξ_H Q⁻¹)
    if vF is None or vK is None:  # the quadratic form (both are None together)
        S = transpose(uK) @ K
        return (uF @ ((S + transpose(S)) @ K_inv)) - F @ ((transpose(uK) @ uK) @ K_inv)
    Kt = transpose(K)
    a = uF @ (transpose(vK) @ K + Kt @ vK)
    b = vF @ (transpose(uK) @ K + Kt @ uK)
    c = F @ (transpose(uK) @ vK + transpose(vK) @ uK)
    return 0.5 * (a + b - c) @ K_inv


def christoffel(
    G: torch.Tensor,
    H: torch.Tensor,
    uG: torch.Tensor,
    uH: torch.Tensor,
    vG: torch.Tensor | None,
    vH: torch.Tensor | None,
    gr: Grams,
    metric: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The symmetric bilinear Christoffel form ``Γ_x(u, v)`` (Eq. 11/12;
    [derivation][christoffel-forms]).

    With ``v = None`` this is the quadratic form ``Γ_x(u, u)`` of Eq. 11 (inv)

    $$
    Γ_G = -ξ_G P^{-1}(ξ_G^{\top} G + G^{\top} ξ_G) + G P^{-1} ξ_G^{\top} ξ_G
    $$

    (and the same with ``H, Q``) or Eq. 12 (mix)

    $$
    Γ_G = ξ_G(ξ_H^{\top} H + H^{\top} ξ_H)Q^{-1} - G ξ_H^{\top} ξ_H Q^{-1},\quad
    Γ_H = ξ_H(ξ_G^{\top} G + G^{\top} ξ_G)P^{-1} - H ξ_G^{\top} ξ_G P^{-1},
    $$

    including the ``H`` part that the paper omits, computed with 4 instead of 6
    ``n×h×h`` products per factor.  The geodesic equation is ``γ̈ = −Γ_γ(γ̇, γ̇)``.
    """
    out_dt = uG.dtype
    dt, (G, H, uG, uH) = _work(G, H, uG, uH)
    if vG is not None and vH is not None:
        vG, vH = vG.to(dt), vH.to(dt)
    if metric == "inv":
        cG = _christoffel_inv_factor(G, gr.P_inv.to(dt), uG, vG)
        cH = _christoffel_inv_factor(H, gr.Q_inv.to(dt), uH, vH)
    else:
        cG = _christoffel_mix_factor(G, H, gr.Q_inv.to(dt), uG, vG, uH, vH)
        cH = _christoffel_mix_factor(H, G, gr.P_inv.to(dt), uH, vH, uG, vG)
    return cG.to(out_dt), cH.to(out_dt)




def _quadratic_coefficients(S: torch.Tensor, T: torch.Tensor, gr: Grams, metric: str
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    r"""$(A, B)$ with $\Gamma_{x}(u, u)_F = F A_F + u_F B_F$ at the base point, for the pair
    stacks $S = (G^\top u_G, H^\top u_H)$, $T = (u_G^\top u_G, u_H^\top u_H)$ (leading dim 2).

    inv (Eq. 11): $A_F = M_F^{-1} T_F$, $B_F = -M_F^{-1}(S_F + S_F^\top)$, $M = (P, Q)$;
    mix (Eq. 12): $A_G = -T_H Q^{-1}$, $B_G = (S_H + S_H^\top) Q^{-1}$ and $G \leftrightarrow H$.
    (`S` may be transposed: only $S + S^\top$ enters.)
    """
    dt = S.dtype
    Sig = S + transpose(S)
    if metric == "inv":
        Minv = torch.stack([gr.P_inv, gr.Q_inv]).to(dt)
        return Minv @ T, -(Minv @ Sig)
    Minv = torch.stack([gr.Q_inv, gr.P_inv]).to(dt)  # the other factor's inverse Gram
    T_o, Sig_o = T.flip(0), Sig.flip(0)
    return -(T_o @ Minv), Sig_o @ Minv


class _SecondOrder(torch.autograd.Function):
    """``x + u − ½Γ_x(u, u)`` of packed ``(N, n + m, h)`` points, ``Γ_F = F A_F + u_F B_F``
    (span form), for both factors at once.

    Forward: ``S = uᵀF``, ``T = uᵀu`` and ``y = F C₁ + u C₂`` with ``C₁ = I − ½A``,
    ``C₂ = I − ½B`` (four batched products per factor, written into one packed output).
    Backward: ``dC₁ = Fᵀ dy``, ``dC₂ = uᵀ dy`` and ``du = dy C₂ᵀ + F dSᵀ + u (dT + dTᵀ)``
    (accumulated in place into one packed gradient), with ``(dS, dT)`` from the ``h×h``
    coefficient map (differentiated by autograd, it is small). Reverse mode in ``u`` only.
    """

    @staticmethod
    def forward(ctx, u, x, n, gr, metric):
        parts = ((x[:, :n], u[:, :n]), (x[:, n:], u[:, n:]))
        N, h = u.shape[0], u.shape[-1]
        S = u.new_empty(2, N, h, h)  # uᵀF of both factors
        T = u.new_empty(2, N, h, h)  # uᵀu
        for i, (F, uF) in enumerate(parts):
            torch.bmm(transpose(uF), F, out=S[i])
            torch.bmm(transpose(uF), uF, out=T[i])
        A, B = _quadratic_coefficients(S, T, gr, metric)
        eye = eye_like(A)
        C1, C2 = eye - 0.5 * A, eye - 0.5 * B
        y = torch.empty_like(u)
        for i, ((F, uF), yF) in enumerate(zip(parts, (y[:, :n], y[:, n:]), strict=True)):
            torch.bmm(F, C1[i], out=yF)
            yF.baddbmm_(uF, C2[i])
        ctx.save_for_backward(S, T, C2, x, u)
        ctx.gr, ctx.metric, ctx.n = gr, metric, n
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        S, T, C2, x, u = ctx.saved_tensors
        n = ctx.n
        parts = ((x[:, :n], u[:, :n], dy[:, :n]), (x[:, n:], u[:, n:], dy[:, n:]))
        dC1, dC2 = torch.empty_like(S), torch.empty_like(S)
        for i, (F, uF, dyF) in enumerate(parts):
            torch.bmm(transpose(F), dyF, out=dC1[i])
            torch.bmm(transpose(uF), dyF, out=dC2[i])
        with torch.enable_grad():
            S_, T_ = S.detach().requires_grad_(), T.detach().requires_grad_()
            A, B = _quadratic_coefficients(S_, T_, ctx.gr, ctx.metric)
            dS, dT = torch.autograd.grad((A, B), (S_, T_), (-0.5 * dC1, -0.5 * dC2))
        du = torch.empty_like(u)
        for i, ((F, uF, dyF), duF) in enumerate(zip(parts, (du[:, :n], du[:, n:]),
                                                     strict=True)):
            # S_i = uᵀF, so d/du ⟨dS, uᵀF⟩ = F dSᵀ; d/du ⟨dT, uᵀu⟩ = u(dT + dTᵀ)
            torch.bmm(dyF, transpose(C2[i]), out=duF)
            duF.baddbmm_(F, transpose(dS[i])).baddbmm_(uF, dT[i] + transpose(dT[i]))
        return du, None, None, None, None


def second_order_packed(x: torch.Tensor, u: torch.Tensor, n: int, gr: Grams, metric: str
                        ) -> torch.Tensor:
    r"""The second-order retraction $x + u - \tfrac12 \Gamma_x(u, u)$ (Eq. 5) of packed points
    `x = [G; H]` `(..., n + m, h)` along `u` (same layout), as one packed tensor.

    The kernel of [`second_order`][quotient_manifolds.geometry.gl.second_order] without the
    split and join of the factors: one output and, in the backward pass, one gradient, with no
    other temporaries of the size of `x`. Differentiable in `u` (reverse mode; the base point
    is constant). Returned in the dtype of `u`.
    """
    out_dt = u.dtype
    dt, (x, u) = _work(x, u)
    batch = torch.broadcast_shapes(x.shape[:-2], u.shape[:-2])
    shape = (*batch, *u.shape[-2:])
    x, u = (t.expand(shape).reshape(-1, *shape[-2:]) for t in (x, u))
    h = shape[-1]
    flat = gr._replace(**{k: getattr(gr, k).expand(*batch, h, h).reshape(-1, h, h)
                          for k in ("P_inv", "Q_inv")})
    y = _SecondOrder.apply(u, x, n, flat, metric)
    return y.view(shape).to(out_dt)


def second_order(
    G: torch.Tensor,
    H: torch.Tensor,
    uG: torch.Tensor,
    uH: torch.Tensor,
    gr: Grams,
    metric: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The second-order retraction $x + u - \tfrac12 \Gamma_x(u, u)$ (Eq. 5) of both factors.

    Equal to `(G, H) + (uG, uH) − ½ christoffel(G, H, uG, uH, None, None, gr, metric)`, computed
    in the span form $\Gamma_F = F A_F + u_F B_F$ (the form the exact geodesic integrates) with a
    hand-written backward: four batched products per factor forward and five backward.
    Differentiable in `uG`, `uH` (reverse mode; the base point is constant). Returned in the
    dtype of `uG`. `quotient-manifolds verify` checks it against the metric-derived Γ and its
    gradient (the retraction bridge).
    """
    n = G.shape[-2]
    batch = torch.broadcast_shapes(G.shape[:-2], H.shape[:-2], uG.shape[:-2], uH.shape[:-2])

    def cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a.expand(*batch, *a.shape[-2:]),
                          b.to(a.dtype).expand(*batch, *b.shape[-2:])], dim=-2)

    y = second_order_packed(cat(G, H), cat(uG, uH), n, gr, metric)
    return y[..., :n, :], y[..., n:, :]


def _span_coefficients(P, S, T, metric: str, eps: float):
    # (A, B) with Γ_γ(γ̇, γ̇)_F = γ_F A_F + γ̇_F B_F from the Gram quantities P = γᵀγ,
    # S = γᵀγ̇, T = γ̇ᵀγ̇ of both factors (shape (2k, h, h): the k G factors, then the k H), and
    # M⁻¹ = (P + εI)⁻¹ of each factor (its own), needed by the VJP.  The Cholesky
    # factorisation and the inverse run in float64.  No checks and no host sync: a Gram
    # matrix that loses definiteness gives NaN, which the caller reports.
    P64 = P.to(GRAM_DTYPE)
    if eps:
        P64 = P64 + eps * eye_like(P64)
    # M⁻¹ = L⁻ᵀ L⁻¹: a triangular inverse and a product cost less than cholesky_inverse
    L = torch.linalg.cholesky_ex(P64).L
    L_inv = torch.linalg.solve_triangular(L, eye_like(L).expand_as(L), upper=False)
    M_inv = torch.bmm(transpose(L_inv), L_inv).to(P.dtype)
    Sig = S + transpose(S)
    if metric == "inv":
        # Γ_F = F P_F⁻¹ T_F − ξ_F P_F⁻¹ (S_F + S_Fᵀ)                          (Eq. 11)
        return M_inv @ T, torch.bmm(M_inv, Sig).neg_(), M_inv
    # Γ_G = −G T_H Q⁻¹ + ξ_G (S_H + S_Hᵀ) Q⁻¹, and G ↔ H  (Eq. 12; T, S + Sᵀ, Q symmetric)
    return _cross_bmm(T, M_inv, -1.0), _cross_bmm(Sig, M_inv), M_inv


def _cross_bmm(X: torch.Tensor, Y: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``Z_F = α X_o Y_o`` for ``(2k, …)`` stacks of G factors then H (o: the other factor)."""
    k = X.shape[0] // 2
    Z = X.new_empty(X.shape[0], X.shape[1], Y.shape[2])
    for dst, src in ((slice(None, k), slice(k, None)), (slice(k, None), slice(None, k))):
        torch.baddbmm(Z[dst], X[src], Y[src], beta=0, alpha=alpha, out=Z[dst])
    return Z


def _cross_addbmm_(Z: torch.Tensor, X: torch.Tensor, Y: torch.Tensor, alpha: float) -> None:
    """``Z_F += α X_o Y_F`` in place, for ``(2k, …)`` stacks as in `_cross_bmm`."""
    k = X.shape[0] // 2
    Z[:k].baddbmm_(X[k:], Y[:k], alpha=alpha)
    Z[k:].baddbmm_(X[:k], Y[k:], alpha=alpha)


def _span_field(y, metric: str, eps: float):
    # ẏ for y = (X, V, P, S, T):  Ẋ = V,  V̇ = −(XA + VB),  Ṗ = S + Sᵀ,  Ṡ = T − PA − SB,
    # Ṫ = −(C + Cᵀ) with C = SᵀA + TB; also returns (A, B, M⁻¹) for the VJP.
    X, V, P, S, T = y
    A, B, M_inv = _span_coefficients(P, S, T, metric, eps)
    dV = torch.baddbmm(torch.bmm(X, A), V, B).neg_()
    if metric == "inv" and not eps:  # P A = P P⁻¹ T = T
        dS = torch.bmm(S, B).neg_()
    else:
        dS = torch.baddbmm(T, P, A, alpha=-1).baddbmm_(S, B, alpha=-1)
    C = torch.baddbmm(torch.bmm(transpose(S), A), T, B)
    return [V, dV, S + transpose(S), dS, (C + transpose(C)).neg_()], (A, B, M_inv)


def _span_field_vjp(y, coef, g, metric: str, eps: float):
    # Adjoint of _span_field at y: the cotangent g of ẏ pulled back to y (a list like y).
    X, V, P, S, T = y
    A, B, M_inv = coef
    gX, gV, gP, gS, gT = g
    gC = (gT + transpose(gT)).neg_()
    aX = torch.bmm(gV, transpose(A)).neg_()
    aV = torch.baddbmm(gX, gV, transpose(B), alpha=-1)
    gA = torch.bmm(S, gC).baddbmm_(transpose(X), gV, alpha=-1)
    gB = torch.bmm(transpose(T), gC).baddbmm_(transpose(V), gV, alpha=-1).baddbmm_(
        transpose(S), gS, alpha=-1)
    aS = (gP + transpose(gP)).baddbmm_(gS, transpose(B), alpha=-1).baddbmm_(A, transpose(gC))
    if metric == "inv" and not eps:  # Ṡ = −S B
        aP = torch.zeros_like(P)
        aT = torch.bmm(gC, transpose(B))
    else:  # Ṡ = T − P A − S B
        gA.baddbmm_(transpose(P), gS, alpha=-1)
        aP = torch.bmm(gS, transpose(A)).neg_()
        aT = torch.baddbmm(gS, gC, transpose(B))
    # coefficients: A, B as functions of (M = P + εI, S + Sᵀ, T)
    if metric == "inv":  # A = M⁻¹T, B = −M⁻¹Σ
        aT.baddbmm_(M_inv, gA)
        aSig = torch.bmm(M_inv, gB).neg_()
        aP.sub_(M_inv @ torch.bmm(gA, transpose(A)).baddbmm_(gB, transpose(B)))
    else:  # A_F = −T_o M_o⁻¹, B_F = Σ_o M_o⁻¹ (o: the other factor)
        _cross_addbmm_(aT, gA, M_inv, -1.0)
        aSig = torch.zeros_like(aS)
        _cross_addbmm_(aSig, gB, M_inv, 1.0)
        _cross_addbmm_(aP, torch.bmm(transpose(A), gA).baddbmm_(transpose(B), gB), M_inv, -1.0)
    aS.add_(aSig).add_(transpose(aSig))
    return [aX, aV, aP, aS, aT]


def _rk4_stages(y, dt: float, metric: str, eps: float):
    # One RK4 step from y: the four stage inputs, their coefficients, and the new y.
    ys, ks, cs = [y], [], []
    for c in (0.5, 0.5, 1.0, None):
        k, coef = _span_field(ys[-1], metric, eps)
        ks.append(k)
        cs.append(coef)
        if c is not None:
            ys.append([torch.add(a, b, alpha=c * dt) for a, b in zip(y, k, strict=True)])
    new = [torch.add(a, torch.add(p, q, alpha=2).add_(r, alpha=2).add_(s), alpha=dt / 6)
           for a, p, q, r, s in zip(y, *ks, strict=True)]
    return ys, cs, new


class _SpanRK4(torch.autograd.Function):
    """RK4 on the ``h×h``-sized system of [`geodesic`][quotient_manifolds.geometry.gl.geodesic],
    with a hand-written adjoint.

    The backward pass is the exact discrete adjoint of the forward RK4 (so the gradient is
    that of the computed map); the forward keeps each stage's input and ``(A, B, M⁻¹)``.
    """

    @staticmethod
    def forward(ctx, P0, S0, T0, metric, eps, steps, h):
        n2 = P0.shape[0]
        I = torch.eye(h, dtype=P0.dtype, device=P0.device)
        Z = torch.zeros_like(I)
        X = torch.cat([I, Z]).expand(n2, 2 * h, h).contiguous()
        V = torch.cat([Z, I]).expand(n2, 2 * h, h).contiguous()
        y = [X, V, P0, S0, T0]
        dt = 1.0 / steps
        keep = any(ctx.needs_input_grad[:3])
        tape = []
        for _ in range(steps):
            ys, cs, y = _rk4_stages(y, dt, metric, eps)
            if keep:
                tape.append((ys, cs))
        ctx.tape, ctx.metric, ctx.eps, ctx.dt = tape, metric, eps, dt
        return y[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gX1):
        metric, eps, dt, tape = ctx.metric, ctx.eps, ctx.dt, ctx.tape  # kept: retain_graph
        a = [gX1.contiguous()] + [torch.zeros_like(t) for t in tape[0][0][0][1:]]
        for ys, cs in reversed(tape):
            # y⁺ = y + dt/6 (k₁ + 2k₂ + 2k₃ + k₄), y_{i+1} = y + c_i dt k_i (c = ½, ½, 1)
            out = [t.clone() for t in a]
            gk = [t * (dt / 6) for t in a]
            for i in (3, 2, 1, 0):
                ay = _span_field_vjp(ys[i], cs[i], gk, metric, eps)
                for o, t in zip(out, ay, strict=True):
                    o.add_(t)
                if i:
                    c = (0.5, 0.5, 1.0)[i - 1] * dt
                    w = dt / 3 if i > 1 else dt / 6
                    gk = [torch.mul(t, w).add_(s, alpha=c) for t, s in zip(a, ay, strict=True)]
            a = out
        return a[2], a[3], a[4], None, None, None, None


def geodesic(
    G: torch.Tensor,
    H: torch.Tensor,
    uG: torch.Tensor,
    uH: torch.Tensor,
    metric: str,
    eps: float = 0.0,
    steps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The geodesic ``γ(1)`` from ``(G, H)`` along ``(u_G, u_H)``, by RK4 on ``h×h`` states.

    Both Christoffel forms (Eq. 11/12) are ``Γ_F = F A + ξ_F B`` with ``h×h`` matrices
    ``A, B`` built from the Gram quantities ``P = γᵀγ``, ``S = γᵀγ̇``, ``T = γ̇ᵀγ̇`` of the
    two factors (inv: ``A = (P + εI)⁻¹T``, ``B = −(P + εI)⁻¹(S + Sᵀ)``; mix: ``−T_H Q⁻¹``
    and ``(S_H + S_Hᵀ) Q⁻¹`` for ``G``, and ``G ↔ H``).  So ``γ̈ = −Γ_γ(γ̇, γ̇)`` keeps
    ``(γ, γ̇)`` in the column span of ``[F₀, u_F]``: ``[γ, γ̇] = [F₀, u_F] [X, V]`` with
    ``X(0) = [I; 0]``, ``V(0) = [0; I]`` and the closed system

    $$
    \dot X = V,\quad \dot V = -(XA + VB),\quad \dot P = S + S^{\top},\quad
    \dot S = T - PA - SB,\quad \dot T = -(S^{\top}A + TB) - (S^{\top}A + TB)^{\top} .
    $$

    RK4 with ``steps`` fixed steps integrates it (beyond the paper, which has no closed form
    and uses the second-order retraction of Eq. 5): every stage costs
    ``O(h³)`` instead of the ``O(n h²)`` of RK4 on ``(γ, γ̇)`` in the full space, with no
    validation and no host sync; ``n×h`` products occur only at the start (``P, S, T``, in
    float64) and at the end ($γ(1) = F_{0} X_{\text{top}} + u_F X_{\text{bottom}}$).  The states run
    in the working dtype (float32, or float64 for float64 inputs), ``(P + εI)⁻¹`` is computed
    in float64.

    The gradient is the exact discrete adjoint of this RK4, hand-written (not taped by
    autograd): the forward keeps only each stage's input state and ``(A, B, (P + εI)⁻¹)``,
    and the backward is a few batched ``h×h`` products per stage (``docs/benchmarks.md``).
    Reverse mode only (no double backward, no forward mode).
    Returned in the dtype of ``uG``.
    """
    if steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps}")
    out_dt = uG.dtype
    dt, (G, H, uG, uH) = _work(G, H, uG, uH)
    batch = torch.broadcast_shapes(G.shape[:-2], H.shape[:-2], uG.shape[:-2], uH.shape[:-2])
    G, H, uG, uH = (t.expand(*batch, *t.shape[-2:]) for t in (G, H, uG, uH))
    h = G.shape[-1]

    def gram3(F: torch.Tensor, U: torch.Tensor):
        F, U = F.to(GRAM_DTYPE), U.to(GRAM_DTYPE)
        Ft = transpose(F)
        return Ft @ F, Ft @ U, transpose(U) @ U

    pairs = zip(gram3(G, uG), gram3(H, uH), strict=True)
    # (2k, h, h) stacks: the k G factors, then the k H factors
    P0, S0, T0 = (torch.stack(pair).to(dt).reshape(-1, h, h) for pair in pairs)
    X1 = _SpanRK4.apply(P0, S0, T0, metric, float(eps), int(steps), h)
    X1 = X1.view(2, *batch, 2 * h, h)
    yG = G @ X1[0, ..., :h, :] + uG @ X1[0, ..., h:, :]
    yH = H @ X1[1, ..., :h, :] + uH @ X1[1, ..., h:, :]
    return yG.to(out_dt), yH.to(out_dt)
