r"""Geodesic and adaptive sharpness of real PyTorch models (paper Eq. 4 and Eq. 1).

$$
S^\rho_{max}(w) = \mathbb E_S \Big[ \max_{\xi \in \mathcal H_w,\ \|\xi\|_w \le \rho}
    L_S(\gamma_\xi(1)) - L_S(w) \Big]
$$

with $\gamma_\xi(1) \approx w + \xi - \tfrac12\Gamma_w(\xi, \xi)$ on the GL blocks (Eq. 5) and
$w + \xi$ on every other weight. The maximiser is found separately for every batch (by Auto-PGD
by default) and the per-batch increases are averaged.

The pieces: a [`Geometry`][quotient_manifolds.sharpness.config.Geometry] (metric, symmetries,
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
from typing import NamedTuple

import torch
from torch import nn

from ..errors import (
    DetachedLossError,
    EmptyDataError,
    NonFiniteError,
    SingleBatchError,
)
from ..models import ModelGeometry, Symmetries, discover
from ..models.inputs import capture_inputs
from ..models.model_geometry import ParamSelection
from ..models.row_layout import RowLayout
from .checks import check_rho
from .config import Geometry
from .distributed import Evaluator, Shard, resolve_shard
from .feasible import AdaptiveNormBall, Box, Ellipsoid, FeasibleSet, MetricBall, make_feasible
from .result import SharpnessResult
from .solvers import APGD, Solver

__all__ = ["geodesic_sharpness", "adaptive_sharpness", "symmetries_of", "LossFn", "Solver"]

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

    def active(self, feasible: FeasibleSet) -> _ActiveRows | None:
        r"""The objective on the adaptive rows whose gradient has ever been non-zero, for APGD
        started at ξ = 0; `None` where that restriction is not known to give the same iterates
        (a batch of problems, an adaptive retraction other than $w + \xi$, a feasible set other
        than the four of [`make_feasible`][quotient_manifolds.sharpness.feasible.make_feasible])."""
        if (self.geo.geometry.adaptive_retraction != "first_order" or feasible.problems
                or type(feasible) not in _ROW_SETS):
            return None
        return _ActiveRows(self, feasible)


_ROW_SETS = (MetricBall, AdaptiveNormBall, Ellipsoid, Box)
"""The feasible sets whose every operation keeps an entry at 0 when the entry and its gradient
are 0 (see `_ActiveRows`)."""


class _ActiveRows:
    r"""The loss of one batch on the rows of the adaptive entries whose gradient has ever been
    non-zero: an APGD objective with a [`Layout`][quotient_manifolds.sharpness.apgd.Layout].

    The first call is in the full packing; its gradient decides the rows kept
    ([`row_layout`][quotient_manifolds.models.model_geometry.ModelGeometry.row_layout]): of a
    whole-parameter adaptive entry, the rows (slices along dim 0) whose gradient is not
    identically zero, e.g. the embedding rows of the tokens the batch reads. Every later call
    checks the rows not kept and adds those whose gradient is no longer zero
    ([`grow`][quotient_manifolds.models.row_layout.RowLayout.grow]) before the step.

    **Why the iterates are those of the full packing.** Take a row $r$ whose gradient was 0 at
    the iterates $\xi_0 = 0, \dots, \xi_{k-1}$. By induction, $\xi_0, \dots, \xi_k$ (and every
    intermediate vector of APGD: the ascent point $z$, the momentum step, the best iterate of a
    restart) are 0 on $r$, because every operation of the four sets maps (0 entry, 0 gradient)
    to 0 and acts on the other entries as if $r$ were absent:

    * the direction: $c^2 \odot \nabla$ on adaptive entries (metric ball; the adaptive metric
      has no vertical part), $\Pi^{c}(c^2 \odot \nabla)$ (adaptive-norm ball; $\Pi^{c}$ is the
      identity on adaptive entries), $c \odot \nabla / \|\nabla\|_2$ (ellipsoid),
      $c \odot \operatorname{sign} \nabla$ (box), each divided by a norm to which 0 entries
      add nothing;
    * the step $\xi + \eta d$, the radial shrink (a scaling), the ellipsoid's projection
      $y / (1 + \lambda b)$ (0 where $y$ is 0; the bisection for $\lambda$ evaluates norms
      to which 0 entries add nothing), clipping to the box, and `clip_to_domain` (the
      identity on adaptive entries);
    * the momentum steps and restarts (combinations of iterates).

    The GL blocks are kept whole, so their retraction (first order, second order or exact) and
    metric (`inv`, `mix`) do not matter; the adaptive entries are perturbed by $w + \xi$, so a
    row at 0 in $\xi$ is the base weight, and the loss and the gradient on the kept entries
    are those of the full packing at the same iterate. The two runs differ only in the order
    of summation inside the norms.
    """

    def __init__(self, problem: _BatchProblem, feasible: FeasibleSet) -> None:
        self.problem = problem
        self.full = feasible
        self.feasible = feasible
        self.layout: RowLayout | None = None
        self.previous: RowLayout | None = None
        self.version = 0
        self.started = False
        self._grad: torch.Tensor | None = None

    def _use(self, layout: RowLayout) -> None:
        self.previous, self.layout = self.layout, layout
        self.version += 1
        self.feasible = self.full.restrict(layout.space, layout.take)
        self._grad = None

    def __call__(self, xi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prob, geo = self.problem, self.problem.geo
        if self.layout is None and self.started:  # no rows to drop: the full packing
            return prob.loss_and_grad(xi)
        params, leaves = geo.params_and_leaves(xi, self.layout)
        loss = prob.ev(params, prob.batch)
        prob._check(loss, True)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        if self.layout is None:
            self.started = True
            layout = geo.row_layout(grads)
            if layout is None:
                if prob._grad is None:
                    prob._grad = torch.empty_like(xi)
                return loss.detach(), geo.pack_grads(leaves, grads, out=prob._grad)
            self._use(layout)
        else:
            grown = self.layout.grow(grads)
            if grown is not None:
                self._use(grown)
        assert self.layout is not None
        if self._grad is None:
            self._grad = torch.empty(self.layout.D, dtype=geo.dtype, device=geo.w0.device)
        return loss.detach(), geo.pack_grads(leaves, grads, out=self._grad, layout=self.layout)

    def convert(self, v: torch.Tensor) -> torch.Tensor:
        """A vector of the packing before the last change, in the current packing."""
        assert self.layout is not None
        full = v if self.previous is None else self.previous.put(v)
        return self.layout.take(full)

    def expand(self, v: torch.Tensor) -> torch.Tensor:
        """A vector of the current packing in the full packing (0 on the rows not kept)."""
        return v if self.layout is None else self.layout.put(v)


class _Probed(NamedTuple):
    """What discovery's probes run on: the model's inputs in `loss_fn(model, first batch)`,
    and the loss on that batch (for the symmetries of the loss only)."""

    inputs: tuple[tuple, dict] | None
    loss: tuple[LossFn, object] | None


def _first_call(model: nn.Module, loss_fn: LossFn, data: Iterable,
                geometry: Geometry) -> _Probed:
    """The probes' inputs, where the symmetries are discovered (the probes of the blocks and of
    the folds run the model on an input) and `data` can be iterated twice; the forward stops
    at its first pre-hook, so nothing runs and nothing changes."""
    if geometry.metric is None or geometry.blocks is not None or geometry.symmetries is not None:
        return _Probed(None, None)
    return _capture_call(model, loss_fn, data)


def _capture_call(model: nn.Module, loss_fn: LossFn, data: Iterable) -> _Probed:
    if iter(data) is data:  # a one-shot iterator: its first batch must not be consumed here
        return _Probed(None, None)
    first = next(iter(data), None)
    if first is None:
        return _Probed(None, None)
    return _Probed(capture_inputs(model, loss_fn, first), (loss_fn, first))


def symmetries_of(model: nn.Module, loss_fn: LossFn, data: Iterable, *,
                  geometry: Geometry | None = None) -> Symmetries:
    """The symmetries that `geodesic_sharpness(model, loss_fn, data, geometry=geometry)`
    discovers: [`discover`][quotient_manifolds.models.discover] under `geometry.symmetry`
    (with `geometry.declared`), probed on the model's inputs of the first batch of `data`.

    Discovery runs the model (function-preservation probes), so a sweep over radii or
    measures of one model discovers once and passes the result on:

    ```python
    sym = symmetries_of(model, loss_fn, data, geometry=g)
    for rho in radii:
        geodesic_sharpness(model, loss_fn, data, rho=rho, geometry=g.replace(symmetries=sym))
    ```
    """
    geometry = Geometry() if geometry is None else geometry
    probed = _capture_call(model, loss_fn, data)
    return discover(model, symmetry=geometry.symmetry, declared=geometry.declared,
                    example_inputs=probed.inputs,
                    loss_fn=None if probed.loss is None else probed.loss[0],
                    batch=None if probed.loss is None else probed.loss[1])


# -- driver -------------------------------------------------------------------------
def _sharpness(model: nn.Module, loss_fn: LossFn, data: Iterable, rho: float,
               geometry: Geometry, solver: Solver, params: ParamSelection,
               shard: str | Shard | None) -> SharpnessResult:
    t0 = time.perf_counter()
    _check_data(data)
    ctx = resolve_shard(shard)
    geo = ModelGeometry(model, geometry, params=params,
                        probed=_first_call(model, loss_fn, data, geometry))
    feasible = make_feasible(geometry.ball, geo.space, rho,
                             w2=None if geometry.ball == "metric" else geo.w2(),
                             horizontal=bool(geo.groups))
    ctx.check_same(geo.base_points)
    gen = None
    if getattr(solver, "random", False):  # samples or random starts
        gen = torch.Generator()
        gen.manual_seed(ctx.common_seed(getattr(solver, "seed", None)))
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
                    if gen is not None and hasattr(solver, "skip"):
                        solver.skip(feasible, gen)  # keep the draws of later batches in step
                    continue
                with torch.no_grad():
                    base = _finite(float(ev(geo.base, batch)), b, "at the unperturbed weights")
                prob = _BatchProblem(geo, ev, batch, b)
                best_t, xi, evals = solver.solve(prob, feasible, base, gen)
                best = float(best_t)
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


def _solver(given: Solver | None, n_iter: int | None) -> Solver:
    solver: Solver = APGD() if given is None else given
    if not isinstance(solver, Solver):
        raise TypeError(f"solver must be APGD(...), Average(...), GeooptSolver(...) or an object "
                        f"with the Solver protocol's kind, progress, solve, settings and "
                        f"with_iterations, got {type(solver).__name__}")
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
        ([`Geometry`][quotient_manifolds.sharpness.config.Geometry]); default `Geometry()`: the
        full symmetry group, second-order retraction (Eq. 5), metric ball.
    solver : APGD, Average or GeooptSolver, optional
        How the inner problem is solved: `APGD()` (worst case, default; `APGD(restarts=3,
        seed=…)` adds random starts), `Average(seed=…)` (Gaussian average case) or
        `GeooptSolver(factory)` (a geoopt optimizer). Progress bars: `APGD(progress=True)`.
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
    r = check_rho(rho)
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
    return _sharpness(model, loss_fn, data, check_rho(rho), geometry, _solver(solver, n_iter),
                      params, shard)
