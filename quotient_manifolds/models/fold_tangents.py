r"""The orbit tangent $V_f$ of one translation fold, on the vector of its component's entries.

[`FoldTangent`][quotient_manifolds.models.fold_tangents.FoldTangent] evaluates $V_f \theta$ and
$V_f^\top y$ for
[`TranslationConstraint`][quotient_manifolds.models.translations.TranslationConstraint], in one
of three forms: a value broadcast along an axis (a plain centring, the shift between two
embedding tables), the dense matrix of its columns (a small fold), or forward and reverse mode
through the fold's `act_at` (a large one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.func import jacfwd, jvp, vjp

from .families.centring import CentringFold, ReaderCentringFold
from .families.embeddings import EmbeddingShiftFold
from .symmetry import Fold

__all__ = ["DISJOINT", "FoldTangent"]

DISJOINT = (CentringFold, ReaderCentringFold, EmbeddingShiftFold)
"""The folds whose orbit tangents have columns with disjoint supports."""

Params = Mapping[str, torch.Tensor]


class FoldTangent:
    r"""$V_f$ of one fold on its component's vector (the component's entries, concatenated;
    its columns: the fold's `act_at` coordinates).

    Four forms: a value broadcast along an axis (a plain centring), the dense `(k, n)` matrix
    of its columns on its own entries (when `k × entries` is at most `dense_limit`: made once,
    by forward mode batched over the coordinates), for a large fold whose columns have disjoint
    supports (a reader centring) $V_f\theta = v \odot \theta_c$ with $v = V_f \mathbb 1$ and
    the coordinate $c$ of each entry (made once, checked), or forward and reverse mode through
    the fold's `act_at` per product (a large fold, e.g. the tied word table's shift)."""

    def __init__(self, fold: Fold, params: Params, slots: Mapping[str, Any],
                 dtype: torch.dtype, dense_limit: float) -> None:
        self.fold = fold
        self.k = int(fold.lie_dim(params))
        names = [n for n in fold.params if n in slots]
        self._theta0 = theta0 = torch.zeros(self.k, dtype=dtype, device=_device(params))
        self.disjoint = isinstance(fold, DISJOINT)
        self.names: list[str] = []
        self.C: torch.Tensor | None = None
        self._columns_of: tuple[torch.Tensor, torch.Tensor] | None = None  # (v, c), see below
        self.fixed = False
        self._lines: dict[str, list[int]] = {}  # a closed form: θ broadcast from these shapes
        self._signs: dict[str, float] = {}
        if not names or self.k == 0:  # its orbit lies in the GL blocks and frozen entries
            return

        def moved(names):
            return lambda th: {n: fold.act_at(params, th)[n] for n in names}

        closed = isinstance(fold, CentringFold) and type(fold).act_at is CentringFold.act_at
        if closed and isinstance(fold, CentringFold):
            name, axis = fold.param, fold.axis  # a value broadcast along an axis
            w = params[name]
            line = list(w.shape)
            line[axis] = 1
            self._tangent = lambda th: {name: th.view(line).expand(w.shape)}
            self._adj = lambda cot: (cot[name].sum(axis).reshape(-1),)
            self._lines = {name: line}
        elif type(fold).act_at is EmbeddingShiftFold.act_at and isinstance(fold,
                                                                             EmbeddingShiftFold):
            closed = True  # a row broadcast along two tables, with opposite signs
            word, other = fold.word, fold.other
            ws, os_ = params[word].shape, params[other].shape
            self._tangent = lambda th: {word: th.view(os_[1:]).expand(ws),
                                        other: -th.view(os_[1:]).expand(os_)}
            row = [1, *os_[1:]]
            self._lines = {word: row, other: row}
            self._signs = {other: -1.0}
            zero = torch.zeros(self.k, dtype=dtype, device=theta0.device)
            self._adj = lambda cot: ((cot[word].sum(0).reshape(-1) if word in cot else zero)
                                     - (cot[other].sum(0).reshape(-1) if other in cot
                                        else zero),)
        else:
            params = _own_storage(params, [fold])
            self._tangent = lambda th: jvp(self._fn, (theta0,), (th,))[1]
            self._adj = lambda cot: self._vjp(cot)
        # V_f the same at every point of the perturbation: a broadcast, or a reader centring
        # whose gain and shift are not perturbed (norm parameters are never in GL blocks)
        self.fixed = closed or (isinstance(fold, ReaderCentringFold) and not any(
            n in slots for n in (fold.gain, fold.shift) if n))
        probe = torch.randn(self.k, dtype=dtype, generator=torch.Generator().manual_seed(0))
        self._fn = moved(names)
        tang = self._tangent(probe.to(theta0.device))
        self.names = [n for n in names if bool(self._gather(tang[n], slots[n]).ne(0).any())]
        self.slots = {n: slots[n] for n in self.names}
        if not self.names:
            return
        self._fn = moved(self.names)
        self._shapes = {n: params[n].shape for n in self.names}
        self.local = {}  # where each slot sits in the tangent's own vector
        at = 0
        for n, e in self.slots.items():
            self.local[n], at = (at, at + e.stop - e.start), at + e.stop - e.start
        self.n = at
        whole = sum(params[n].numel() for n in self.names)
        if not closed and self.k * whole <= dense_limit:
            self.C = self._columns()
        elif not closed and self.disjoint and self._gather_columns():
            pass  # V θ = v ⊙ θ[col]: no autodiff per product
        elif not closed:
            self._vjp = vjp(self._fn, theta0)[1]

    def _own_tangent(self, theta: torch.Tensor) -> torch.Tensor:
        """$V_f \theta$ on the tangent's own entries (forward mode)."""
        tang = self._tangent(theta)
        return torch.cat([self._gather(tang[n], e).reshape(-1) for n, e in self.slots.items()])

    def _gather_columns(self) -> bool:
        r"""For columns with disjoint supports: $V_f 	heta = v \odot 	heta_{c}$ with
        $v = V_f \mathbb 1$ and $c$ the coordinate that moves each entry (read off
        $V_f (1, 2, \dots, k)^	op / v$), checked against forward mode on a random $	heta$.
        Stores `(v, c)` and returns whether the check passed."""
        th = self._theta0
        v = self._own_tangent(torch.ones_like(th))
        ramp = self._own_tangent(torch.arange(1, self.k + 1, dtype=th.dtype, device=th.device))
        moved = v != 0
        col = torch.where(moved, torch.round(ramp / torch.where(moved, v, 1.0)) - 1, 0.0)
        if bool(((col < 0) | (col >= self.k)).any()):
            return False
        col = col.to(torch.int32 if self.k < 2**31 else torch.int64)
        probe = torch.randn(self.k, dtype=th.dtype, generator=torch.Generator().manual_seed(1))
        probe = probe.to(th.device)
        want = self._own_tangent(probe)
        got = v * probe[col]
        tol = 1e3 * torch.finfo(th.dtype).eps * float(want.abs().max().clamp_min(1e-300))
        if not bool(((got - want).abs() <= tol).all()):
            return False
        self._columns_of = (v, col)
        return True

    @staticmethod
    def _gather(t: torch.Tensor, e: Any) -> torch.Tensor:
        flat = t.reshape(-1)
        return flat if e.index is None else flat[e.index]

    def _columns(self) -> torch.Tensor:
        """The dense `(k, n)` matrix of $V_f^\top$ on the tangent's own entries (forward mode,
        batched over the coordinates)."""
        jac = jacfwd(self._fn)(self._theta0)
        C = torch.empty(self.k, self.n, dtype=self._theta0.dtype, device=self._theta0.device)
        for n, e in self.slots.items():
            a, b = self.local[n]
            J = jac[n].reshape(-1, self.k)
            C[:, a:b] = (J if e.index is None else J[e.index]).T
        return C

    def bind(self, offsets: Mapping[tuple[int, int], int]) -> None:
        """Place the slots in the component's vector (`offsets[(start, stop)]`: the position of
        the flat span `[start, stop)` there)."""
        self.at = {n: offsets[(e.start, e.stop)] for n, e in self.slots.items()}

    def gram_diagonal(self, m: torch.Tensor, live: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        r"""A broadcast's $\operatorname{diag}(V_f^\top M V_f)$ (the sums of `m` over the
        entries each coordinate moves, its signs squared) and the coordinates that move an
        entry of infinite weight (`~live`), from the component's vectors, without temporaries
        of their size."""
        g = torch.zeros(self.k, dtype=m.dtype, device=m.device)
        dead = torch.zeros(self.k, dtype=torch.bool, device=m.device)
        for n, e in self.slots.items():
            o, shape, line = self.at[n], self._shapes[n], self._lines[n]
            axes = tuple(i for i, s in enumerate(line) if s == 1 and shape[i] != 1)
            mm = m[o:o + e.stop - e.start].view(shape)
            g += (mm.sum(axes) if axes else mm).reshape(-1)
            dd = ~live[o:o + e.stop - e.start].view(shape)
            dead |= (dd.any(axes) if axes else dd).reshape(-1)
        return g, dead

    def own(self, y: torch.Tensor) -> torch.Tensor:
        """The tangent's own entries of the component's vector `y`."""
        return torch.cat([y[self.at[n]:self.at[n] + b - a] for n, (a, b) in self.local.items()])

    def apply(self, theta: torch.Tensor, out: torch.Tensor) -> None:
        """`out += V_f theta` (`out`: the component's vector)."""
        theta = theta.to(self._theta0.dtype)
        if self.C is not None:
            v = self.C.T @ theta
            for n, (a, b) in self.local.items():
                o = self.at[n]
                out[o:o + b - a] += v[a:b].to(out.dtype)
            return
        if self._columns_of is not None:
            v, col = self._columns_of
            for n, (a, b) in self.local.items():
                o = self.at[n]
                out[o:o + b - a] += (v[a:b] * theta[col[a:b]]).to(out.dtype)
            return
        if self._lines and all(e.index is None for e in self.slots.values()):
            for n, e in self.slots.items():  # broadcast in place: no tangent materialised
                o = self.at[n]
                out[o:o + e.stop - e.start].view(self._shapes[n]).add_(
                    theta.view(self._lines[n]).to(out.dtype), alpha=self._signs.get(n, 1.0))
            return
        tang = self._tangent(theta)
        for n, e in self.slots.items():
            o = self.at[n]
            out[o:o + e.stop - e.start] += self._gather(tang[n], e).to(out.dtype)

    def adjoint(self, y: torch.Tensor) -> torch.Tensor:
        r"""$V_f^\top y$ for the component's vector `y`."""
        dt = self._theta0.dtype
        if self.C is not None:
            return (self.C @ self.own(y).to(dt)).to(y.dtype)
        if self._columns_of is not None:
            v, col = self._columns_of
            out = torch.zeros(self.k, dtype=dt, device=v.device)
            return out.index_add_(0, col, self.own(y).to(dt) * v).to(y.dtype)
        cot = {}
        for n, e in self.slots.items():
            ref = self._shapes[n]
            piece = y[self.at[n]:self.at[n] + e.stop - e.start].to(dt)
            if e.index is None:
                cot[n] = piece.view(ref)
            else:
                cot[n] = torch.zeros(ref.numel(), dtype=piece.dtype, device=piece.device
                                     ).index_copy(0, e.index, piece).view(ref)
        return self._adj(cot)[0].to(y.dtype)

    def columns(self, n: int) -> torch.Tensor:
        """The dense `(k, n)` matrix of $V_f^\top$ on the component's vector of length `n`."""
        own = self.C if self.C is not None else self._columns()
        C = torch.zeros(self.k, n, dtype=own.dtype, device=own.device)
        for name, (a, b) in self.local.items():
            o = self.at[name]
            C[:, o:o + b - a] = own[:, a:b]
        return C


def _device(params: Params) -> torch.device:
    return next(iter(params.values())).device if params else torch.empty(0).device


def _own_storage(params: Params, folds: Sequence[Fold]) -> dict[str, torch.Tensor]:
    """`params` with the folds' parameters copied out of any larger storage they view (forward
    mode through a view materialises a tangent of its whole base: a bias viewing the model's
    flat vector would have a tangent as large as the model)."""
    out = dict(params)
    for n in {n for f in folds for n in f.params if n in out}:
        t = out[n]
        if t.untyped_storage().nbytes() > t.numel() * t.element_size():
            out[n] = t.clone()
    return out
