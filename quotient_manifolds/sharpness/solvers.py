r"""Solvers of the inner problem of a sharpness measure, one per batch.

* [`APGD`][quotient_manifolds.sharpness.solvers.APGD]: the worst case by Auto-PGD with the
  reference settings (the default), optionally with random restarts;
* [`Average`][quotient_manifolds.sharpness.solvers.Average]: the average case, the mean loss over
  Gaussian perturbations of the feasible set's geometry;
* [`GeooptSolver`][quotient_manifolds.sharpness.solvers.GeooptSolver]: the worst case by any
  geoopt optimizer, on one `geoopt.ManifoldParameter` over the packed perturbation whose
  manifold, [`FeasibleSetManifold`][quotient_manifolds.sharpness.solvers.FeasibleSetManifold],
  has the feasible set's projection as `retr` and `projx`, so the optimizer's state stays
  consistent and the same set as APGD's is searched.

Every solver records its own settings only (its `settings()`); `progress=True` shows a tqdm bar
over the batches.

A solver's `solve(problem, feasible, base_loss, generator)` works on one
[`BatchProblem`][quotient_manifolds.sharpness.solvers.BatchProblem] and returns the best (or mean)
loss with one value per problem of the feasible set: a 0-dimensional tensor for one model (the
engine's batches), a `(B,)` tensor for a batch of independent problems (a population of diagonal
networks, [`diagonal_sharpness`][quotient_manifolds.sharpness.diagonal.diagonal_sharpness]).
`APGD` and `Average` accept such batches; `generator` may then be one generator per problem.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import geoopt
import torch

from .._args import check_callable, check_flag, check_int, check_real, check_seed, short_repr
from ..errors import ArgumentTypeError, InfeasibleSolutionError
from ..manifolds.base import Generator
from ..models.config import check_choice
from .apgd import MOMENTUM_FORMS, APGDResult, Layout, Objective, apgd, select_rows
from .checks import check_rho
from .feasible import FeasibleSet

__all__ = ["APGD", "Average", "GeooptSolver", "FeasibleSetManifold", "BatchProblem", "SOLVERS",
           "Solver"]


class BatchProblem(Protocol):
    """What a solver needs from the loss of one batch.

    The loss has one value per problem of the feasible set (`feasible.problems`): a scalar for
    one model, a `(B,)` tensor for a batch of independent problems, each entry depending only on
    its own row of the perturbation `(*problems, D)`.

    A problem may also offer `active(feasible)`, which returns `None` or an objective with a
    [`Layout`][quotient_manifolds.sharpness.apgd.Layout] on which APGD started at ξ = 0 runs
    on fewer entries with the same iterates, and whose `expand(xi)` maps its packing back to
    the full one; [`APGD`][quotient_manifolds.sharpness.solvers.APGD] uses it when present.
    """

    def loss_and_grad(self, xi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss at the perturbation `xi` and its gradient with respect to `xi`."""

    def loss(self, xi: torch.Tensor) -> torch.Tensor:
        """Loss at the perturbation `xi`, differentiable in `xi` when grad mode is on."""


@runtime_checkable
class Solver(Protocol):
    """What the engine needs of a solver: the three built-in ones, or a user's.

    `kind` is `"worst"` or `"average"`; `solve(problem, feasible, base_loss, generator)`
    returns `(best or mean loss (one value per problem), maximiser or None, loss
    evaluations)`, and the maximiser must lie in `feasible`; `settings()` describes the solver
    for the result; `with_iterations(n)` is a copy with `n` iterations (or samples). A solver
    that draws random numbers sets `random = True` and has a `seed` (the engine seeds one
    generator with it) and a `skip(feasible, generator)` that draws what one batch solved on
    another rank would have drawn.
    """

    @property
    def kind(self) -> str: ...

    @property
    def progress(self) -> bool: ...

    def solve(self, problem: BatchProblem, feasible: FeasibleSet, base_loss: float,
              generator: torch.Generator | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, int]: ...

    def settings(self) -> dict: ...

    def with_iterations(self, n: int) -> Solver: ...


def _set(obj: object, name: str, value: object) -> None:
    """Store a checked (normalised) value in a frozen dataclass."""
    object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class APGD:
    r"""Auto-PGD ([`apgd`][quotient_manifolds.sharpness.apgd.apgd]), the worst case.

    Attributes
    ----------
    n_iter : int
        Iterations (= gradient evaluations) per batch, an integer ≥ 1.
    momentum : float
        $\alpha$ (0.75), a finite number in $[0, 1]$.
    momentum_form : {"reference", "apgd"}
        The reference code's momentum or Croce & Hein's (Alg. 1 line 15).
    step_mult : float
        The initial step is $2\rho \cdot$ `step_mult`, a finite number > 0.
    progress : bool
        A tqdm bar over the batches.
    active_set : bool
        Run the iterations on the adaptive rows whose gradient has ever been non-zero (e.g.
        the embedding rows of the tokens a batch reads), where the problem offers it: the same
        iterates up to the order of summation in the norms, with less work per iteration. The
        maximiser is returned in the full packing either way (random restarts run on the full
        packing).
    restarts : int
        Random restarts after the run from $\xi = 0$: each starts at the feasible set's
        `random_start` (a Gaussian draw of the average case at radius $\rho/2$, projected onto
        the set) and runs `n_iter` iterations; the best loss over all runs is kept, per problem.
        0 (the reference settings): the zero start only. An integer ≥ 0.
    seed : int, optional
        Seed of the random starts, an integer in $[0, 2^{63} - 1]$ (a fresh random one if
        `None`); unused without restarts.

    Integers are Python or numpy integers (not floats, not bools). A value outside its domain
    raises [`InvalidArgumentError`][quotient_manifolds.errors.InvalidArgumentError], a value
    of the wrong type [`ArgumentTypeError`][quotient_manifolds.errors.ArgumentTypeError].
    """

    n_iter: int = 20
    momentum: float = 0.75
    momentum_form: str = "reference"
    step_mult: float = 1.0
    progress: bool = False
    active_set: bool = True
    restarts: int = 0
    seed: int | None = None
    kind: ClassVar[str] = "worst"

    def __post_init__(self) -> None:
        _set(self, "n_iter", check_int("n_iter", self.n_iter, example=20))
        _set(self, "momentum", check_real("momentum", self.momentum, minimum=0.0, maximum=1.0,
                                          example=0.75))
        check_choice("momentum_form", self.momentum_form, MOMENTUM_FORMS)
        _set(self, "step_mult", check_real("step_mult", self.step_mult, minimum=0.0,
                                           open_min=True, example=1.0))
        _set(self, "progress", check_flag("progress", self.progress))
        _set(self, "active_set", check_flag("active_set", self.active_set))
        _set(self, "restarts", check_int("restarts", self.restarts, minimum=0, example=3))
        _set(self, "seed", check_seed("seed", self.seed))

    @property
    def random(self) -> bool:
        """Whether `solve` draws random numbers (the random starts)."""
        return self.restarts > 0

    def with_iterations(self, n: int) -> APGD:
        """A copy with `n_iter = n` (checked like `n_iter`)."""
        return dataclasses.replace(self, n_iter=n)

    def settings(self) -> dict:
        """The settings of this solver, for the result."""
        out = {"solver": "apgd", "n_iter": self.n_iter, "step_size": f"2ρ·{self.step_mult:g}",
               "momentum": self.momentum, "momentum_form": self.momentum_form, "init": "zero"}
        if self.restarts:
            out.update(init=f"zero + {self.restarts} random starts at ρ/2",
                       restarts=self.restarts, seed=self.seed)
        return out

    def _run(self, objective: Objective, feasible: FeasibleSet,
             base_loss: float | torch.Tensor, init: torch.Tensor | None = None,
             layout: Layout | None = None) -> APGDResult:
        return apgd(objective, feasible, base_loss, n_iter=self.n_iter, init=init,
                    momentum=self.momentum, momentum_form=self.momentum_form,
                    step_mult=self.step_mult, layout=layout)

    def solve(self, problem: BatchProblem, feasible: FeasibleSet,
              base_loss: float | torch.Tensor, generator: Generator = None
              ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`(best loss, maximiser, loss evaluations)` of one batch; the best loss has one value
        per problem, the random starts come from `generator`."""
        active = getattr(problem, "active", None)
        act = active(feasible) if active is not None and self.active_set else None
        res = self._run(problem.loss_and_grad if act is None else act, feasible, base_loss,
                        layout=act)
        best = res.best_loss
        xi = res.best_xi if act is None else act.expand(res.best_xi)
        for _ in range(self.restarts):
            run = self._run(problem.loss_and_grad, feasible, base_loss,
                            init=feasible.random_start(generator))
            better = run.best_loss > best
            best = torch.where(better, run.best_loss, best)
            xi = select_rows(better, run.best_xi, xi)
        return best, xi, self.n_iter * (1 + self.restarts)

    def skip(self, feasible: FeasibleSet, generator: Generator) -> None:
        """Draw the random starts of a batch solved elsewhere (keeps the generator in step)."""
        for _ in range(self.restarts):
            feasible.random_start(generator)


@dataclass(frozen=True)
class Average:
    r"""The average case: the mean loss over `n` Gaussian perturbations (App. D).

    The perturbations are the feasible set's `sample`s: $\rho$ times a standard Gaussian of the
    metric on the horizontal space (metric ball), of the adaptive norm (adaptive-norm ball),
    $\rho\, c \odot N(0, I)$ (ellipsoid) or $\rho\, c \odot U(-1, 1)$ (box); the Gaussians are
    truncated to the domain of the retraction where it has one (the exact mix geodesic of
    diagonal nets). The mean has one value per problem.

    Attributes
    ----------
    n : int
        Samples per batch, an integer ≥ 1.
    seed : int, optional
        Seed of the samples, an integer in $[0, 2^{63} - 1]$ (a fresh random one if `None`).
    progress : bool
        A tqdm bar over the batches.

    Bad values raise [`InvalidArgumentError`][quotient_manifolds.errors.InvalidArgumentError]
    or [`ArgumentTypeError`][quotient_manifolds.errors.ArgumentTypeError], as for `APGD`.
    """

    n: int = 20
    seed: int | None = None
    progress: bool = False
    kind: ClassVar[str] = "average"
    random: ClassVar[bool] = True
    """`solve` draws random numbers (the samples)."""

    def __post_init__(self) -> None:
        _set(self, "n", check_int("n", self.n, example=20))
        _set(self, "seed", check_seed("seed", self.seed))
        _set(self, "progress", check_flag("progress", self.progress))

    def with_iterations(self, n: int) -> Average:
        """A copy with `n` samples (checked like `n`)."""
        return dataclasses.replace(self, n=n)

    def settings(self) -> dict:
        return {"solver": "average", "n_samples": self.n, "seed": self.seed}

    def solve(self, problem: BatchProblem, feasible: FeasibleSet,
              base_loss: float | torch.Tensor, generator: Generator = None
              ) -> tuple[torch.Tensor, None, int]:
        """`(mean loss, None, loss evaluations)` of one batch, one mean per problem (summed in
        float64 on the host, in the order of the samples, whatever the loss's device)."""
        total = torch.zeros(feasible.problems, dtype=torch.float64)
        with torch.no_grad():
            for _ in range(self.n):
                loss = problem.loss(feasible.sample(generator)).detach()
                total += torch.tensor(loss.tolist(), dtype=torch.float64)
        return total / self.n, None, self.n

    def skip(self, feasible: FeasibleSet, generator: Generator) -> None:
        """Draw the samples of a batch solved elsewhere (keeps the generator in step)."""
        for _ in range(self.n):
            feasible.sample(generator)


@dataclass(frozen=True)
class GeooptSolver:
    r"""The worst case by a geoopt optimizer.

    `factory(params)` builds the optimizer, e.g.
    `lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.05)`. It is given one
    `geoopt.ManifoldParameter` holding the packed perturbation, whose manifold is
    [`FeasibleSetManifold`][quotient_manifolds.sharpness.solvers.FeasibleSetManifold]: the
    optimizer minimises $-L$, and its `retr` is the feasible set's projection. The best loss
    over the `n_iter + 1` evaluated points is returned.

    Only a geoopt Riemannian optimizer (`geoopt.optim.RiemannianSGD`, `RiemannianAdam`, …)
    calls `retr`; a plain `torch.optim` optimizer steps $\xi + \Delta$ and may leave the set.
    `solve` checks the maximiser it returns and raises
    [`InfeasibleSolutionError`][quotient_manifolds.errors.InfeasibleSolutionError] if its
    norm exceeds $\rho$ (by more than rounding).

    Attributes
    ----------
    factory : callable
        `factory(list of parameters) -> torch.optim.Optimizer`, called once per batch; anything
        else returned raises [`ArgumentTypeError`][quotient_manifolds.errors.ArgumentTypeError].
    n_iter : int
        Optimizer steps per batch, an integer ≥ 1.
    progress : bool
        A tqdm bar over the batches.
    """

    factory: Callable[[list], torch.optim.Optimizer]
    n_iter: int = 20
    progress: bool = False
    kind: ClassVar[str] = "worst"
    random: ClassVar[bool] = False
    """`solve` draws no random numbers."""

    def __post_init__(self) -> None:
        check_callable("factory", self.factory, "factory(params) -> torch.optim.Optimizer, "
                       "e.g. lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.05)")
        _set(self, "n_iter", check_int("n_iter", self.n_iter, example=20))
        _set(self, "progress", check_flag("progress", self.progress))

    def with_iterations(self, n: int) -> GeooptSolver:
        """A copy with `n_iter = n` (checked like `n_iter`)."""
        return dataclasses.replace(self, n_iter=n)

    def settings(self) -> dict:
        return {"solver": "geoopt", "optimizer": repr(self.factory), "n_iter": self.n_iter}

    def solve(self, problem: BatchProblem, feasible: FeasibleSet,
              base_loss: float | torch.Tensor, generator: Generator = None
              ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`(best loss, maximiser, loss evaluations)` of one batch (one problem only)."""
        p = geoopt.ManifoldParameter(feasible.zeros(), manifold=FeasibleSetManifold(feasible))
        opt = self.factory([p])
        if not isinstance(opt, torch.optim.Optimizer):
            raise ArgumentTypeError(
                f"GeooptSolver's factory {short_repr(self.factory)} returned "
                f"{short_repr(opt)} of type "
                f"{type(opt).__name__}, not a torch.optim.Optimizer; return the optimizer, "
                "e.g. factory=lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.05)")
        best, best_xi = float(base_loss), feasible.zeros()
        for k in range(self.n_iter + 1):
            opt.zero_grad()
            loss = problem.loss(p)
            v = float(loss.detach())
            if v > best:
                best, best_xi = v, p.detach().clone()
            if k == self.n_iter:
                break
            (-loss).backward()  # geoopt minimises
            opt.step()
        _check_feasible(best_xi, feasible, opt)
        return torch.tensor(best, dtype=torch.float64), best_xi, self.n_iter + 1


def _check_feasible(xi: torch.Tensor, feasible: FeasibleSet, opt: torch.optim.Optimizer
                    ) -> None:
    """Raise `InfeasibleSolutionError` unless `‖ξ‖ ≤ ρ (1 + rtol)` in the set's norm (`rtol`:
    1e-6, or 64 units of rounding of `ξ`'s dtype if larger, for the recomputed norm)."""
    rtol = max(1e-6, 64 * torch.finfo(xi.dtype).eps)
    total = float(feasible.norms(xi)["total"].max())
    if total <= feasible.rho * (1 + rtol):
        return
    raise InfeasibleSolutionError(
        f"the maximiser of {type(opt).__name__} has norm {total:.6g} = "
        f"{total / feasible.rho:.4g}ρ in the {feasible.name} set of radius ρ = "
        f"{feasible.rho:g}: the optimizer left the feasible set, so its loss is not the "
        "sharpness of the ball. A plain torch.optim optimizer ignores the manifold's `retr`; "
        "use a geoopt Riemannian optimizer (geoopt.optim.RiemannianSGD, RiemannianAdam), "
        "e.g. GeooptSolver(lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.05)), or APGD()")


SOLVERS = (APGD, Average, GeooptSolver)


class FeasibleSetManifold(geoopt.manifolds.Manifold):
    r"""A feasible set as a geoopt manifold: points are perturbations in the set.

    `inner`, `proju` and `egrad2rgrad` are the set's (the metric of the base point, constant in
    the perturbation); `retr(x, u) = projx(x + u)` with `projx` the set's projection, so every
    geoopt optimizer stays in the set and its state is never overwritten behind its back.
    Points are flat `(*problems, D)` vectors, or have `shape` (then flattened internally).
    """

    name = "FeasibleSet"
    ndim = 1
    reversible = False

    def __init__(self, feasible: FeasibleSet, shape: tuple[int, ...] | None = None) -> None:
        super().__init__()
        check_rho(feasible.rho, "radius")
        self.feasible = feasible
        self.shape = None if shape is None else tuple(shape)
        if self.shape is not None:
            self.ndim = len(self.shape)

    def extra_repr(self) -> str:
        return f"set={self.feasible.name}, radius={self.feasible.rho:g}"

    @property
    def radius(self) -> float:
        return self.feasible.rho

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.shape is None else t.reshape(self.feasible.space.D)

    def _back(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.shape is None else t.reshape(self.shape)

    def _check_shape(self, shape, name):
        want = self.shape if self.shape is not None else (*self.feasible.problems,
                                                          self.feasible.space.D)
        if tuple(shape) != tuple(want):
            return False, f"`{name}` must have shape {tuple(want)}, got {tuple(shape)}"
        return True, None

    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        # both tolerances relative to the radius: an absolute atol would accept 11ρ at ρ = 1e-6
        f = self._flat(x)
        nrm = float(self.feasible.norm(f).max())
        if nrm > self.radius * (1 + rtol + atol):
            return False, f"‖ξ‖ = {nrm:.6g} exceeds the radius {self.radius:g}"
        return self._check_vector_on_tangent(x, x, atol=atol, rtol=rtol)

    def _check_vector_on_tangent(self, x, u, *, atol=1e-5, rtol=1e-5):
        f = self._flat(u)
        p = self.feasible.proju(f)
        if not torch.allclose(p, f, atol=atol, rtol=rtol):
            return False, ("vector is not horizontal: it moves under the horizontal projection "
                           f"by {(p - f).abs().max().item():.3g}")
        return True, None

    def norm_at_base(self, u: torch.Tensor) -> torch.Tensor:
        """The set's norm of `u` (per problem)."""
        return self.feasible.norm(self._flat(u))

    def inner(self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor | None = None, *,
              keepdim: bool = False) -> torch.Tensor:
        out = self.feasible.inner(self._flat(u), None if v is None else self._flat(v))
        return out[(...,) + (None,) * self.ndim] if keepdim else out

    def proju(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self._back(self.feasible.proju(self._flat(u)))

    def egrad2rgrad(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self._back(self.feasible.rgrad(self._flat(u)))

    def projx(self, x: torch.Tensor) -> torch.Tensor:
        return self._back(self.feasible.project(self._flat(x)))

    def retr(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """`projx(x + u)`: a step in the tangent space, then back into the set."""
        return self.projx(x + u)

    expmap = retr

    def transp(self, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The horizontal projection (one tangent space: no transport needed)."""
        return self.proju(y, v)

    def retr_transp(self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.retr(x, u)
        return y, self.transp(x, y, v)

    expmap_transp = retr_transp

    def origin(self, *size: int | tuple[int], dtype: torch.dtype | None = None,
               device: torch.device | str | None = None,
               seed: int | None = 42) -> geoopt.ManifoldTensor:
        """The centre of the set."""
        return geoopt.ManifoldTensor(self._back(self.feasible.zeros()), manifold=self)

    def random(self, *size: int | tuple[int], dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> geoopt.ManifoldTensor:
        """A random point of the set: the feasible set's `random_start` (a sample, shrunk to half
        the radius)."""
        z = self.feasible.random_start(None)
        return geoopt.ManifoldTensor(self._back(z), manifold=self)
