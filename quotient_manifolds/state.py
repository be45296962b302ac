r"""Nothing lost: a model's state before a call, restored and checked after it.

[`preserved(model)`][quotient_manifolds.state.preserved] wraps every public call that runs the
user's model or loss (sharpness, discovery). On entry it records

* every module's `training` flag;
* every parameter: the object registered under its name, `requires_grad`, its version counter
  (bumped by in-place writes) and a fingerprint of its values (the float64 sums of $w$ and
  $w^2$, which also catch writes through `.data`); its `.grad` is set aside (`None` during the
  call, so that a backward of the user's own, e.g. a reversible layer's, accumulates nowhere
  that survives);
* every buffer: the object registered under its name and a copy of its values;
* the global random number generators (torch's CPU and every initialised CUDA device,
  Python's `random`, NumPy's).

On exit, normal or not (an exception, `KeyboardInterrupt`), it puts back the modes, the
replaced parameters and buffers, the buffer values, `requires_grad`, `.grad` and the
generators. What it cannot put back without a copy of every weight, a parameter written in
place, it reports: [`ModelStateError`][quotient_manifolds.errors.ModelStateError] names it.
A parameter replaced or a mode switched by user code is restored and also raises that error
(the losses were computed on another model); a buffer changed by the forward is restored with a
[`ModelStateWarning`][quotient_manifolds.errors.ModelStateWarning].
"""

from __future__ import annotations

import random
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .errors import ModelStateError, ModelStateWarning

__all__ = ["ModelSnapshot", "fingerprint", "preserved", "RNGState"]


class RNGState:
    """The global random number generators: torch (CPU, initialised CUDA devices), `random`,
    NumPy (when imported)."""

    def __init__(self) -> None:
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.python = random.getstate()
        np = _numpy()
        self.numpy = None if np is None else np.random.get_state()

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        np = _numpy()
        if np is not None and self.numpy is not None:
            np.random.set_state(self.numpy)


def _numpy() -> Any:
    import sys

    return sys.modules.get("numpy")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a sharded parameter of ``fully_shard``), else `t`: a
    fingerprint is of what this process holds, and computing it calls no collective."""
    dt = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before its import
    if dt is not None and isinstance(t, dt.DTensor):
        return t.to_local()
    return t


def fingerprint(t: torch.Tensor) -> tuple[float, float]:
    """The float64 sums of $t$ and $t^2$ (of $|t|$ for complex $t$): what detects a write, and
    what ranks compare to find out that they hold different tensors. Of a DTensor, the sums of
    this rank's shard (no collective)."""
    t = _local(t)
    if t.is_meta or t.numel() == 0:
        return (0.0, 0.0)
    with torch.no_grad():
        d = (t.detach().abs() if t.is_complex() else t.detach()).double()
        return float(d.sum()), float(d.square().sum())


def _same(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return all(x == y or (x != x and y != y) for x, y in zip(a, b, strict=True))  # NaN == NaN


class ModelSnapshot:
    """The state of `model` that a call must leave as it found it (see the module docstring).

    `grads_aside=True` sets every parameter's `.grad` to `None` until `restore`.
    """

    def __init__(self, model: nn.Module, *, grads_aside: bool = True) -> None:
        self.model = model
        self.modules = list(model.named_modules(remove_duplicate=False))
        self.modes = [(m, m.training) for _, m in self.modules]
        self.params: list[tuple[nn.Module, str, str, nn.Parameter, bool, int,
                                tuple[float, float], torch.Tensor | None]] = []
        self.buffers: list[tuple[nn.Module, str, str, torch.Tensor | None,
                                 torch.Tensor | None]] = []
        seen: set[int] = set()
        for prefix, m in self.modules:
            for name, p in list(m._parameters.items()):
                full = f"{prefix}.{name}" if prefix else name
                if p is None:
                    continue
                first = id(p) not in seen
                seen.add(id(p))
                self.params.append((m, name, full, p, p.requires_grad, p._version,
                                    fingerprint(p) if first else (0.0, 0.0), p.grad))
            for name, b in list(m._buffers.items()):
                full = f"{prefix}.{name}" if prefix else name
                self.buffers.append((m, name, full, b, None if b is None else b.detach().clone()))
        self.rng = RNGState()
        if grads_aside:
            for row in self.params:
                if row[7] is not None:
                    row[3].grad = None

    def restore(self) -> list[str]:
        """Put back everything that can be; return what user code changed (for the error)."""
        changed: list[str] = []
        for m, t in self.modes:
            m.training = t
        for m, name, full, p, rg, _, _, g in self.params:
            if m._parameters.get(name) is not p:
                changed.append(f"parameter {full!r} was replaced")
                m._parameters[name] = p
            if p.requires_grad != rg:
                p.requires_grad_(rg)
            p.grad = g
        buffers_changed = []
        for m, name, full, b, copy in self.buffers:
            if m._buffers.get(name) is not b:
                m._buffers[name] = b
                buffers_changed.append(full)
            if b is not None and copy is not None and not _equal(b, copy):
                with torch.no_grad():
                    b.copy_(copy)
                buffers_changed.append(full)
        for prefix, m in self.model.named_modules(remove_duplicate=False):
            for name in set(m._buffers) - {n for mm, n, *_ in self.buffers if mm is m}:
                del m._buffers[name]
                buffers_changed.append(f"{prefix}.{name}" if prefix else name)
        self.rng.restore()
        if buffers_changed:
            warnings.warn(
                f"the model's forward changed the buffer(s) {sorted(set(buffers_changed))} "
                "during the call; they were restored, but the losses were computed with the "
                "changing buffers", ModelStateWarning, stacklevel=4)
        return changed

    def written(self) -> list[str]:
        """The parameters whose values changed (in place, through `.data` or not)."""
        out = []
        seen: set[int] = set()
        for _, _, full, p, _, version, fp, _ in self.params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p._version != version or not _same(fingerprint(p), fp):
                out.append(full)
        return out

    def mode_switches(self) -> list[str]:
        """The modules whose `training` flag differs from `model.eval()`'s (for a check during
        an evaluation in eval mode)."""
        return [n or "<root>" for n, m in self.modules if m.training]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_meta:
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return bool(torch.equal(a, b))


@contextmanager
def preserved(model: nn.Module, *, grads_aside: bool = True) -> Iterator[ModelSnapshot]:
    """Record `model`'s state, run the block, restore it, and raise
    [`ModelStateError`][quotient_manifolds.errors.ModelStateError] if user code wrote to a
    parameter, replaced one or switched a mode (see the module docstring). The block's own
    exception wins over that error."""
    snap = ModelSnapshot(model, grads_aside=grads_aside)
    ok = False
    try:
        yield snap
        ok = True
    finally:
        changed = snap.restore()
        written = snap.written()
        problems = changed + [f"parameter {n!r} was written in place (it cannot be restored; "
                              "reload it)" for n in written]
        if problems and ok:
            raise ModelStateError(
                "user code (loss_fn or the model's forward) changed the model during the call: "
                + "; ".join(problems) + ". The result would not describe the model; compute "
                "the loss without changing the model (no m.train(), no writes to weights).")
