r"""The template of a trained-population reproduction: sample, train, measure, summarise.

Every transformer population (`grokking`, `vit-digits`, `lora-minilm`, `minilm-finetune`,
`vit-finetune`) runs the same skeleton,
[`PopulationExperiment.run`][quotient_manifolds.experiments.template.PopulationExperiment.run]:

1. `prepare` loads what the members share (data, a pretrained model) once;
2. the hyperparameters of every member come from `hypers` (a fixed sampler or design); a
   member's id is its label (`labels`, by default `m<index>`) plus a hash of its
   hyperparameters and the training protocol (`training`), so a changed protocol retrains
   instead of reusing stale weights;
3. every member not yet in the
   [`PopulationStore`][quotient_manifolds.experiments.store.PopulationStore] is trained
   (`train`) and saved;
4. members that fail the experiment's filter (`keep`) are reported, not measured;
5. `measure` computes the sharpness measures of the kept members, cached per member under
   the hash of the measure protocol (`measure_protocol`), so an interrupted run resumes;
6. `finish` writes `results.json` (schema of
   [`summarize`][quotient_manifolds.experiments.report.summarize])
   and the figures.

With `weights=DIR`, the records (training metadata, measures, results) stay under `out` and the
weights go to `DIR`, and each member is trained and measured before the next is trained, so
that a run cut off after any member keeps that member's records. A member whose records are
complete is not retrained; one whose measures are incomplete and whose weights are gone is
retrained and measured again.

A subclass fills in the hooks; the experiment module exposes
`run(out, *, quick=False, progress=True)` as `EXPERIMENT.run`. Hooks that call the
module's own functions look them up at call time, so tests can replace them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .store import PopulationStore, protocol_hash

__all__ = ["AT_MINIMUM_ACC", "Member", "PopulationExperiment", "at_minimum"]

#: the accuracy half of the fine-tuned populations' plateau rule, the part that can be checked
#: on populations trained without a per-epoch history
AT_MINIMUM_ACC = 0.99


def at_minimum(records: Sequence[Mapping], train_acc: Mapping[str, float]) -> dict:
    """Which members are at a minimum by the stated rule: training accuracy on their own
    (fitted) labels ≥ `AT_MINIMUM_ACC`. `train_acc` maps a member id to that accuracy.

    A τ on members that are not at a minimum says little about the sharpness of minima (away
    from a minimum the worst-case increase is dominated by the first-order term), so it is
    not read as evidence either way; this count says how much of a population it concerns.
    """
    ids = [str(r["id"]) for r in records if train_acc[str(r["id"])] >= AT_MINIMUM_ACC]
    return {"rule": f"train accuracy on own labels >= {AT_MINIMUM_ACC}", "n": len(ids),
            "of": len(records), "ids": ids}


@dataclass
class Member:
    """One trained member: its id, hyperparameters and training record."""

    id: str
    hyper: dict
    meta: dict
    measures: dict = field(default_factory=dict)


class PopulationExperiment:
    """Base class of a population reproduction (module docstring).

    Attributes
    ----------
    name : str
        The command-line name and the output sub-folder.
    """

    name: str = ""

    # -- hooks ---------------------------------------------------------------------------
    def prepare(self, store: PopulationStore, quick: bool) -> Any:
        """Shared resources of the run (passed to the other hooks as `ctx`)."""
        return None

    def hypers(self, quick: bool) -> list[dict]:
        """The hyperparameters of every member, in order (a fixed sampler)."""
        raise NotImplementedError

    def training(self, quick: bool) -> dict:
        """The training protocol; it enters every member's id."""
        raise NotImplementedError

    def labels(self, quick: bool) -> list[str]:
        """The id prefix of every member, in the order of `hypers` (default `m<index>`)."""
        return [f"m{i:02d}" for i in range(len(self.hypers(quick)))]

    def train(self, ctx: Any, hyper: dict, quick: bool) -> tuple[Mapping[str, torch.Tensor], dict]:
        """Train one member: `(state_dict, meta)`."""
        raise NotImplementedError

    def keep(self, member: Member, quick: bool) -> bool:
        """Whether a trained member is measured (default: every member)."""
        return True

    def measure_protocol(self, quick: bool) -> dict:
        """Everything that defines the measured values; its hash keys the measure cache."""
        raise NotImplementedError

    def measure(self, ctx: Any, store: PopulationStore, members: Sequence[Member],
                mhash: str, quick: bool, progress: bool) -> None:
        """Fill `member.measures` of every kept member (cached in `store` under `mhash`)."""
        raise NotImplementedError

    def measured(self, store: PopulationStore, member: Member, mhash: str,
                 quick: bool) -> bool:
        """Whether every measure of `member` is cached under `mhash` (default: never, so
        that the pipelined run measures each member after training it)."""
        return False

    def finish(self, ctx: Any, store: PopulationStore, members: Sequence[Member],
               dropped: Sequence[Member], *, mhash: str, quick: bool, t_start: float) -> dict:
        """Summarise: write `results.json` and the figures, return the results dict."""
        raise NotImplementedError

    # -- the skeleton --------------------------------------------------------------------
    def member_ids(self, hypers: Sequence[dict], training: Mapping,
                   labels: Sequence[str] | None = None) -> list[str]:
        """`<label>-<hash of hyperparameters and training protocol>`; the label defaults to
        `m<index>`."""
        if labels is None:
            labels = [f"m{i:02d}" for i in range(len(hypers))]
        for h in hypers:
            if set(h) & set(training):  # a protocol key would hide the hyperparameter
                raise ValueError(f"hyperparameters {sorted(set(h) & set(training))} are also "
                                 "keys of the training protocol; rename one of them")
        ids = [f"{lab}-{protocol_hash({**h, **training})[:8]}"
               for lab, h in zip(labels, hypers, strict=True)]
        if len(set(ids)) != len(ids):
            raise ValueError("two members have the same label and hyperparameters")
        return ids

    def train_population(self, out: str | os.PathLike, *, quick: bool = False,
                         progress: bool = True, ctx: Any = None,
                         weights: str | os.PathLike | None = None,
                         ) -> tuple[PopulationStore, list[Member], Any]:
        """Steps 1–3: train every member not on disk; returns the store, members and `ctx`."""
        store = PopulationStore(out, self.name, weights_root=weights)
        if ctx is None:
            ctx = self.prepare(store, quick)
        hypers = self.hypers(quick)
        ids = self.member_ids(hypers, self.training(quick), self.labels(quick))
        store.train_missing(ids, hypers, lambda h: self.train(ctx, dict(h), quick),
                            desc=f"{self.name}: train", progress=progress)
        members = [Member(mid, h, store.load_meta(mid)) for mid, h in zip(ids, hypers)]
        return store, members, ctx

    def run(self, out: str | os.PathLike, *, quick: bool = False, progress: bool = True,
            weights: str | os.PathLike | None = None) -> dict:
        """Train (or load) the population, measure it, write `out/<name>/results.json`.

        Parameters
        ----------
        out : path
            Output folder; results go to `out/<name>/`.
        quick : bool
            The experiment's smoke protocol (a few members, a few steps).
        progress : bool
            tqdm bars on stderr.
        weights : path, optional
            Keep the weights here, only the records under `out`, and train and measure one
            member at a time (module docstring).

        Returns
        -------
        dict
            The `results.json` content.
        """
        t_start = time.perf_counter()
        mhash = protocol_hash(self.measure_protocol(quick))
        if weights is None:
            store, members, ctx = self.train_population(out, quick=quick, progress=progress)
        else:
            store, members, ctx = self._train_and_measure(out, weights, mhash, quick, progress)
        kept = [m for m in members if self.keep(m, quick)]
        dropped = [m for m in members if not self.keep(m, quick)]
        self.measure(ctx, store, kept, mhash, quick, progress)
        return self.finish(ctx, store, kept, dropped, mhash=mhash, quick=quick, t_start=t_start)

    def _train_and_measure(self, out: str | os.PathLike, weights: str | os.PathLike,
                           mhash: str, quick: bool, progress: bool,
                           ) -> tuple[PopulationStore, list[Member], Any]:
        """The pipelined steps 3–5: each member trained (unless its records are complete),
        then measured, before the next. Members that another process holds
        (`PopulationStore.claim`) are skipped at first and waited for at the end."""
        store = PopulationStore(out, self.name, weights_root=weights)
        ctx = self.prepare(store, quick)
        hypers = self.hypers(quick)
        ids = self.member_ids(hypers, self.training(quick), self.labels(quick))

        def complete(mid: str, h: dict, wait: bool) -> Member | None:
            with store.claim(mid, wait=wait) as held:
                if not held:
                    return None
                m = Member(mid, h, store.load_meta(mid)) if store.has_meta(mid) else None
                done = m is not None and (not self.keep(m, quick)
                                          or self.measured(store, m, mhash, quick))
                if not done and not store.has_member(mid):
                    store.save_member(mid, *self.train(ctx, dict(h), quick))
                m = Member(mid, h, store.load_meta(mid))
                if not done and self.keep(m, quick):
                    self.measure(ctx, store, [m], mhash, quick, progress)
                return m

        found = {mid: complete(mid, h, wait=False) for mid, h in zip(ids, hypers, strict=True)}
        for mid, h in zip(ids, hypers, strict=True):
            found[mid] = found[mid] or complete(mid, h, wait=True)
        members = [m for m in found.values() if m is not None]  # all of them, in order
        return store, members, ctx
