r"""Training to a stated convergence rule, shared by the fine-tuned populations.

The fine-tuned populations (`minilm-finetune`, `vit-finetune`) train every member until its
training loss has plateaued on its own (possibly noisy) labels, by one rule fixed in code
before any sharpness was measured:

the member trains at least its sampled number of epochs $E$; from epoch $E - k$ on, the full
training set is evaluated after every epoch (eval mode, the member's own fitted labels, the
member's own training objective, i.e. cross-entropy with its label smoothing), giving the loss
$L_e$ and the accuracy $a_e$. The member is **converged** at the first epoch $e \ge E$ with
$a_e \ge a_{\min}$ (`min_acc`) and

$$
L_{e-k} - L_e \le \epsilon_{\text{abs}} + \epsilon_{\text{rel}}\, L_{e-k}
$$

(`abs_tol`, `rel_tol`): the loss fell by less than a small absolute amount plus a fraction of
itself over the last $k$ epochs (a plateau), with (almost) every training label fitted.
Training continues epoch by epoch until the rule is met, up to `max_epochs`; a member that
never meets it is kept on disk with `converged = false` and is reported, never silently used.

Every member's record holds the evidence: the evaluated epochs with their $(L_e, a_e)$, the
epoch at which the rule was met, and the rule itself.

The learning rate follows a linear warm-up over the first `warmup` fraction of the scheduled
$E$ epochs, then a linear decay to `final_lr_frac` of the peak at epoch $E$, and stays there
during any extension epochs. The fine-tuned populations use `final_lr_frac = 1` (warm-up,
then constant): a decayed rate would make the plateau test pass because the steps shrink,
and would make the extension epochs of a slow member crawl.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .store import PopulationStore
from .template import Member, PopulationExperiment

__all__ = ["DesignPoint", "FinetuneExperiment", "PlateauRule", "convergence_table",
           "fit_record", "lr_factor", "ofat_alternates", "ofat_design",
           "train_to_convergence"]


@dataclass(frozen=True)
class PlateauRule:
    """The convergence rule (see the module docstring).

    Attributes
    ----------
    min_acc : float
        Smallest training accuracy on the member's own labels.
    k : int
        Window of the plateau test, in epochs.
    abs_tol, rel_tol : float
        Largest allowed loss decrease over the window: `abs_tol + rel_tol * L[e-k]`.
    max_epochs : int
        Cap; a member not converged by then is reported as not converged.
    """

    min_acc: float = 0.99
    k: int = 2
    abs_tol: float = 0.002
    rel_tol: float = 0.1
    max_epochs: int = 40

    def met(self, history: list[dict], epochs: int) -> bool:
        """Whether the last entry of `history` (`{"epoch", "loss", "acc"}`) meets the rule."""
        if not history:
            return False
        last = history[-1]
        if last["epoch"] < epochs or last["acc"] < self.min_acc:
            return False
        prev = [h for h in history if h["epoch"] == last["epoch"] - self.k]
        if not prev:
            return False
        lk = prev[0]["loss"]
        return lk - last["loss"] <= self.abs_tol + self.rel_tol * lk

    def to_dict(self) -> dict:
        """The rule as a JSON-serialisable dict (part of the training protocol)."""
        return asdict(self)


def lr_factor(step: int, scheduled_steps: int, *, warmup: float = 0.1,
              final_lr_frac: float = 0.1) -> float:
    """Multiplier of the peak learning rate at optimiser step `step` (0-based)."""
    w = max(1, int(round(warmup * scheduled_steps)))
    if step < w:
        return (step + 1) / w
    if step >= scheduled_steps:
        return final_lr_frac
    frac = (step - w) / max(1, scheduled_steps - w)
    return 1.0 - (1.0 - final_lr_frac) * frac


def train_to_convergence(
    *,
    n: int,
    batch: int,
    epochs: int,
    rule: PlateauRule,
    step: Callable[[torch.Tensor, float, int], None],
    evaluate: Callable[[], tuple[float, float]],
    generator: torch.Generator,
    warmup: float = 0.1,
    final_lr_frac: float = 1.0,
    log: Callable[[str], None] | None = None,
) -> dict:
    r"""Run epochs of shuffled mini-batches until `rule` is met (or its cap).

    Parameters
    ----------
    n : int
        Training-set size; batches are index tensors into `range(n)`.
    batch : int
        Mini-batch size (the last batch of an epoch may be smaller).
    epochs : int
        The scheduled number of epochs $E$ (the rule is tested from epoch $E$ on).
    rule : PlateauRule
        The convergence rule.
    step : callable
        `step(idx, lr_factor, epoch)`: one optimiser step on the examples `idx` (`epoch`
        counts from 1; epochs after $E$ are extension epochs).
    evaluate : callable
        `evaluate() -> (loss, acc)` on the full training set (own labels, own objective).
    generator : torch.Generator
        Shuffles the epochs.
    log : callable, optional
        Receives one line per evaluated epoch.

    Returns
    -------
    dict
        `{"history": [{"epoch", "loss", "acc"}], "converged": bool, "epochs_run": int,
        "converged_epoch": int | None, "steps": int, "train_s": float}`.
    """
    if epochs < rule.k + 1:
        raise ValueError(f"epochs={epochs} must exceed the plateau window k={rule.k}")
    per_epoch = math.ceil(n / batch)
    scheduled = epochs * per_epoch
    history: list[dict] = []
    t0, done, converged = time.perf_counter(), 0, False
    e = 0
    for e in range(1, rule.max_epochs + 1):
        perm = torch.randperm(n, generator=generator)
        for i in range(0, n, batch):
            step(perm[i:i + batch], lr_factor(done, scheduled, warmup=warmup,
                                              final_lr_frac=final_lr_frac), e)
            done += 1
        if e >= epochs - rule.k:
            loss, acc = evaluate()
            history.append({"epoch": e, "loss": float(loss), "acc": float(acc)})
            if log is not None:
                log(f"epoch {e}: train loss {loss:.4f} acc {acc:.4f}")
            if rule.met(history, epochs):
                converged = True
                break
    return {"history": history, "converged": converged, "epochs_run": e,
            "converged_epoch": e if converged else None, "steps": done,
            "train_s": time.perf_counter() - t0}


def fit_record(hyper: dict, fit: dict, rule: PlateauRule, *, train: tuple[float, float],
               train_clean_acc: float, test: tuple[float, float], subset: torch.Tensor,
               fitted_labels: torch.Tensor) -> dict:
    """The record of a fine-tuned member.

    Its hyperparameters, the result of
    [`train_to_convergence`][quotient_manifolds.experiments.finetune.train_to_convergence],
    the rule, the `(loss, accuracy)` on the training set with its own labels (`train`) and on
    the test split (`test`), the training accuracy on the clean labels, the gaps (the
    classification gap `gap` = test error − train error, and `loss_gap`), the training
    subset and the fitted labels.
    """
    (tr_loss, tr_acc), (te_loss, te_acc) = train, test
    return {"hyper": hyper, **fit, "rule": rule.to_dict(), "train_loss": tr_loss,
            "train_acc": tr_acc, "train_error": 1 - tr_acc,
            "train_acc_clean_labels": train_clean_acc, "test_loss": te_loss,
            "test_acc": te_acc, "test_error": 1 - te_acc, "gap": tr_acc - te_acc,
            "loss_gap": te_loss - tr_loss, "subset": subset.tolist(),
            "fitted_labels": fitted_labels.tolist()}


# -- the one-factor-at-a-time design -------------------------------------------------------
@dataclass(frozen=True)
class DesignPoint:
    """One member of a population design.

    Attributes
    ----------
    label : str
        The prefix of the member's id: `m<index>` for a base or an extra member (the index
        of its draw from the population's sampler), `<base>_<axis><k>` for an alternate.
    hyper : dict
        The member's hyperparameters (with its `seed`).
    base : str or None
        The label of the base member whose one-factor-at-a-time groups it belongs to (its
        own label for a base); None for an extra member, which belongs to no group.
    axis : str or None
        The one hyperparameter in which an alternate differs from its base; None for a base
        or an extra member.
    """

    label: str
    hyper: dict
    base: str | None = None
    axis: str | None = None

    def to_dict(self) -> dict:
        """`{"label", "base", "axis"}` (the member's place in the design, for results)."""
        return {"label": self.label, "base": self.base, "axis": self.axis}


def ofat_alternates(value: Any, levels: Sequence, *, log: bool = False) -> list:
    r"""The levels of one axis that an alternate of a base with `value` takes.

    Every level except the one nearest to `value` (in $\log$ if `log`; ties go to the first
    level), in the order of `levels`. A discrete axis whose levels contain `value` gets all
    the other levels; a continuous axis (e.g. the learning rate, levels at the ends and the
    geometric middle of its sampled range) gets the two levels farthest from the base.
    """
    def dist(a: Any) -> float:
        if log:
            return abs(math.log(float(a)) - math.log(float(value)))
        return abs(float(a) - float(value))

    near = min(range(len(levels)), key=lambda i: (dist(levels[i]), i))
    return [v for i, v in enumerate(levels) if i != near]


def ofat_design(
    bases: Sequence[tuple[str, dict]],
    levels: Mapping[str, Sequence],
    *,
    log_axes: Sequence[str] = ("lr",),
    n_seeds: int = 2,
    seed_offset: int = 1000,
    extras: Sequence[tuple[str, dict]] = (),
) -> list[DesignPoint]:
    r"""A one-factor-at-a-time design: groups of members that differ in one hyperparameter.

    The granulated τ of Jiang et al. (2020) averages, per hyperparameter axis, the τ inside
    groups of members that differ *only* in that axis; independently sampled
    hyperparameters give no such groups. Here each base member (`(label, hyper)`) gets, for
    every axis of `levels`, alternates that copy the base and change only that axis to each
    level of [`ofat_alternates`][quotient_manifolds.experiments.finetune.ofat_alternates]
    (an axis in `log_axes` is compared in log scale), and `n_seeds` alternates that change
    only the seed (to `seed + seed_offset * k`, k = 1 … `n_seeds`). The base and its
    alternates along axis $i$ form one group of axis $i$. `extras` are further members
    (e.g. ones trained before the design) that belong to no group.

    Returns
    -------
    list of DesignPoint
        Per base: the base, then its alternates axis by axis (labels
        `<base>_<axis><k>`, k from 1); then the extras. Deterministic.
    """
    out: list[DesignPoint] = []
    for label, base in bases:
        out.append(DesignPoint(label, dict(base), label, None))
        for axis, lv in levels.items():
            if axis not in base:
                raise KeyError(f"axis {axis!r} is not a hyperparameter of base {label!r} "
                               f"({sorted(base)})")
            for k, v in enumerate(ofat_alternates(base[axis], lv, log=axis in log_axes), 1):
                v = float(v) if isinstance(base[axis], float) else int(v)
                out.append(DesignPoint(f"{label}_{axis}{k}", {**base, axis: v}, label, axis))
        for k in range(1, n_seeds + 1):
            out.append(DesignPoint(f"{label}_seed{k}",
                                   {**base, "seed": int(base["seed"]) + seed_offset * k},
                                   label, "seed"))
    out += [DesignPoint(label, dict(h)) for label, h in extras]
    labels = [p.label for p in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate labels in the design: {labels}")
    return out


# -- the population template of the fine-tuned populations -----------------------------------
class FinetuneExperiment(PopulationExperiment):
    r"""A converged fine-tuned population measured over a ρ sweep.

    Subclasses provide the training hooks of
    [`PopulationExperiment`][quotient_manifolds.experiments.template.PopulationExperiment]
    plus `build(ctx, member, state, quick)` (the member's model), `batches(ctx, member,
    quick)` (the fixed measurement batches, own labels), `loss_fn(model, batch)`, and the
    measurement settings below. The measurement protocol, fixed before any τ is computed:

    * members that did not meet the convergence rule are reported and not measured;
    * the radius of each family (the worst case of the adaptive, inv and mix norms, and the
      average case of each) is calibrated once, on the first converged member, by
      [`calibrate_rho`][quotient_manifolds.experiments.rho_sweep.calibrate_rho]
      (1-2-5 grid, loss increase closest to 0.1 nats), and cached;
    * every measure of `SWEEP_MEASURES` runs at the calibrated radius of its norm times
      `RHO_FACTORS` (1/3, 1, 3), headline at 1
      ([`measure_sweep`][quotient_manifolds.experiments.rho_sweep.measure_sweep]).
    """

    gap_name = "test error − train error"
    n_iter: int = 20
    quick_n_iter: int = 2
    float64: bool = False
    seed: int = 0
    params_doc: str = "every parameter"
    #: the keys of `SWEEP_MEASURES` that are measured (default: `DEFAULT_SWEEP`)
    sweep_names: tuple[str, ...] | None = None

    def _sweep_names(self) -> tuple[str, ...]:
        from .rho_sweep import DEFAULT_SWEEP

        return DEFAULT_SWEEP if self.sweep_names is None else tuple(self.sweep_names)

    def design(self, quick: bool) -> list[DesignPoint]:
        """The population's members, in training order (an
        [`ofat_design`][quotient_manifolds.experiments.finetune.ofat_design]); fixed in code."""
        raise NotImplementedError

    def hypers(self, quick: bool) -> list[dict]:
        return [p.hyper for p in self.design(quick)]

    def labels(self, quick: bool) -> list[str]:
        return [p.label for p in self.design(quick)]

    def params(self, quick: bool) -> Callable[[str, torch.Tensor], bool] | None:
        """Predicate `(name, param) -> bool` of the perturbed weights (None: all)."""
        return None

    def build(self, ctx: Any, member: Member, state: Mapping[str, torch.Tensor],
              quick: bool) -> nn.Module:
        raise NotImplementedError

    def batches(self, ctx: Any, member: Member, quick: bool) -> list:
        raise NotImplementedError

    def batches_doc(self, quick: bool) -> str:
        raise NotImplementedError

    @staticmethod
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def keep(self, member: Member, quick: bool) -> bool:
        return bool(member.meta["converged"])

    def train_logged(self, out: str | os.PathLike, *, quick: bool = False,
                     progress: bool = True, log: Callable[[str], None] | None = None
                     ) -> tuple[PopulationStore, list[str]]:
        """Train every member not yet on disk (resumable), with `log` given each member's
        progress; returns the store and the members' ids."""
        store = PopulationStore(out, self.name)
        ctx = self.prepare(store, quick)
        ctx["log"] = log
        store, members, _ = self.train_population(out, quick=quick, progress=progress, ctx=ctx)
        return store, [m.id for m in members]

    def train_in_background(self, argv: Sequence[str]) -> None:
        """The body of `python -m <module> OUT [--quick]`: train with time-stamped log lines
        on stdout (for a background run, resumable; the caller sets the threads)."""

        def log(msg: str) -> None:
            print(time.strftime("%H:%M:%S"), msg, flush=True)

        self.train_logged(argv[1], quick="--quick" in argv, progress=False, log=log)
        log("done")

    def measure_protocol(self, quick: bool) -> dict:
        from .rho_sweep import (
            CALIBRATION_MEASURES,
            CALIBRATION_TARGET,
            RHO_CANDIDATES,
            RHO_FACTORS,
            SWEEP_MEASURES,
        )

        return {"measures": {k: list(SWEEP_MEASURES[k]) for k in self._sweep_names()},
                "calibration": {"measures": CALIBRATION_MEASURES, "target": CALIBRATION_TARGET,
                                "grid": list(RHO_CANDIDATES), "member": "first converged"},
                "factors": list(RHO_FACTORS), "average_rho": "rho (per direction, calibrated)",
                "n_iter": self.quick_n_iter if quick else self.n_iter, "seed": self.seed,
                "dtype": "float64" if self.float64 else "float32",
                "batches": self.batches_doc(quick), "params": self.params_doc}

    def _model(self, ctx: Any, store: PopulationStore, member: Member,
               quick: bool) -> nn.Module:
        """The member's model (the measures perturb the weights selected by `params`)."""
        state, _ = store.load_member(member.id)
        return self.build(ctx, member, state, quick)

    def calibration(self, ctx: Any, store: PopulationStore, members: Sequence[Member],
                    mhash: str, quick: bool) -> dict:
        """The calibrated radii (computed once on the first converged member, then cached)."""
        import json

        from .rho_sweep import calibrate_rho
        from .store import atomic_write_text

        path = store.dir / f"calibration-{mhash}.json"
        if path.exists():
            return json.loads(path.read_text())["calibration"]
        m = members[0]
        model = self._model(ctx, store, m, quick)
        if self.float64:
            model = model.double()
        batches = self.batches(ctx, m, quick)
        if self.float64:
            from .sharpness_suite import to_float64

            batches = [to_float64(b) for b in batches]
        cal = calibrate_rho(model, self.loss_fn, batches,
                            n_iter=self.quick_n_iter if quick else self.n_iter,
                            params=self.params(quick), seed=self.seed,
                            max_evals=2 if quick else 12)
        atomic_write_text(path, json.dumps({"member": m.id, "calibration": cal}, indent=1))
        return cal

    def measure(self, ctx: Any, store: PopulationStore, members: Sequence[Member], mhash: str,
                quick: bool, progress: bool) -> None:
        import sys

        from tqdm.auto import tqdm

        from .rho_sweep import (
            SWEEP_MEASURES,
            SweepSettings,
            measure_sweep,
            sweep_done,
            sweep_radii,
        )

        if not members:
            ctx["calibration"] = {}
            return
        cal = self.calibration(ctx, store, members, mhash, quick)
        ctx["calibration"] = cal
        radii = sweep_radii(cal)
        names = self._sweep_names()
        settings = SweepSettings(radii=radii, n_iter=self.quick_n_iter if quick else self.n_iter,
                                 seed=self.seed, names=names, params=self.params(quick),
                                 float64=self.float64)
        total = len(members) * sum(len(radii[SWEEP_MEASURES[k][1]]) for k in names)
        bar = tqdm(total=total, desc=f"{self.name}: sharpness", file=sys.stderr,
                   disable=not progress)
        for m in members:
            cached = store.load_measures(m.id, mhash)
            if sweep_done(cached, settings):
                m.measures = cached
                bar.update(sum(len(radii[SWEEP_MEASURES[k][1]]) for k in names))
                continue
            model = self._model(ctx, store, m, quick)
            m.measures = measure_sweep(
                model, self.loss_fn, self.batches(ctx, m, quick), settings=settings,
                cached=cached, save=functools.partial(store.save_measures, m.id, mhash), bar=bar)
        bar.close()

    def measured(self, store: PopulationStore, member: Member, mhash: str,
                 quick: bool) -> bool:
        import json

        from .rho_sweep import SweepSettings, sweep_done, sweep_radii

        path = store.dir / f"calibration-{mhash}.json"
        if not path.exists():
            return False
        radii = sweep_radii(json.loads(path.read_text())["calibration"])
        return sweep_done(store.load_measures(member.id, mhash),
                          SweepSettings(radii=radii, n_iter=0, seed=self.seed,
                                        names=self._sweep_names()), allow_errors=True)

    def settings(self, quick: bool) -> dict:
        """The population's description for `results.json` (sampler, grid)."""
        raise NotImplementedError

    def design_doc(self, quick: bool) -> dict:
        """The design for `results.json`: its rule, the OFAT axes and levels, and the labels
        of the bases, alternates and extras."""
        pts = self.design(quick)
        return {"kind": "one factor at a time around base members",
                "axes": sorted({p.axis for p in pts if p.axis is not None}),
                "bases": [p.label for p in pts if p.base == p.label],
                "extras": [p.label for p in pts if p.base is None],
                "n_members": len(pts), **self.design_rule(quick)}

    def design_rule(self, quick: bool) -> dict:
        """How the design was made (levels, seeds, where the bases come from)."""
        return {}

    def finish(self, ctx: Any, store: PopulationStore, members: Sequence[Member],
               dropped: Sequence[Member], *, mhash: str, quick: bool, t_start: float) -> dict:
        import time

        from .rho_sweep import finish_sweep

        points = {p.label: p for p in self.design(quick)}

        def record(m):
            meta = m.meta
            return {"id": m.id, "hyper": {k: v for k, v in m.hyper.items() if k != "seed"},
                    "seed": m.hyper["seed"], "design": points[m.id.rsplit("-", 1)[0]].to_dict(),
                    "gap": meta["gap"], "loss_gap": meta["loss_gap"],
                    **{k: meta[k] for k in ("train_loss", "train_acc", "train_acc_clean_labels",
                                            "test_loss", "test_acc", "converged",
                                            "converged_epoch", "epochs_run", "steps",
                                            "train_s", "history")}}

        records = [{**record(m), "measures": m.measures,
                    "measures_norms": m.measures.get("_norms", {})} for m in members]
        everyone = [*members, *dropped]
        design = self.design_doc(quick)
        settings = {"population": self.settings(quick), "design": design,
                    "training": self.training(quick),
                    "measure_protocol": self.measure_protocol(quick),
                    "measure_protocol_hash": mhash, "quick": quick,
                    "unavailable_measures": sorted({u for m in members
                                                    for u in m.measures.get("_unavailable", [])})}
        extra = {"convergence": {
                     "rule": self.training(quick)["rule"], "n_members": len(everyone),
                     "n_converged": len(members),
                     "not_converged": [{k: v for k, v in record(m).items()
                                        if k in ("id", "hyper", "epochs_run", "train_acc",
                                                 "history")} for m in dropped],
                     "epochs_run": {m.id: m.meta["epochs_run"] for m in everyone}},
                 "train_time_s_total": sum(m.meta["train_s"] for m in everyone),
                 "train_wall_s_total": sum(m.meta.get("wall_s", math.nan) for m in everyone),
                 "run_time_s": time.perf_counter() - t_start}
        return finish_sweep(self.name, store.dir, records, gap_name=self.gap_name,
                            calibration=ctx.get("calibration", {}), settings=settings,
                            second_gap=("test CE − train CE", "loss_gap"), extra=extra,
                            n_boot=200 if quick else 2000,
                            granulated_axes=design["axes"])


def convergence_table(out: str, name: str) -> str:
    """A Markdown table of the trained members of population `name` under `out` (docs pages):
    hyperparameters, epochs run, the last evaluated epochs `(L_e, a_e)`, train/test accuracy,
    gap and training time, by member label (a base is followed by its alternates)."""
    import json
    from pathlib import Path

    rows = []
    for f in sorted((Path(out) / name / "members").glob("m*.json")):
        m = json.loads(f.read_text())
        h = m["hyper"]
        keys = [k for k in h if k != "seed"]
        last = " ".join(f"({e['epoch']}: {e['loss']:.3g}, {e['acc']:.3f})"
                        for e in m["history"][-3:])
        rows.append([f.stem.rsplit("-", 1)[0]] + [f"{h[k]:.2g}" if isinstance(h[k], float)
                                              else str(h[k]) for k in keys]
                    + [str(m["epochs_run"]) + ("" if m["converged"] else " (not converged)"),
                       last, f"{m['train_acc']:.3f}", f"{m['test_acc']:.3f}",
                       f"{m['gap']:+.3f}", f"{m['train_s']:.0f}"])
    if not rows:
        return ""
    head = ["member", *keys, "epochs run", "last evaluated epochs (loss, acc)", "train acc",
            "test acc", "gap", "train s (wall)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
