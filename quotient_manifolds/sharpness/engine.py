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
`torch.func.functional_call` (the unperturbed ones detached, not copied); the whole call, the
capture of the model's inputs included, runs in eval mode inside
[`preserved`][quotient_manifolds.state.preserved], which puts back the modes, buffers,
`.grad`, `requires_grad` and the global random generators whatever happens (exceptions,
`KeyboardInterrupt`) and names what user code changed. `data` is iterated once.
"""

from __future__ import annotations

import itertools
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import nn

from ..errors import (
    ArgumentTypeError,
    DetachedLossError,
    EmptyDataError,
    LossEvaluationError,
    ModelStateError,
    NonFiniteError,
    QuotientManifoldError,
    ZeroGradientWarning,
)
from ..models import ModelGeometry, Symmetries, discovery_cache
from ..models.inputs import capture_inputs
from ..models.model_geometry import ParamSelection, select_parameters
from ..models.row_layout import RowLayout
from ..state import ModelSnapshot, preserved
from .checks import check_rho
from .config import Geometry
from .distributed import Evaluator, Shard, ShardContext, resolve_shard
from .feasible import AdaptiveNormBall, Box, Ellipsoid, FeasibleSet, MetricBall, make_feasible
from .guards import (
    batch_fingerprint,
    check_call,
    check_data,
    check_feasible,
    check_finite_parameters,
    reaches,
    zero_gradient_blocks,
)
from .result import SharpnessResult
from .sharded import ModelParallel, model_parallel
from .solvers import APGD, Solver

__all__ = ["geodesic_sharpness", "adaptive_sharpness", "symmetries_of", "LossFn", "Solver"]

LossFn = Callable[[nn.Module, object], torch.Tensor]


# -- plumbing -------------------------------------------------------------------
class _LossModule(nn.Module):
    """`forward(batch) = loss_fn(model, batch)`, so `functional_call` can swap weights."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)


class _Evaluator:
    """The loss of a batch at given parameters (buffers: the model's own, read only).

    A failure of `loss_fn` becomes a
    [`LossEvaluationError`][quotient_manifolds.errors.LossEvaluationError] naming the batch
    (`batch_index`, set by the driver); a loss that switches a module out of eval mode raises
    [`ModelStateError`][quotient_manifolds.errors.ModelStateError].
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn,
                 snapshot: ModelSnapshot | None = None) -> None:
        self.wrapper = _LossModule(model, loss_fn)
        self.snapshot = snapshot
        self.batch_index = 0

    def __call__(self, params: Mapping[str, torch.Tensor], batch) -> torch.Tensor:
        d = {f"model.{n}": t for n, t in params.items()}
        try:
            loss = torch.func.functional_call(self.wrapper, d, (batch,))
        except QuotientManifoldError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the user's code raises is named
            raise LossEvaluationError(
                f"loss_fn(model, batch) raised on batch {self.batch_index} (its index in "
                f"data): {type(e).__name__}: {e}") from e
        if self.snapshot is not None:
            _check_modes(self.snapshot,
                         f"while the loss of batch {self.batch_index} was computed")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                    else type(loss).__name__)
            raise LossEvaluationError(
                f"loss_fn(model, batch) must return a scalar tensor, got {what} for batch "
                f"{self.batch_index}; reduce it, e.g. with .mean()")
        return loss.reshape(()).float() if loss.dtype in (torch.float16, torch.bfloat16) else (
            loss.reshape(()))


def _check_modes(snapshot: ModelSnapshot, when: str) -> None:
    switched = snapshot.mode_switches()
    if switched:
        raise ModelStateError(
            f"user code switched {', '.join(switched[:3])}{' …' if len(switched) > 3 else ''} "
            f"to train mode {when}; sharpness is measured in eval mode (the modes are "
            "restored): do not call model.train() inside loss_fn")


class _Batches:
    """`data` iterated once: its first batch (for the probes) and then every batch."""

    _END = object()

    def __init__(self, data: Iterable) -> None:
        self.size = _len(data)
        self.iterator = iter(data)
        first = next(self.iterator, self._END)
        self.empty = first is self._END
        self.first = None if self.empty else first

    def __iter__(self) -> Iterator:
        return iter(()) if self.empty else itertools.chain([self.first], self.iterator)


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


class _FirstEvaluation:
    """The checks made once per call, on the first evaluation that can make them: that the
    loss reaches the perturbed weights (a loss of a copy of the model does not), and that no
    claimed block has an identically zero gradient."""

    def __init__(self, geo: ModelGeometry) -> None:
        self.geo = geo
        self.graph_pending = True
        self.grads_pending = True
        self.warnings: list[str] = []  # ZeroGradientWarning messages, emitted by the driver

    def _copy_error(self, b: int) -> DetachedLossError:
        return DetachedLossError(
            f"the loss of batch {b} does not depend on the perturbed weights of the model it "
            "is given: loss_fn computes it with another module (a copy of the model?), or "
            "params= selects weights the loss does not read. Compute the loss by calling the "
            "model passed to loss_fn.")

    def loss_graph(self, prob: _BatchProblem, xi: torch.Tensor, loss: torch.Tensor) -> None:
        """After a loss-only evaluation: walk the graph (evaluating once more with a graph to
        ξ when the solver evaluates without one)."""
        self.graph_pending = False
        if torch.is_grad_enabled() and xi.requires_grad:
            if not reaches(loss, [xi]):
                raise self._copy_error(prob.b)
            return
        with torch.enable_grad():
            leaf = xi.detach().requires_grad_()
            probe = prob.ev(prob.geo.params_at(leaf), prob.batch)
            if not probe.requires_grad:
                raise prob._detached(probe)
            if not reaches(probe, [leaf]):
                raise self._copy_error(prob.b)

    def gradients(self, b: int, grads: Sequence[torch.Tensor | None]) -> None:
        """After the first gradient: none reaching a weight is an error (a copy of the model);
        identically zero ones of claimed blocks (or of everything) are warned about."""
        self.grads_pending = self.graph_pending = False
        if all(g is None for g in grads):
            raise self._copy_error(b)
        if all(g is None or not bool(g.any()) for g in grads):
            self.warnings.append(
                f"the loss gradient of every perturbed weight is zero at the first point "
                f"evaluated on batch {b}: the ascent cannot move, and the sharpness is that "
                "of a flat point")
            return
        zero = zero_gradient_blocks(self.geo, grads)
        if zero:
            self.warnings.append(
                f"the loss gradient of {len(zero)} claimed block(s) is identically zero at the "
                f"first point evaluated on batch {b}: {'; '.join(zero[:4])}"
                f"{' …' if len(zero) > 4 else ''}. The loss does not read them, or the "
                "model's backward does not reach them (e.g. a reversible layer that computes "
                "its own gradients); they stay at ξ = 0 and the sharpness ignores them")


class _BatchProblem:
    """The loss of one batch as a function of the packed perturbation ξ."""

    def __init__(self, geo: ModelGeometry, ev: Evaluator, batch, b: int,
                 first: _FirstEvaluation | None = None) -> None:
        self.geo, self.ev, self.batch, self.b = geo, ev, batch, b
        self.first = _FirstEvaluation(geo) if first is None else first
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
        if self.first.graph_pending:
            self.first.loss_graph(self, xi, loss)
        return loss

    def grads(self, loss: torch.Tensor, leaves: Sequence[torch.Tensor]
              ) -> tuple[torch.Tensor | None, ...]:
        """The leaves' gradients of `loss` (`None` for a leaf it does not reach)."""
        try:
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        except QuotientManifoldError:
            raise
        except Exception as e:  # noqa: BLE001 - a custom backward of the user's model
            raise LossEvaluationError(
                f"the backward pass of loss_fn(model, batch) raised on batch {self.b}: "
                f"{type(e).__name__}: {e}") from e
        if self.first.grads_pending:
            self.first.gradients(self.b, grads)
        return grads

    def loss_and_grad(self, xi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss at ξ and its gradient; the gradient lives in a buffer reused by every call."""
        params, leaves = self.geo.params_and_leaves(xi)
        loss = self.ev(params, self.batch)
        self._check(loss, True)
        grads = self.grads(loss, leaves)
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
        if self.geo.translations is not None and type(feasible) is AdaptiveNormBall:
            return None  # its projection applies every translation component, not only
            # those of gradients (RowsConstraint)
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
    * the momentum steps and restarts (combinations of iterates);
    * with translation orbits (the complete group), the horizontal projection of the gradient:
      the components whose $V$ is the same at every point are skipped for every gradient (in
      the full packing too), and the others lie on entries kept whole
      ([`RowsConstraint`][quotient_manifolds.models.translations.RowsConstraint]).

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
        grads = prob.grads(loss, leaves)
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


def _capture(model: nn.Module, loss_fn: LossFn, batches: _Batches,
             snapshot: ModelSnapshot) -> _Probed:
    """The probes' inputs from the first batch; the forward stops at its first pre-hook (in
    eval mode, inside the caller's snapshot), so nothing runs and nothing changes."""
    if batches.empty:
        return _Probed(None, None)
    inputs = capture_inputs(model, loss_fn, batches.first)
    _check_modes(snapshot, "while the model's inputs were captured")
    return _Probed(inputs, (loss_fn, batches.first))


def _needs_discovery(geometry: Geometry) -> bool:
    return geometry.metric is not None and geometry.blocks is None and (
        geometry.symmetries is None)


def symmetries_of(model: nn.Module, loss_fn: LossFn, data: Iterable, *,
                  geometry: Geometry | None = None) -> Symmetries:
    """The symmetries that `geodesic_sharpness(model, loss_fn, data, geometry=geometry)`
    discovers: [`discover`][quotient_manifolds.models.discover] under `geometry.symmetry`
    (with `geometry.declared`), probed on the model's inputs of the first batch of `data`
    (the only batch read; of a one-shot iterator, it is consumed).

    Discovery runs the model (function-preservation probes), so a sweep over radii or
    measures of one model discovers once and passes the result on:

    ```python
    sym = symmetries_of(model, loss_fn, data, geometry=g)
    for rho in radii:
        geodesic_sharpness(model, loss_fn, data, rho=rho, geometry=g.replace(symmetries=sym))
    ```
    """
    geometry = Geometry() if geometry is None else geometry
    check_call(model, loss_fn, geometry)
    check_data(data)
    with preserved(model) as snap:
        model.eval()
        with model_parallel(model) as mp:
            target = model if mp is None else mp.module  # a sharded model: its whole weights
            probed = _capture(target, loss_fn, _Batches(data), snap)
            return discovery_cache.discover(
                target, symmetry=geometry.symmetry, declared=geometry.declared,
                example_inputs=probed.inputs,
                loss_fn=None if probed.loss is None else probed.loss[0],
                batch=None if probed.loss is None else probed.loss[1])


# -- driver -------------------------------------------------------------------------
def _sharpness(model: nn.Module, loss_fn: LossFn, data: Iterable, rho: float,
               geometry: Geometry, solver: Solver, params: ParamSelection,
               shard: str | Shard | None) -> SharpnessResult:
    t0 = time.perf_counter()
    check_call(model, loss_fn, geometry)
    check_data(data)
    ctx = _shard_context(shard)
    with preserved(model) as snap:
        model.eval()
        with model_parallel(model, geometry, solver) as mp:  # None unless model is sharded
            target, ctx = (model, ctx) if mp is None else (mp.module, mp.context(shard))
            result, notes = _measure(target, loss_fn, _Batches(data), rho, geometry, solver,
                                     params, ctx, snap, t0, mp)
    for note in notes:
        warnings.warn(note, ZeroGradientWarning, stacklevel=3)
    return result


def _shard_context(shard: str | Shard | None) -> ShardContext:
    if shard is not None and not isinstance(shard, (str, Shard)):
        raise ArgumentTypeError(
            f"shard must be None, 'batches', 'within_batch' or a qm.Shard, got "
            f"{type(shard).__name__} {shard!r}")
    return resolve_shard(shard)


def _setup(model: nn.Module, loss_fn: LossFn, batches: _Batches, geometry: Geometry,
           params: ParamSelection, snap: ModelSnapshot, rho: float,
           mp: ModelParallel | None = None) -> tuple[ModelGeometry, FeasibleSet]:
    check_finite_parameters(model, select_parameters(model, params))
    probed = _capture(model, loss_fn, batches, snap) if _needs_discovery(geometry) else None
    # a sharded model: this rank's share of the packed points only
    make = ModelGeometry if mp is None else mp.geometry
    geo = make(model, geometry, params=params, probed=probed)
    feasible = make_feasible(geometry.ball, geo.space, rho,
                             w2=None if geometry.ball == "metric" else geo.w2(),
                             horizontal=bool(geo.groups))
    return geo, feasible


def _measure(model: nn.Module, loss_fn: LossFn, batches: _Batches, rho: float,
             geometry: Geometry, solver: Solver, params: ParamSelection, ctx: ShardContext,
             snap: ModelSnapshot, t0: float, mp: ModelParallel | None = None
             ) -> tuple[SharpnessResult, list[str]]:
    setup: tuple[ModelGeometry, FeasibleSet] | None = None
    try:
        setup = _setup(model, loss_fn, batches, geometry, params, snap, rho, mp)
    except Exception as e:
        if not ctx.active:
            raise
        ctx.check_same(None, error=e)  # tells the other ranks, then raises e
    assert setup is not None
    geo, feasible = setup
    ctx.check_same(geo.base_points)
    gen = None
    if getattr(solver, "random", False):  # samples or random starts
        gen = torch.Generator()
        gen.manual_seed(ctx.common_seed(getattr(solver, "seed", None)))
    raw_ev = _Evaluator(model, loss_fn, snap)
    ev = ctx.evaluator(raw_ev)
    first = _FirstEvaluation(geo)
    per, base_l, max_l, pnorm, norms, n_evals = [], [], [], [], [], 0
    done: list[int] = []
    seen: list[tuple] = []  # batch fingerprints, compared across ranks
    method = "adaptive" if geometry.metric is None else "geodesic"
    from tqdm.auto import tqdm

    bar = tqdm(total=batches.size, desc=f"{method} sharpness", unit="batch",
               disable=not (solver.progress and ctx.main), leave=False)
    failure: Exception | None = None
    try:
        with torch.enable_grad():
            for b, batch in enumerate(batches):
                raw_ev.batch_index = b
                if ctx.active:
                    seen.append(batch_fingerprint(batch))
                if not ctx.owns(b):  # shard="batches": another rank solves this batch
                    if gen is not None and hasattr(solver, "skip"):
                        solver.skip(feasible, gen)  # keep the draws of later batches in step
                    continue
                with torch.no_grad():
                    base = _finite(float(ev(geo.base, batch)), b, "at the unperturbed weights")
                prob = _BatchProblem(geo, ev, batch, b, first)
                best_t, xi, evals = solver.solve(prob, feasible, base, gen)
                if xi is not None:
                    check_feasible(feasible, xi, b)
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
    except Exception as e:
        if not ctx.active:
            raise
        failure = e  # raised after the ranks have exchanged it
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
            list(zip(done, per, base_l, max_l, pnorm, norms, strict=True)), n_evals, elapsed,
            fingerprints=seen, error=failure)
        done, per, base_l, max_l, pnorm, norms = (list(c) for c in zip(*recs, strict=True)) \
            if recs else ([], [], [], [], [], [])
        settings = {**settings, "shard": ctx.mode, "world_size": ctx.world_size}
    if mp is not None:
        settings = {**settings, **mp.settings()}
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
    ), first.warnings


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
        complete symmetry group, second-order retraction (Eq. 5), metric ball.
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
