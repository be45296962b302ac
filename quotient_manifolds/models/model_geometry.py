r"""The quotient geometry of a whole model: GL blocks batched by shape, plus adaptive weights.

:class:`ModelGeometry` gathers every discovered (or declared) block of a model
into one ``(B, n + m, h)`` tensor per block shape — e.g. all QK heads of all
layers of a BERT — so that horizontal projections, Christoffel terms and norms
are single batched kernel calls (no Python loop over heads).  Every parameter
entry that no block claims belongs to one flat vector with the elementwise
adaptive metric ``ξ²/(w² + ε)`` (spec §6.6, §7.3).

A tangent vector ``ξ`` is a list ``[ξ_1, …, ξ_K, ξ_w]``: one tensor per block
group (shaped like its base point) and the flat adaptive part.  The total norm
is spec §7.3:

.. math::

    ‖ξ‖² = Σ_{groups} Σ_{heads} ‖(ξ_G, ξ_H)‖²_{inv/mix} + ‖ξ_w ⊘ \sqrt{w² + ε}‖²_2 .

All geometric objects are evaluated at the fixed base point ``w⁽⁰⁾``; its Gram
matrices, inverses and (for ``inv``) the Sylvester eigenbasis are computed once
in the constructor.

Zero weights.  With ``adaptive_eps = 0`` the adaptive metric is undefined at
``w = 0``; such entries are excluded from the flat vector and never move (the
reference code behaves the same way, since its perturbation is ``δ ⊙ |w|``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import BlockSpecError, PrecisionError, RankDeficientError, ZeroWeightError
from ..geometry import adaptive as am
from ..geometry import gl
from ..geometry.linalg import transpose
from ..manifolds import AdaptiveEuclidean, GLQuotient
from .blocks import BlockSpec, claimed_mask, gather_block, scatter_block
from .discovery import Fallback, discover

__all__ = ["BlockGroup", "AdaptiveEntry", "ModelGeometry", "HALF_DTYPES"]

HALF_DTYPES = (torch.float16, torch.bfloat16)
RETRACTIONS = ("first_order", "second_order", "exact")


@dataclass
class BlockGroup:
    """All blocks of one shape ``(n, m, h)``, batched along dim 0."""

    n: int
    m: int
    h: int
    blocks: list[BlockSpec]
    manifold: GLQuotient
    x0: torch.Tensor
    grams: gl.Grams
    basis: gl.SylvesterBasis | None = None
    chol: dict = field(default_factory=dict)
    c2: torch.Tensor | None = None  # w² + ε of the block entries (ball_norm="adaptive")

    @property
    def G(self) -> torch.Tensor:
        return self.x0[:, : self.n]

    @property
    def H(self) -> torch.Tensor:
        return self.x0[:, self.n :]


@dataclass
class AdaptiveEntry:
    """Where a parameter's free entries sit in the flat adaptive vector."""

    name: str
    start: int
    stop: int
    index: torch.Tensor | None  # None: the whole parameter is free


class ModelGeometry:
    r"""Quotient geometry of a model at its current weights (the base point).

    Parameters
    ----------
    model : nn.Module
        The model; only read (its weights are cloned).
    metric : {"inv", "mix"}
        Metric of the GL blocks (Eq. 9 / 10).
    eps : float
        Gram relaxation of the GL blocks (spec §5.3.1).
    retraction : {"first_order", "second_order", "exact"}
        Perturbation of the GL blocks: ``w + ξ``, ``w + ξ − ½Γ_w(ξ, ξ)`` (Eq. 5,
        the paper's choice) or the RK4 geodesic.
    adaptive_eps : float
        ``ε`` of the adaptive metric ``ξ²/(w² + ε)`` of all other weights.
    adaptive_retraction : {"first_order", "second_order", "exact"}
        Perturbation of all other weights; first order by default (as in the paper).
    blocks : sequence of BlockSpec, optional
        Use exactly these blocks instead of discovering them (``[]``: none).
    declared : iterable of BlockSpec
        Extra user blocks (:func:`~quotient_manifolds.models.blocks.declare_block`).
    allow_half : bool
        Accept float16/bfloat16 models; tangent vectors and all block algebra
        then run in float32.  Otherwise :class:`PrecisionError` is raised.
    warn : bool
        Emit the discovery warnings.
    ball_norm : {"metric", "adaptive"}
        Norm of the perturbation ball and of the step normalisation.  ``"metric"``
        (default) is spec §7.3; ``"adaptive"`` is the App. G ablation (a): every
        entry, GL blocks included, is measured by ``‖ξ ⊘ \sqrt{w² + ε}‖₂`` while ξ stays
        horizontal for the block metric (a block entry with ``w = 0`` and ``ε = 0``
        raises :class:`ZeroWeightError`).
    exact_steps : int
        RK4 steps of the exact retraction of the GL blocks (``GLQuotient(steps=…)``);
        the error is ``≲ 1.4e-3 (‖ξ‖/steps)⁴`` (``docs/benchmarks.md``).
    """

    def __init__(
        self,
        model: nn.Module,
        metric: str = "inv",
        *,
        eps: float = 0.0,
        retraction: str = "second_order",
        adaptive_eps: float = 0.0,
        adaptive_retraction: str = "first_order",
        blocks: Sequence[BlockSpec] | None = None,
        declared: Iterable[BlockSpec] = (),
        allow_half: bool = False,
        warn: bool = True,
        ball_norm: str = "metric",
        exact_steps: int = 8,
    ) -> None:
        if metric not in gl.METRICS:
            raise ValueError(f"metric must be one of {gl.METRICS}, got {metric!r}")
        for r in (retraction, adaptive_retraction):
            if r not in RETRACTIONS:
                raise ValueError(f"retraction must be one of {RETRACTIONS}, got {r!r}")
        if ball_norm not in ("metric", "adaptive"):
            raise ValueError(f"ball_norm must be 'metric' or 'adaptive', got {ball_norm!r}")
        self.ball_norm = ball_norm
        self.exact_steps = int(exact_steps)
        if eps < 0 or adaptive_eps < 0:
            raise ValueError("eps and adaptive_eps must be non-negative")
        self.metric, self.eps, self.retraction = metric, float(eps), retraction
        self.adaptive_eps, self.adaptive_retraction = float(adaptive_eps), adaptive_retraction
        self.base: dict[str, torch.Tensor] = {
            n: p.detach().clone() for n, p in model.named_parameters()
        }
        floats = [t.dtype for t in self.base.values() if t.is_floating_point()]
        half = [d for d in floats if d in HALF_DTYPES]
        if half and not allow_half:
            raise PrecisionError(
                f"the model has {half[0]} parameters; the h×h block algebra must not run in "
                "half precision. Convert it with model.float() (or .double()), or pass "
                "allow_half=True to keep the model in half precision and run the block "
                "algebra and perturbations in float32."
            )
        self.dtype = torch.float64 if floats and all(d == torch.float64 for d in floats) else (
            torch.float32)
        if blocks is None:
            # GL(h) blocks only until the subgroup quotient is wired in (symmetry="paper")
            sym = discover(model, symmetry="paper", declared=declared, warn=warn)
            self.blocks, self.fallbacks = list(sym.blocks), list(sym.fallbacks)
        else:
            self.blocks = [b.resolved(self.base) for b in list(blocks) + list(declared)]
            self.fallbacks: list[Fallback] = []
        for b in self.blocks:
            if b.group is not None:
                raise BlockSpecError(
                    f"block {b.kind!r} at {b.module!r} has a restricted group {b.group!r}; "
                    "this geometry supports full GL(h) blocks only"
                )
        self._check_overlap()
        self.groups = self._build_groups()
        self._build_adaptive()
        if ball_norm == "adaptive":
            for g in self.groups:
                self._block_c2(g)  # fail early on zero block entries

    # -- construction -----------------------------------------------------
    def _check_overlap(self) -> None:
        seen: dict[str, torch.Tensor] = {}
        for b in self.blocks:
            for name, m in claimed_mask(b, self.base).items():
                prev = seen.get(name)
                if prev is not None and bool((prev & m).any()):
                    raise BlockSpecError(
                        f"two blocks claim the same entries of {name!r} (second: {b.kind} at "
                        f"{b.module!r}); each weight may belong to one GL block only"
                    )
                seen[name] = m if prev is None else prev | m
        self.claimed = seen

    def _build_groups(self) -> list[BlockGroup]:
        by_shape: dict[tuple[int, int, int], list[BlockSpec]] = {}
        for b in self.blocks:
            by_shape.setdefault((b.n, b.m, b.h), []).append(b)
        groups = []
        for (n, m, h), blocks in by_shape.items():
            x0 = torch.cat([gather_block(b, self.base).to(self.dtype) for b in blocks])
            man = GLQuotient(n, m, self.metric, self.eps, self.retraction, validate=False,
                             steps=self.exact_steps)
            G, H = x0[:, :n], x0[:, n:]
            try:
                grams = gl.grams(G, H, self.eps)
            except RankDeficientError as e:
                raise RankDeficientError(self._name_rank_deficient(blocks, str(e))) from None
            need = self.metric == "inv" or self.eps > 0
            basis = gl.sylvester_basis(grams, self.metric) if need else None
            groups.append(BlockGroup(n, m, h, blocks, man, x0, grams, basis))
        return groups

    def _name_rank_deficient(self, blocks: list[BlockSpec], msg: str) -> str:
        bad = []
        for b in blocks:
            x = gather_block(b, self.base).to(self.dtype)
            for i in range(b.heads):
                try:
                    gl.grams(x[i : i + 1, : b.n], x[i : i + 1, b.n :], self.eps)
                except RankDeficientError:
                    bad.append(f"{b.kind} at {b.module!r} head {i}")
        where = ", ".join(bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
        return f"{msg} Rank-deficient block(s): {where or 'unknown'}."

    def _device(self) -> torch.device:
        """Device of the model's parameters (CPU for a model without any)."""
        return next(iter(self.base.values())).device if self.base else torch.empty(0).device

    def _build_adaptive(self) -> None:
        entries, pieces, start, masked = [], [], 0, 0
        for name, w in self.base.items():
            if not w.is_floating_point():
                continue
            free = ~self.claimed[name] if name in self.claimed else None
            if self.adaptive_eps == 0:
                # w² must be positive, not only w: tiny float32 weights (|w| < 1e-22)
                # square to 0, which would make ξ²/w² a 0/0 (seen in all-MiniLM-L6-v2).
                nz = am.scale2(w.to(self.dtype), 0.0) > 0
                masked += int((~nz if free is None else (~nz & free)).sum())
                free = nz if free is None else free & nz
            if free is None or bool(free.all()):
                idx, vals = None, w.reshape(-1)
            elif bool(free.any()):
                idx = free.reshape(-1).nonzero().squeeze(1)
                vals = w.reshape(-1)[idx]
            else:
                continue
            entries.append(AdaptiveEntry(name, start, start + vals.numel(), idx))
            pieces.append(vals.to(self.dtype))
            start += vals.numel()
        self.entries = entries
        self.w0 = torch.cat(pieces) if pieces else torch.zeros(0, dtype=self.dtype,
                                                               device=self._device())
        self.c2 = am.scale2(self.w0, self.adaptive_eps)
        self.n_masked_zeros = masked
        self.adaptive = AdaptiveEuclidean(self.adaptive_eps, self.adaptive_retraction,
                                          ndim=1, validate=False)

    # -- tangent vectors ----------------------------------------------------
    @property
    def base_points(self) -> list[torch.Tensor]:
        """``[x0_1, …, x0_K, w0]``: the base point in the tangent-list layout."""
        return [g.x0 for g in self.groups] + [self.w0]

    @property
    def manifolds(self) -> list:
        """The manifold of each entry of a tangent list."""
        return [g.manifold for g in self.groups] + [self.adaptive]

    def zeros(self) -> list[torch.Tensor]:
        """The zero tangent vector."""
        return [torch.zeros_like(x) for x in self.base_points]

    def inner(self, u: Sequence[torch.Tensor], v: Sequence[torch.Tensor]) -> torch.Tensor:
        """Total metric ``⟨u, v⟩`` (spec §7.3), a 0-d tensor."""
        total = (u[-1] * v[-1] / self.c2).sum()
        for g, a, b in zip(self.groups, u, v, strict=False):
            aG, aH, bG, bH = a[:, : g.n], a[:, g.n :], b[:, : g.n], b[:, g.n :]
            total = total + gl.inner(g.G, g.H, aG, aH, bG, bH, g.grams, self.metric).sum()
        return total

    def norm(self, u: Sequence[torch.Tensor]) -> torch.Tensor:
        """Total Riemannian norm ``‖u‖``."""
        return self.inner(u, u).clamp_min(0).sqrt()

    def ball_norm_of(self, u: Sequence[torch.Tensor]) -> torch.Tensor:
        """The norm that defines the perturbation ball (see ``ball_norm``)."""
        if self.ball_norm == "metric":
            return self.norm(u)
        total = (u[-1] ** 2 / self.c2).sum()
        for g, a in zip(self.groups, u, strict=False):
            total = total + (a**2 / self._block_c2(g)).sum()
        return total.clamp_min(0).sqrt()

    def _block_c2(self, g: BlockGroup) -> torch.Tensor:
        if g.c2 is None:
            c2 = g.x0.to(self.dtype) ** 2 + self.adaptive_eps
            if bool((c2 == 0).any()):
                names = sorted({p for b in g.blocks for p in b.params})[:4]
                raise ZeroWeightError(
                    f"ball_norm='adaptive' measures GL-block entries by ξ/|w|, but blocks with "
                    f"parameters {names} have zero entries (often untrained biases); pass "
                    f"adaptive_eps > 0 to use ξ²/(w² + ε)"
                )
            g.c2 = c2
        return g.c2

    def norms(self, u: Sequence[torch.Tensor]) -> dict[str, float]:
        """Norm of the block part, the adaptive part and the total (in the ball norm)."""
        if self.ball_norm == "adaptive":
            blocks = sum(((a**2 / self._block_c2(g)).sum()
                          for g, a in zip(self.groups, u, strict=False)),
                         torch.zeros((), dtype=self.dtype))
        else:
            blocks = sum((self._group_sq(g, a) for g, a in zip(self.groups, u, strict=False)),
                         torch.zeros((), dtype=self.dtype))
        ad = (u[-1] ** 2 / self.c2).sum()
        return {"blocks": float(blocks.sqrt()), "adaptive": float(ad.sqrt()),
                "total": float((blocks + ad).sqrt())}

    def _group_sq(self, g: BlockGroup, a: torch.Tensor) -> torch.Tensor:
        aG, aH = a[:, : g.n], a[:, g.n :]
        return gl.inner(g.G, g.H, aG, aH, aG, aH, g.grams, self.metric).sum()

    def proj(self, u: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per-block metric-orthogonal horizontal projection Π (identity on ``ξ_w``)."""
        out = []
        for g, a in zip(self.groups, u, strict=False):
            pG, pH = gl.project(g.G, g.H, a[:, : g.n], a[:, g.n :], g.grams, self.metric,
                                g.basis)
            out.append(torch.cat([pG, pH], dim=-2))
        return out + [u[-1]]

    def rgrad(self, egrad: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        r"""Horizontal Riemannian gradient: ``Π(∇_G P, ∇_H Q)`` (inv) / ``Π(∇_G Q⁻¹, ∇_H P⁻¹)``
        (mix) per block; ``(w² + ε) ⊙ ∇`` on the adaptive part (Alg. 1 lines 10, 12).

        With ``ball_norm="adaptive"`` the ascent direction is the gradient of the
        adaptive norm on every entry, ``Π((w² + ε) ⊙ ∇)``: normalising the block
        metric's gradient by the elementwise norm instead put almost the whole budget
        on the blocks and found 8× smaller maxima (App. G ablation (a))."""
        if self.ball_norm == "adaptive":
            conv = [self._block_c2(g) * e for g, e in zip(self.groups, egrad, strict=False)]
            return self.proj(conv + [None])[:-1] + [self.c2 * egrad[-1]]
        conv = []
        for g, e in zip(self.groups, egrad, strict=False):
            rG, rH = gl.egrad2rgrad(e[:, : g.n], e[:, g.n :], g.grams, self.metric)
            conv.append(torch.cat([rG, rH], dim=-2))
        return self.proj(conv + [None])[:-1] + [self.c2 * egrad[-1]]

    def scale_to_ball(self, u: Sequence[torch.Tensor], radius: float) -> list[torch.Tensor]:
        r"""Radial rescale ``ξ ← ξ · min(1, ρ/‖ξ‖)``."""
        nrm = float(self.ball_norm_of(u))
        if nrm <= radius or nrm == 0.0:
            return list(u)
        return [a * (radius / nrm) for a in u]

    def project_ball(self, u: Sequence[torch.Tensor], radius: float) -> list[torch.Tensor]:
        """Metric projection onto ``{ξ horizontal, ‖ξ‖ ≤ ρ}``: Π then radial rescale (§7.3)."""
        return self.scale_to_ball(self.proj(u), radius)

    def sample(self, radius: float, generator: torch.Generator | None = None) -> list[torch.Tensor]:
        r"""Gaussian horizontal vector with covariance ``ρ²`` × inverse metric on ``H`` (§7.2).

        ``z ~ N(0, I)`` mapped by a square root of the inverse metric (inv:
        ``z_G L_Pᵀ``, ``z_H L_Qᵀ``; mix: with ``Q⁻¹``, ``P⁻¹``; adaptive:
        ``z ⊙ √(w² + ε)``), then projected by Π.
        """
        out = []
        for g in self.groups:
            if not g.chol:
                gr = g.grams
                a, b = (gr.P, gr.Q) if self.metric == "inv" else (gr.Q_inv, gr.P_inv)
                # factors of the float64 Grams, cast to the tangent dtype (float32 models)
                g.chol = {"G": torch.linalg.cholesky(a).to(self.dtype),
                          "H": torch.linalg.cholesky(b).to(self.dtype)}
            # drawn on the generator's device (CPU by default), then moved: the same
            # samples whatever device the model is on
            z = torch.randn(g.x0.shape, generator=generator, dtype=self.dtype).to(g.x0.device)
            zG = z[:, : g.n] @ transpose(g.chol["G"])
            zH = z[:, g.n :] @ transpose(g.chol["H"])
            out.append(torch.cat([zG, zH], dim=-2))
        zw = torch.randn(self.w0.shape, generator=generator, dtype=self.dtype).to(
            self.w0.device) * self.c2.sqrt()
        return [radius * a for a in self.proj(out + [zw])]

    # -- perturbed weights ----------------------------------------------------
    def perturbed_points(self, u: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        r"""Points reached from the base point along ``u`` by the chosen retractions.

        GL blocks (second order, Eq. 5): ``x₀ + ξ − ½Γ_{x₀}(ξ, ξ)``, or the RK4 geodesic
        (``exact``, :func:`~quotient_manifolds.geometry.gl.geodesic`, ``exact_steps``
        steps); adaptive weights (first order): ``w + ξ_w``.  Differentiable in ``u``.
        """
        out = []
        for g, a in zip(self.groups, u, strict=False):
            if self.retraction == "first_order":
                out.append(g.x0 + a)
            elif self.retraction == "second_order":
                aG, aH = a[:, : g.n], a[:, g.n :]
                cG, cH = gl.christoffel(g.G, g.H, aG, aH, None, None, g.grams, self.metric)
                out.append(g.x0 + a - 0.5 * torch.cat([cG, cH], dim=-2))
            else:  # the base point's rank was checked once, in the constructor
                yG, yH = gl.geodesic(g.G, g.H, a[:, : g.n], a[:, g.n :], self.metric, self.eps,
                                     self.exact_steps)
                out.append(torch.cat([yG, yH], dim=-2))
        w, xi = self.w0, u[-1]
        if self.adaptive_retraction == "first_order":
            out.append(w + xi)
        elif self.adaptive_retraction == "second_order":
            out.append(w + xi - 0.5 * am.christoffel(w, xi, xi, self.adaptive_eps))
        else:
            out.append(am.geodesic(w, xi, self.adaptive_eps))
        return out

    def to_params(self, points: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full parameter dict with the given points written in (out of place).

        Parameters not touched keep the cloned base tensors.  Differentiable in
        ``points``; the model's own parameters are never read or written.
        """
        new = dict(self.base)
        # One split per tensor, not one slice per parameter: the backward of a split is a
        # single concatenation, while every slice's backward materialises a zero tensor the
        # size of the whole flat vector (quadratic in the number of parameters).
        pieces = torch.split(points[-1], [e.stop - e.start for e in self.entries])
        for e, piece in zip(self.entries, pieces, strict=True):
            base = self.base[e.name]
            piece = piece.to(base.dtype)
            if e.index is None:
                new[e.name] = piece.view(base.shape)
            else:
                new[e.name] = base.reshape(-1).index_copy(0, e.index, piece).view(base.shape)
        for g, x in zip(self.groups, points, strict=False):
            for b, rows in zip(g.blocks, torch.split(x, [b.heads for b in g.blocks]), strict=True):
                scatter_block(b, rows, new)
        return new

    def perturbed_params(self, u: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``to_params(perturbed_points(u))``."""
        return self.to_params(self.perturbed_points(u))

    def gather(self, params: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Points of an arbitrary parameter dict, in the tangent-list layout."""
        out = [torch.cat([gather_block(b, params).to(self.dtype) for b in g.blocks])
               for g in self.groups]
        pieces = [params[e.name].reshape(-1) if e.index is None
                  else params[e.name].reshape(-1)[e.index] for e in self.entries]
        out.append(torch.cat([p.to(self.dtype) for p in pieces]) if pieces
                   else torch.zeros(0, dtype=self.dtype, device=self.w0.device))
        return out

    # -- reporting -------------------------------------------------------------
    def describe(self) -> dict:
        """Blocks, groups, fallbacks and adaptive sizes, JSON-friendly."""
        return {
            "metric": self.metric,
            "eps": self.eps,
            "retraction": self.retraction,
            "adaptive_eps": self.adaptive_eps,
            "ball_norm": self.ball_norm,
            "adaptive_retraction": self.adaptive_retraction,
            "blocks": [b.describe() for b in self.blocks],
            "groups": [{"n": g.n, "m": g.m, "h": g.h, "count": int(g.x0.shape[0])}
                       for g in self.groups],
            "fallbacks": [f.to_dict() for f in self.fallbacks],
            "adaptive_entries": int(self.w0.numel()),
            "masked_zero_weights": self.n_masked_zeros,
        }
