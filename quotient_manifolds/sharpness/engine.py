r"""Geodesic and adaptive sharpness of real PyTorch models (paper Eq. 4 and Eq. 1).

.. math::

    S^ρ_{max}(w) = \mathbb E_S \Big[ \max_{ξ ∈ \mathcal H_w,\ ‖ξ‖_w ≤ ρ}
        L_S(γ_ξ(1)) − L_S(w) \Big]

(spec §7.1), with ``γ_ξ(1) ≈ w + ξ − ½Γ_w(ξ, ξ)`` on the GL blocks (Eq. 5) and
``w + ξ`` on every other weight (spec §7.3).  The maximiser is found separately
for every batch by Auto-PGD (spec §8) and the per-batch increases are averaged.

Nothing is lost: the model is never written to.  Perturbed weights enter
through :func:`torch.func.functional_call` on detached clones; the computation
runs in eval mode inside ``try/finally`` that restores every submodule's
``training`` flag, whatever happens (exceptions, ``KeyboardInterrupt``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager

import geoopt
import torch
from torch import nn

from ..errors import EmptyDataError, InvalidRadiusError, NonFiniteError
from ..models import BlockSpec, ModelGeometry
from .apgd import apgd
from .distributed import ShardContext, SplitFn, resolve_shard
from .result import SharpnessResult
from .tangent_ball import TangentBall

__all__ = ["geodesic_sharpness", "adaptive_sharpness"]

LossFn = Callable[[nn.Module, object], torch.Tensor]


# -- plumbing -------------------------------------------------------------------
@contextmanager
def _eval_mode(model: nn.Module):
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for m, t in modes:
            m.training = t


class _LossModule(nn.Module):
    """``forward(batch) = loss_fn(model, batch)``, so ``functional_call`` can swap weights."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)


class _Evaluator:
    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        self.wrapper = _LossModule(model, loss_fn)
        self.buffers = {f"model.{n}": b.detach().clone() for n, b in model.named_buffers()}
        self.batch_index = 0

    def __call__(self, params: dict[str, torch.Tensor], batch) -> torch.Tensor:
        d = {f"model.{n}": t for n, t in params.items()}
        d.update(self.buffers)
        loss = torch.func.functional_call(self.wrapper, d, (batch,))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("loss_fn(model, batch) must return a scalar tensor")
        return loss.reshape(()).float() if loss.dtype in (torch.float16, torch.bfloat16) else (
            loss.reshape(()))


class _Progress:
    def __init__(self, label: str, total: int | None, enabled: bool) -> None:
        self.label, self.total, self.enabled, self.t0 = label, total, enabled, time.perf_counter()

    def update(self, b: int) -> None:
        if self.enabled:
            tot = f"/{self.total}" if self.total else ""
            dt = time.perf_counter() - self.t0
            sys.stderr.write(f"\r{self.label}: batch {b + 1}{tot} ({dt:.1f}s)")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _check_rho(rho: float) -> float:
    try:
        r = float(rho)
    except (TypeError, ValueError):
        r = float("nan")
    if not (r > 0 and math.isfinite(r)):
        raise InvalidRadiusError(
            f"rho must be a positive finite number, got {rho!r}; pass e.g. rho=0.1 "
            "(the radius of the perturbation ball ‖ξ‖ ≤ ρ)"
        )
    return r


def _finite(v: float, b: int, where: str) -> float:
    if not math.isfinite(v):
        raise NonFiniteError(
            f"the loss of batch {b} is {v} {where}; check that batch and the model "
            "(for a perturbed loss, use a smaller rho, or eps > 0 for near-singular blocks)"
        )
    return v


def _len(data) -> int | None:
    try:
        return len(data)
    except TypeError:
        return None


# -- problems ---------------------------------------------------------------------
class _GeodesicProblem:
    """Horizontal ξ in the metric ball of a :class:`ModelGeometry` (spec §7.3, §8.3)."""

    def __init__(self, geo: ModelGeometry, rho: float, ev: _Evaluator, batch, b: int) -> None:
        self.geo, self.rho, self.ev, self.batch, self.b = geo, rho, ev, batch, b
        self.k = 0

    def zeros(self):
        return self.geo.zeros()

    def loss_and_grad(self, xi):
        xs = [t.detach().requires_grad_(True) for t in xi]
        loss = self.ev(self.geo.perturbed_params(xs), self.batch)
        _finite(float(loss.detach()), self.b, f"at APGD iteration {self.k}")
        self.k += 1
        grads = torch.autograd.grad(loss, xs, allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads, strict=True)]
        return float(loss.detach()), grads

    def direction(self, xi, grad):
        r = self.geo.rgrad(grad)
        n = float(self.geo.ball_norm_of(r))
        return [t / n for t in r] if n > 0 else [torch.zeros_like(t) for t in r]

    def project(self, xi):
        return self.geo.project_ball(xi, self.rho)

    def norms(self, xi) -> dict:
        return self.geo.norms(xi)


class _AdaptiveProblem(_GeodesicProblem):
    """The reference adaptive baseline (spec §9): Euclidean ellipsoid projection or ℓ∞ box."""

    def __init__(self, geo, rho, ev, batch, b, c: torch.Tensor, norm: str) -> None:
        super().__init__(geo, rho, ev, batch, b)
        self.c, self.norm = c, norm

    def direction(self, xi, grad):
        g = grad[-1]
        if self.norm == "linf":
            return [g.sign() * self.c]
        n = float(g.norm())
        return [g * self.c / n] if n > 0 else [torch.zeros_like(g)]

    def project(self, xi):
        d = xi[-1]
        if self.norm == "linf":
            return [torch.maximum(torch.minimum(d, self.rho * self.c), -self.rho * self.c)]
        return [_ellipsoid_projection(d, self.c, self.rho)]

    def norms(self, xi) -> dict:
        d = xi[-1] / self.c
        v = float(d.abs().max()) if self.norm == "linf" and d.numel() else float(d.norm())
        return {"adaptive": v, "total": v}


def _ellipsoid_projection(
    y: torch.Tensor, c: torch.Tensor, rho: float, tol: float = 1e-5, max_iter: int = 200
) -> torch.Tensor:
    r"""Euclidean projection onto ``{δ : ‖δ ⊘ c‖₂ ≤ ρ}`` by bisection (reference code, §9).

    ``δ(λ) = y / (1 + 2λ/c²)``; bisect ``λ`` (start 0.1, upper bound 10,
    doubled while infeasible) until ``|‖δ ⊘ c‖ − ρ| < tol``.
    """
    a = y / c
    b = 2 / (c * c)

    buf = torch.empty_like(a)  # reused: fresh 10⁷-entry tensors cost page faults on CPU

    def wnorm(lam: float) -> float:  # ‖δ(λ) ⊘ c‖ = ‖a / (1 + λb)‖
        torch.mul(b, lam, out=buf).add_(1.0)
        return float(torch.linalg.vector_norm(torch.div(a, buf, out=buf)))

    if wnorm(0.0) <= rho:
        return y
    lo, hi, lam = 0.0, 10.0, 0.1
    while wnorm(hi) > rho and hi < 1e30:
        hi *= 2
    for _ in range(max_iter):
        v = wnorm(lam)
        if abs(v - rho) < tol:
            break
        if v > rho:
            lo = lam
        else:
            hi = lam
        lam = 0.5 * (lo + hi)
    if wnorm(lam) > rho:  # land inside when the tolerance is reached from outside
        lam = hi
    return y / (1 + 2 * lam / (c * c))


# -- driver -------------------------------------------------------------------------
def _run(
    method: str,
    model: nn.Module,
    loss_fn: LossFn,
    data: Iterable,
    geo: ModelGeometry,
    make_problem: Callable,
    *,
    rho: float,
    kind: str,
    n_iter: int,
    optimizer,
    seed: int | None,
    progress: bool,
    settings: dict,
    sampler: Callable | None = None,
    shard: ShardContext | None = None,
) -> SharpnessResult:
    t0 = time.perf_counter()
    shard = shard or ShardContext()
    shard.check_same(geo.base_points)
    gen = torch.Generator()
    gen.manual_seed(shard.common_seed(seed))
    ev = shard.evaluator(_Evaluator(model, loss_fn))
    per, base_l, max_l, pnorm, norms, n_evals = [], [], [], [], [], 0
    done: list[int] = []
    bar = _Progress(f"{method} sharpness", _len(data), progress and shard.main)
    with _eval_mode(model), torch.enable_grad():
        for b, batch in enumerate(data):
            if not shard.owns(b):  # shard="batches": another rank solves this batch
                if kind == "average":  # draw its samples, so later batches see the same ones
                    for _ in range(n_iter):
                        sampler(gen)
                continue
            with torch.no_grad():
                base = _finite(float(ev(geo.base, batch)), b, "at the unperturbed weights")
            prob = make_problem(ev, batch, b)
            if kind == "average":
                vals = []
                with torch.no_grad():
                    for k in range(n_iter):
                        xi = sampler(gen)
                        v = float(ev(geo.perturbed_params(xi), batch))
                        vals.append(_finite(v, b, f"at Gaussian sample {k}"))
                best, nrm = sum(vals) / len(vals), {}
                n_evals += n_iter
            elif optimizer is None:
                res = apgd(prob, rho, base, n_iter=n_iter)
                best, nrm = res.best_loss, prob.norms(res.best_xi)
                n_evals += n_iter
            else:
                best, xi = _run_optimizer(prob, geo, rho, optimizer, n_iter, base)
                nrm = prob.norms(xi)
                n_evals += n_iter + 1
            per.append(best - base)
            base_l.append(base)
            max_l.append(best)
            norms.append(nrm)
            pnorm.append(nrm.get("total", float("nan")))
            done.append(b)
            bar.update(b)
    bar.close()
    if shard.active:
        recs, n_evals, elapsed = shard.gather(
            list(zip(done, per, base_l, max_l, pnorm, norms, strict=True)), n_evals,
            time.perf_counter() - t0)
        done, per, base_l, max_l, pnorm, norms = (list(c) for c in zip(*recs, strict=True)) \
            if recs else ([], [], [], [], [], [])
        settings = {**settings, "shard": shard.mode, "world_size": shard.world_size}
    if not per:
        raise EmptyDataError(
            "data yielded no batch; pass a non-empty iterable of batches "
            "(e.g. a list, or a DataLoader over a non-empty data set)"
        )
    return SharpnessResult(
        value=sum(per) / len(per),
        per_batch=per,
        base_loss=base_l,
        max_loss=max_l,
        perturbation_norm=pnorm,
        method=method,
        kind=kind,
        settings=settings,
        blocks=[bl.describe() for bl in geo.blocks],
        fallbacks=[f.to_dict() for f in geo.fallbacks],
        norms=norms,
        n_evals=n_evals,
        elapsed_s=elapsed if shard.active else time.perf_counter() - t0,
    )


def _run_optimizer(prob: _GeodesicProblem, geo: ModelGeometry, rho: float, factory, n_iter: int,
                   base: float):
    """Maximise with a user geoopt optimizer on :class:`TangentBall` parameters."""
    ps = [geoopt.ManifoldParameter(torch.zeros_like(x0), manifold=TangentBall(M, x0, rho))
          for M, x0 in zip(geo.manifolds, geo.base_points, strict=True)]
    opt = factory(ps)
    best, best_xi = base, geo.zeros()
    for k in range(n_iter + 1):
        opt.zero_grad()
        loss = prob.ev(geo.perturbed_params(list(ps)), prob.batch)
        v = _finite(float(loss.detach()), prob.b, f"at optimizer step {k}")
        if v > best:
            best, best_xi = v, [p.detach().clone() for p in ps]
        if k == n_iter:
            break
        (-loss).backward()  # geoopt has no maximize
        opt.step()
        with torch.no_grad():  # the ball is global over all tensors (step post-processing)
            for p, q in zip(ps, geo.project_ball([p.detach() for p in ps], rho), strict=True):
                p.copy_(q)
    return best, best_xi


def _common_checks(rho, kind, n_iter) -> float:
    r = _check_rho(rho)
    if kind not in ("worst", "average"):
        raise ValueError(f"kind must be 'worst' or 'average', got {kind!r}")
    if int(n_iter) < 1:
        raise ValueError(f"n_iter must be a positive integer, got {n_iter}")
    return r


# -- public API -----------------------------------------------------------------------
def geodesic_sharpness(
    model: nn.Module,
    loss_fn: LossFn,
    data: Iterable,
    *,
    rho: float,
    metric: str = "inv",
    retraction: str = "second_order",
    kind: str = "worst",
    n_iter: int = 20,
    optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
    eps: float = 0.0,
    seed: int | None = None,
    progress: bool = True,
    adaptive_retraction: str = "first_order",
    adaptive_eps: float = 0.0,
    blocks: Sequence[BlockSpec] | None = None,
    declared: Iterable[BlockSpec] = (),
    allow_half: bool = False,
    ball_norm: str = "metric",
    exact_steps: int = 8,
    shard: str | None = None,
    split_batch: SplitFn | None = None,
    group=None,
) -> SharpnessResult:
    r"""Geodesic sharpness (paper Eq. 4, spec §7) of ``model`` on ``data``.

    Parameters
    ----------
    model : nn.Module
        Any model; never modified (weights, buffers, ``requires_grad``, modes).
    loss_fn : callable
        ``loss_fn(model, batch) -> scalar tensor``; e.g. ``lambda m, b: m(**b).loss``.
    data : iterable
        Batches; sharpness is the mean of the per-batch maxima.
    rho : float
        Radius of the horizontal tangent ball, ``‖ξ‖_w ≤ ρ`` (total norm, spec §7.3).
    metric : {"inv", "mix"}
        Metric of the GL blocks (Eq. 9 / 10).
    retraction : {"second_order", "exact", "first_order"}
        How GL blocks are perturbed: Eq. 5 (paper), RK4 geodesic, or ``w + ξ``.
    kind : {"worst", "average"}
        Worst case (APGD) or average over ``n_iter`` Gaussian horizontal samples
        with covariance ``ρ²`` × inverse metric (spec §7.2).
    n_iter : int
        APGD iterations (= gradient evaluations), optimizer steps, or samples.
    optimizer : callable, optional
        ``optimizer(params) -> geoopt optimizer`` on :class:`TangentBall`
        parameters (e.g. ``lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.05)``),
        run for ``n_iter`` steps instead of APGD.
    eps : float
        Gram relaxation of the GL blocks; ``0`` requires full-rank factors.
    seed : int, optional
        Seed of the Gaussian samples (``kind="average"``).
    progress : bool
        Print a progress line to stderr.
    adaptive_retraction, adaptive_eps
        Perturbation and ``ε`` of the adaptive geometry of all other weights.
    blocks, declared
        Use these blocks instead of / in addition to the discovered ones.
    allow_half : bool
        Accept a float16/bfloat16 model (block algebra in float32).
    ball_norm : {"metric", "adaptive"}
        ``"adaptive"`` is the App. G ablation (a) (spec §12.7): the ball and the
        step normalisation use ``‖ξ ⊘ |w|‖₂`` on every entry, GL blocks included,
        while ξ stays horizontal and the perturbation keeps its Γ term.  Worst case
        only.
    exact_steps : int
        RK4 steps of ``retraction="exact"`` (default 8, as ``GLQuotient``).  The error per
        block is ``≲ 1.4e-3 (‖ξ‖/steps)⁴`` for unit-scale factors, so 4 steps (1.4× the
        cost of the second-order retraction on MiniLM instead of 2×) suffice for small
        radii; but the mix metric is not scale invariant, and on small weights a small
        ``ρ`` can still be a long geodesic (``docs/benchmarks.md``: a tiny ViT at
        ``ρ = 0.05`` needs 8).
    shard : {None, "none", "batches", "within_batch"}
        Data parallelism over the ranks of an initialised ``torch.distributed`` group
        (``torchrun``; see ``docs/distributed.md``).  ``"batches"`` (the default when a
        group of more than one rank exists): rank ``r`` solves the batches ``b ≡ r mod W``
        and the records are gathered.  ``"within_batch"``: each rank takes a slice of every
        batch; losses are combined as ``Σ_r (n_r/N) L_r`` (``loss_fn`` must return a mean
        over its batch) and gradients of ξ summed over ranks.  Every rank returns the same
        result; per-batch values equal a single-process run's (``within_batch``: to float
        rounding).  Without a group, everything runs on this process.
    split_batch : callable, optional
        ``split_batch(batch, rank, world_size) -> (slice, n_examples)`` for
        ``shard="within_batch"``; default: every tensor cut along dim 0.
    group : ProcessGroup, optional
        The process group (default: the world).

    Returns
    -------
    SharpnessResult
    """
    r = _common_checks(rho, kind, n_iter)
    ctx = resolve_shard(shard, split_batch, group)
    if ball_norm == "adaptive" and kind != "worst":
        raise ValueError("ball_norm='adaptive' is an ablation of the worst case; use kind='worst'")
    geo = ModelGeometry(model, metric, eps=eps, retraction=retraction, adaptive_eps=adaptive_eps,
                        adaptive_retraction=adaptive_retraction, blocks=blocks,
                        declared=declared, allow_half=allow_half, ball_norm=ball_norm,
                        exact_steps=exact_steps)
    settings = dict(rho=r, metric=metric, retraction=retraction, kind=kind, n_iter=n_iter,
                    optimizer=None if optimizer is None else repr(optimizer), eps=eps, seed=seed,
                    adaptive_retraction=adaptive_retraction, adaptive_eps=adaptive_eps,
                    ball_norm=ball_norm, solver="apgd" if optimizer is None else "geoopt",
                    step_size=2 * r,
                    momentum=0.75, init="zero", masked_zero_weights=geo.n_masked_zeros,
                    geometry=geo.describe()["groups"])
    if retraction == "exact":
        settings["exact_steps"] = int(exact_steps)
    return _run(
        "geodesic", model, loss_fn, data, geo,
        lambda ev, batch, b: _GeodesicProblem(geo, r, ev, batch, b),
        rho=r, kind=kind, n_iter=n_iter, optimizer=optimizer, seed=seed, progress=progress,
        settings=settings, sampler=lambda g: geo.sample(r, g), shard=ctx,
    )


def adaptive_sharpness(
    model: nn.Module,
    loss_fn: LossFn,
    data: Iterable,
    *,
    rho: float,
    norm: str = "l2",
    kind: str = "worst",
    n_iter: int = 20,
    adaptive: bool = True,
    projection: str = "euclidean",
    optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
    eps: float = 0.0,
    seed: int | None = None,
    progress: bool = True,
    allow_half: bool = False,
    shard: str | None = None,
    split_batch: SplitFn | None = None,
    group=None,
) -> SharpnessResult:
    r"""Adaptive sharpness (Eq. 1; Andriushchenko et al. 2023, reference algorithm, spec §9).

    .. math::

        S = \mathbb E_S \Big[\max_{‖δ ⊘ |w|‖_p ≤ ρ} L_S(w + δ) − L_S(w)\Big]

    Parameters not listed below are as in :func:`geodesic_sharpness`.

    Parameters
    ----------
    norm : {"l2", "linf"}
        ℓ2: step ``δ + η ∇/‖∇‖₂ ⊙ |w|`` then Euclidean projection onto the
        ellipsoid by bisection; ℓ∞: step ``δ + η sign(∇) ⊙ |w|`` then clipping.
    adaptive : bool
        ``False``: plain Euclidean sharpness (``|w|`` replaced by 1).
    projection : {"euclidean", "metric"}
        ``"metric"`` (ℓ2 only): the principled variant — Riemannian gradient
        ``w² ⊙ ∇`` normalised in the metric norm, and the metric (radial)
        projection, i.e. geodesic sharpness with no GL block.
    kind : {"worst", "average"}
        Average: ``n_iter`` samples ``δ = ρ|w| ⊙ N(0, 1)`` (ℓ2) or ``ρ|w| ⊙ U(−1, 1)`` (ℓ∞).
    eps : float
        With ``eps = 0`` zero weights cannot move and are excluded; ``eps > 0``
        uses ``c = √(w² + eps)``.
    """
    r = _common_checks(rho, kind, n_iter)
    ctx = resolve_shard(shard, split_batch, group)
    if norm not in ("l2", "linf"):
        raise ValueError(f"norm must be 'l2' or 'linf', got {norm!r}")
    if projection not in ("euclidean", "metric"):
        raise ValueError(f"projection must be 'euclidean' or 'metric', got {projection!r}")
    if projection == "metric" and (norm != "l2" or not adaptive):
        raise ValueError("projection='metric' needs norm='l2' and adaptive=True")
    geo = ModelGeometry(model, "inv", blocks=[], adaptive_eps=eps if adaptive else 1.0,
                        adaptive_retraction="first_order", allow_half=allow_half, warn=False)
    c = geo.c2.sqrt() if adaptive else torch.ones_like(geo.w0)
    settings = dict(rho=r, norm=norm, kind=kind, n_iter=n_iter, adaptive=adaptive,
                    projection=projection, eps=eps, seed=seed, step_size=2 * r, momentum=0.75,
                    init="zero", optimizer=None if optimizer is None else repr(optimizer),
                    masked_zero_weights=geo.n_masked_zeros)
    if projection == "metric":
        def make(ev, batch, b):
            return _GeodesicProblem(geo, r, ev, batch, b)
    else:
        def make(ev, batch, b):
            return _AdaptiveProblem(geo, r, ev, batch, b, c, norm)

    def sample(g):
        z = (torch.randn(c.shape, generator=g, dtype=c.dtype) if norm == "l2"
             else torch.rand(c.shape, generator=g, dtype=c.dtype) * 2 - 1).to(c.device)
        return [r * c * z]

    res = _run("adaptive", model, loss_fn, data, geo, make, rho=r, kind=kind, n_iter=n_iter,
               optimizer=optimizer, seed=seed, progress=progress, settings=settings,
               sampler=sample, shard=ctx)
    return res
