r"""Geodesic and adaptive sharpness of real PyTorch models (paper Eq. 4 and Eq. 1).

$$
S^\rho_{max}(w) = \mathbb E_S \Big[ \max_{\xi \in \mathcal H_w,\ \|\xi\|_w \le \rho}
    L_S(\gamma_\xi(1)) - L_S(w) \Big]
$$

with $\gamma_\xi(1) \approx w + \xi - \tfrac12\Gamma_w(\xi, \xi)$ on the GL blocks (Eq. 5) and
$w + \xi$ on every other weight. The maximiser is found separately for every batch (by Auto-PGD
by default) and the per-batch increases are averaged.

The pieces: a [`Geometry`][quotient_manifolds.models.config.Geometry] (metric, symmetries,
retractions, ball) gives the
[`ModelGeometry`][quotient_manifolds.models.model_geometry.ModelGeometry] of the model (a
product of tangent spaces) and the feasible set
([`feasible`][quotient_manifolds.sharpness.feasible]); a solver
([`solvers`][quotient_manifolds.sharpness.solvers]) maximises (or averages) over the set.

Nothing is lost: the model is never written to. Perturbed weights enter through
`torch.func.functional_call` (the unperturbed ones detached, not copied); the computation runs
in eval mode inside `try/finally`, which restores every submodule's `training` flag whatever
happens (exceptions, `KeyboardInterrupt`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from ..errors import (
    DetachedLossError,
    EmptyDataError,
    InvalidRadiusError,
    NonFiniteError,
    SingleBatchError,
)
from ..models import Geometry, ModelGeometry
from ..models.model_geometry import ParamSelection
from .distributed import Evaluator, Shard, resolve_shard
from .feasible import make_feasible
from .result import SharpnessResult
from .solvers import APGD, Average, GeooptSolver

__all__ = ["geodesic_sharpness", "adaptive_sharpness", "LossFn", "Solver"]

LossFn = Callable[[nn.Module, object], torch.Tensor]
Solver = APGD | Average | GeooptSolver


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
    """`forward(batch) = loss_fn(model, batch)`, so `functional_call` can swap weights."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)


class _Evaluator:
    """The loss of a batch at given parameters (buffers: the model's own, read only)."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        self.wrapper = _LossModule(model, loss_fn)

    def __call__(self, params: Mapping[str, torch.Tensor], batch) -> torch.Tensor:
        d = {f"model.{n}": t for n, t in params.items()}
        loss = torch.func.functional_call(self.wrapper, d, (batch,))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("loss_fn(model, batch) must return a scalar tensor")
        return loss.reshape(()).float() if loss.dtype in (torch.float16, torch.bfloat16) else (
            loss.reshape(()))


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


def _check_data(data) -> None:
    hint = "; wrap a single batch in a list, e.g. data=[batch]"
    if isinstance(data, torch.Tensor):
        raise SingleBatchError(
            "data is a tensor: iterating it yields its rows, not batches" + hint)
    if isinstance(data, Mapping):
        raise SingleBatchError(
            "data is a dict (one batch): iterating it yields its keys, not batches" + hint)
    if isinstance(data, (tuple, list)) and len(data) >= 2 and all(
            isinstance(t, torch.Tensor) for t in data):
        shapes = {tuple(t.shape[1:]) for t in data}
        if len(shapes) > 1:
            raise SingleBatchError(
                f"data is a {type(data).__name__} of tensors of different shapes "
                f"({', '.join(str(tuple(t.shape)) for t in data)}), which looks like one "
                "(inputs, targets) batch, not a sequence of batches" + hint)


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


class _BatchProblem:
    """The loss of one batch as a function of the packed perturbation ξ."""

    def __init__(self, geo: ModelGeometry, ev: Evaluator, batch, b: int) -> None:
        self.geo, self.ev, self.batch, self.b = geo, ev, batch, b
        self.k = 0
        self._grad: torch.Tensor | None = None

    def _detached(self, loss: torch.Tensor) -> DetachedLossError:
        return DetachedLossError(
            f"loss_fn returned a loss with no grad_fn for batch {self.b}: it does not depend on "
            "the perturbed weights. Return the loss tensor itself (no .item(), .detach() or "
            "torch.no_grad() inside loss_fn), computed by calling the model it is given."
        )

    def _check(self, loss: torch.Tensor, needs_grad: bool) -> None:
        if needs_grad and not loss.requires_grad:
            raise self._detached(loss)
        _finite(float(loss.detach()), self.b, f"at step {self.k}")
        self.k += 1

    def loss(self, xi: torch.Tensor) -> torch.Tensor:
        """The loss at ξ (a graph to ξ when grad mode is on and ξ requires grad)."""
        loss = self.ev(self.geo.params_at(xi), self.batch)
        self._check(loss, torch.is_grad_enabled() and xi.requires_grad)
        return loss

    def loss_and_grad(self, xi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss at ξ and its gradient; the gradient lives in a buffer reused by every call."""
        params, leaves = self.geo.params_and_leaves(xi)
        loss = self.ev(params, self.batch)
        self._check(loss, True)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        if self._grad is None:
            self._grad = torch.empty_like(xi)
        return loss.detach(), self.geo.pack_grads(leaves, grads, out=self._grad)


# -- driver -------------------------------------------------------------------------
def _sharpness(model: nn.Module, loss_fn: LossFn, data: Iterable, rho: float,
               geometry: Geometry, solver: Solver, params: ParamSelection,
               shard: str | Shard | None) -> SharpnessResult:
    t0 = time.perf_counter()
    _check_data(data)
    ctx = resolve_shard(shard)
    geo = ModelGeometry(model, geometry, params=params)
    feasible = make_feasible(geometry.ball, geo.space, rho,
                             w2=None if geometry.ball == "metric" else geo.w2(),
                             horizontal=bool(geo.groups))
    ctx.check_same(geo.base_points)
    gen = None
    if isinstance(solver, Average):
        gen = torch.Generator()
        gen.manual_seed(ctx.common_seed(solver.seed))
    ev = ctx.evaluator(_Evaluator(model, loss_fn))
    per, base_l, max_l, pnorm, norms, n_evals = [], [], [], [], [], 0
    done: list[int] = []
    method = "adaptive" if geometry.metric is None else "geodesic"
    from tqdm.auto import tqdm

    bar = tqdm(total=_len(data), desc=f"{method} sharpness", unit="batch",
               disable=not (solver.progress and ctx.main), leave=False)
    try:
        with _eval_mode(model), torch.enable_grad():
            for b, batch in enumerate(data):
                if not ctx.owns(b):  # shard="batches": another rank solves this batch
                    if isinstance(solver, Average):  # keep the samples of later batches
                        solver.skip(feasible, gen)
                    continue
                with torch.no_grad():
                    base = _finite(float(ev(geo.base, batch)), b, "at the unperturbed weights")
                prob = _BatchProblem(geo, ev, batch, b)
                best, xi, evals = solver.solve(prob, feasible, base, gen)
                nrm = {} if xi is None else {k: float(v) for k, v in feasible.norms(xi).items()}
                n_evals += evals
                per.append(best - base)
                base_l.append(base)
                max_l.append(best)
                norms.append(nrm)
                pnorm.append(nrm.get("total", float("nan")))
                done.append(b)
                bar.update(1)
    finally:
        bar.close()
    settings = {"rho": rho, **geometry.settings(), **solver.settings(),
                "masked_zero_weights": geo.n_masked_zeros,
                "perturbed_parameters": len(geo.selected),
                "geometry": [{"n": g.n, "m": g.m, "h": g.h, "count": int(g.x0.shape[0])}
                             for g in geo.groups]}
    elapsed = time.perf_counter() - t0
    if ctx.active:
        recs, n_evals, elapsed = ctx.gather(
            list(zip(done, per, base_l, max_l, pnorm, norms, strict=True)), n_evals, elapsed)
        done, per, base_l, max_l, pnorm, norms = (list(c) for c in zip(*recs, strict=True)) \
            if recs else ([], [], [], [], [], [])
        settings = {**settings, "shard": ctx.mode, "world_size": ctx.world_size}
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
        kind=solver.kind,
        settings=settings,
        blocks=[bl.describe() for bl in geo.blocks],
        fallbacks=[f.to_dict() for f in geo.fallbacks],
        norms=norms,
        n_evals=n_evals,
        elapsed_s=elapsed,
    )


def _solver(solver: Solver | None, n_iter: int | None) -> Solver:
    solver = APGD() if solver is None else solver
    if not isinstance(solver, (APGD, Average, GeooptSolver)):
        raise TypeError(f"solver must be APGD(...), Average(...) or GeooptSolver(...), got "
                        f"{type(solver).__name__}")
    return solver if n_iter is None else solver.with_iterations(n_iter)


# -- public API -----------------------------------------------------------------------
def geodesic_sharpness(
    model: nn.Module,
    loss_fn: LossFn,
    data: Iterable,
    *,
    rho: float,
    metric: str | None = None,
    n_iter: int | None = None,
    geometry: Geometry | None = None,
    solver: Solver | None = None,
    params: ParamSelection = None,
    shard: str | Shard | None = None,
) -> SharpnessResult:
    r"""Geodesic sharpness (paper Eq. 4) of `model` on `data`.

    Parameters
    ----------
    model : nn.Module
        Any model; never modified (weights, buffers, `requires_grad`, modes).
    loss_fn : callable
        `loss_fn(model, batch) -> scalar tensor`; e.g. `lambda m, b: m(**b).loss`.
    data : iterable
        Batches (a list, a DataLoader, …); sharpness is the mean of the per-batch values. A
        single batch must be wrapped: `data=[batch]`.
    rho : float
        Radius of the perturbation ball (the total norm, App. C).
    metric : {"inv", "mix"}, optional
        Metric of the GL blocks (Eq. 9 / 10); overrides `geometry.metric` (default `"inv"`).
    n_iter : int, optional
        Iterations of the solver (APGD iterations, optimizer steps or Gaussian samples);
        overrides the solver's (default 20).
    geometry : Geometry, optional
        Symmetries, retractions, relaxations and ball
        ([`Geometry`][quotient_manifolds.models.config.Geometry]); default `Geometry()`: the
        full symmetry group, second-order retraction (Eq. 5), metric ball.
    solver : APGD, Average or GeooptSolver, optional
        How the inner problem is solved: `APGD()` (worst case, default), `Average(seed=…)`
        (Gaussian average case) or `GeooptSolver(factory)` (a geoopt optimizer). Progress bars:
        `APGD(progress=True)`.
    params : names, tensors, dict or predicate, optional
        The perturbed parameters: names, parameter tensors, a dict `{name: parameter}` or a
        predicate `(name, param) -> bool`. Default: the parameters with `requires_grad=True`
        (so a peft model perturbs only its adapters). A GL block is used only if all its
        parameters are selected; the result's `fallbacks` record the others.
    shard : {"batches", "within_batch"} or Shard, optional
        Data parallelism over an initialised `torch.distributed` group (`docs/distributed.md`);
        default: none, everything runs on this process.

    Returns
    -------
    SharpnessResult
    """
    r = _check_rho(rho)
    geometry = Geometry() if geometry is None else geometry
    if metric is not None:
        geometry = geometry.replace(metric=metric)
    return _sharpness(model, loss_fn, data, r, geometry, _solver(solver, n_iter), params, shard)


def adaptive_sharpness(
    model: nn.Module,
    loss_fn: LossFn,
    data: Iterable,
    *,
    rho: float,
    norm: str = "l2",
    n_iter: int | None = None,
    geometry: Geometry | None = None,
    solver: Solver | None = None,
    params: ParamSelection = None,
    shard: str | Shard | None = None,
) -> SharpnessResult:
    r"""Adaptive sharpness (Eq. 1), the reference algorithm of Andriushchenko et al. (2023).

    $$
    S = \mathbb E_S \Big[\max_{\|\delta \oslash c\|_p \le \rho} L_S(w + \delta) - L_S(w)\Big],
    \qquad c = \sqrt{w^2 + \varepsilon}
    $$

    This is `geodesic_sharpness(…, geometry=Geometry(metric=None, ball="ellipsoid"))` (ℓ2) or
    `ball="box"` (ℓ∞); parameters not listed are as there.

    Parameters
    ----------
    norm : {"l2", "linf"}
        ℓ2: step $\delta + \eta\, c \odot \nabla/\|\nabla\|_2$, then the Euclidean projection
        onto the ellipsoid by bisection; ℓ∞: step $\delta + \eta\, c \odot
        \operatorname{sign}\nabla$, then clipping.
    geometry : Geometry, optional
        Only its `adaptive_eps` ($\varepsilon$; with 0, zero weights cannot move and are
        excluded), `adaptive_retraction` and `half` are used; the metric is `None` and the ball
        is set by `norm`.
    """
    if norm not in ("l2", "linf"):
        raise ValueError(f"norm must be 'l2' or 'linf', got {norm!r}")
    geometry = Geometry() if geometry is None else geometry
    geometry = geometry.replace(metric=None, ball="ellipsoid" if norm == "l2" else "box",
                                blocks=None, declared=())
    return _sharpness(model, loss_fn, data, _check_rho(rho), geometry, _solver(solver, n_iter),
                      params, shard)
