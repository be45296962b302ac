r"""The orbit directions of the translation folds: perturbations made horizontal to them.

A translation fold of the complete group (LayerNorm writer and reader centring, the softmax
shift, post-norm shifts, embedding shifts) acts by $w \mapsto w + V t$, with $V$ fixed on its
orbit. Its canonical point removes the orbit from the base point; this module removes it from
the perturbations:
[`TranslationConstraint`][quotient_manifolds.models.translations.TranslationConstraint] is the
projection

$$
\Pi_V \xi = \xi - V (V^\top M V)^{+} V^\top M \xi
$$

of the adaptive part of a perturbation onto the complement of every orbit, orthogonal in the
adaptive metric $M = \operatorname{diag}(1/c^2)$, with $V = [V_1, \dots, V_k]$ the orbit
tangents of all translation folds at the canonical point, restricted to the adaptive entries
(the entries of GL blocks and frozen entries are not part of the flat vector).

**How $V$ is evaluated.** Each fold acts on a few parameters; the folds that share entries form
a component, projected on the vector of its own entries (a view of the flat vector where they
are adjacent), never on the whole flat vector. $V_f t$ is a value broadcast along an axis for a
plain centring and for the shift between two embedding tables (added in place, nothing
materialised); for a small fold (at most `dense_limit` coordinates × entries, e.g. a post-norm
shift on its biases) it is the product with the dense matrix of its columns, formed once by
forward mode batched over the coordinates; otherwise it is the derivative of the fold's
`act_at` at the canonical point (forward mode), $V_f^\top y$ its adjoint (reverse mode). The
$V_f$ of a writer, reader or embedding-shift fold have columns with disjoint supports (one
line, one row, one embedding coordinate each), so $V_f^\top M V_f$ is diagonal,
$\operatorname{diag}(V_f^\top (M \odot V_f \mathbb 1))$; a post-norm shift's columns overlap
in its readers' biases ($-W_j t$), and its $d \times d$ Gram matrix is formed explicitly. The
joint system $V^\top M V\, t = V^\top M \xi$ (the folds overlap: a writer's bias is also the
residual bias of a post-norm shift, the word table is centred and shifted) is solved directly
where $K \times$ entries is at most `dense_limit`, and otherwise by conjugate gradients
preconditioned by the folds' own Gram matrices: where the folds do not overlap this is exact in
one step, and a vector that is horizontal already (a Riemannian gradient of an invariant loss)
costs one product with $V^\top$.

**Entries of infinite weight.** With `adaptive_eps = 0` a zero weight has $c^2 = 0$: the metric
is infinite there and the entry never moves. A vertical direction $V t$ that moves such an
entry has infinite length; the horizontal space (the limit of $\varepsilon \to 0$) constrains
only the directions with $(V t)_F = 0$ on these entries $F$. The solve is restricted to those
$t$: a post-norm shift whose canonical $\beta = 0$ has infinite weight imposes nothing (its
frozen slice $\xi_\beta = 0$ is then already horizontal), nor does an embedding shift whose
canonical first row is zero.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..manifolds.adaptive import AdaptiveEuclidean, AdaptiveTangentSpace
from ..manifolds.constrained import (
    ConstrainedAdaptiveTangentSpace,
    LinearConstraint,
    SlicedInvC2,
)
from .families.centring import CentringFold, ReaderCentringFold
from .families.embeddings import EmbeddingShiftFold
from .families.norm_shift import NormShiftFold
from .families.rotation import RotationFold
from .fold_tangents import FoldTangent
from .symmetry import Fold

__all__ = ["RowsConstraint", "TRANSLATIONS", "TranslationConstraint", "adaptive_space",
           "horizontal_translations", "rows_space", "translation_folds"]

TRANSLATIONS = (CentringFold, ReaderCentringFold, NormShiftFold, EmbeddingShiftFold)
"""The translation folds whose orbits the perturbations are made horizontal to (the softmax
shift is a `CentringFold`, the tied embedding shift an `EmbeddingShiftFold`)."""

_SLICED = (NormShiftFold, EmbeddingShiftFold)  # folds that freeze a slice of their orbit

Params = Mapping[str, torch.Tensor]


def _key(f: Fold) -> tuple:
    if isinstance(f, ReaderCentringFold):
        c = f.consumer
        return ("reader", c.weight, c.in_axis, c.start, c.stop)
    if isinstance(f, CentringFold):
        return ("centring", f.param, f.axis)
    return (type(f).__name__, f.params)


def translation_folds(folds: Sequence[Fold]) -> list[Fold]:
    """The translation folds among `folds` and the gauges of their rotation folds, each orbit
    once (a rotation's gauge repeats the centrings that are also claimed on their own)."""
    out: dict[tuple, Fold] = {}
    for f in folds:
        for g in (f.gauge if isinstance(f, RotationFold) else (f,)):
            if isinstance(g, TRANSLATIONS):
                out.setdefault(_key(g), g)
    return list(out.values())


def _unfreeze(frozen: Mapping[str, torch.Tensor], folds: Sequence[Fold],
              translations: Sequence[Fold], base: Params) -> dict[str, torch.Tensor]:
    """`frozen` without the slices of the sliced translations (their entries become free, and
    horizontal by the constraint), except where another fold freezes them too."""
    freed: dict[str, torch.Tensor] = {}
    for f in translations:
        if isinstance(f, _SLICED):
            for n, m in f.frozen(base).items():
                freed[n] = m if n not in freed else freed[n] | m
    if not freed:
        return dict(frozen)
    kept: dict[str, torch.Tensor] = {}
    for f in folds:
        for g in (f.gauge if isinstance(f, RotationFold) else (f,)):
            if not isinstance(g, _SLICED):
                for n, m in g.frozen(base).items():
                    kept[n] = m if n not in kept else kept[n] | m
    out = {}
    for n, m in frozen.items():
        if n in freed:
            m = m & ~(freed[n] & ~kept.get(n, torch.zeros_like(m)))
        if bool(m.any()):
            out[n] = m
    return out


def _spans(tangents: Sequence[FoldTangent]
           ) -> tuple[list[tuple[int, int]], dict[tuple[int, int], int]]:
    """The slots' spans of the flat vector, sorted, and each one's offset among them."""
    spans = sorted({(e.start, e.stop) for t in tangents for e in t.slots.values()})
    offsets, at = {}, 0
    for a, b in spans:
        offsets[(a, b)], at = at, at + b - a
    return spans, offsets


class _Component:
    r"""Translation folds that share adaptive entries, solved together on the vector of their
    entries: `"diag"` (one fold with disjoint columns), `"dense"` (its Gram matrix formed
    explicitly) or `"cg"` (conjugate gradients, for large coupled folds)."""

    def __init__(self, tangents: list[FoldTangent], dtype: torch.dtype, dense_limit: float) -> None:
        self.tangents = tangents
        self.dtype = dtype
        self.spans, offsets = _spans(tangents)
        for t in tangents:
            t.bind(offsets)
        self.n = sum(b - a for a, b in self.spans)
        self.adjacent = all(b == a for (_, b), (a, _) in zip(self.spans, self.spans[1:]))
        self.K = sum(t.k for t in tangents)
        self.fixed = all(t.fixed for t in tangents)
        if len(tangents) == 1 and tangents[0].disjoint:
            self.kind = "diag"
        elif self.K * self.n <= dense_limit:
            self.kind = "dense"
            self.C = torch.cat([t.columns(self.n) for t in tangents])
        else:
            self.kind = "cg"
        self._pre: dict[int, tuple[torch.Tensor | SlicedInvC2 | _Shifted, Any]] = {}
        self._buffer: torch.Tensor | None = None

    def gather(self, x: torch.Tensor | SlicedInvC2 | _Shifted) -> torch.Tensor:
        """The component's vector of the flat vector `x` (a view where its spans are adjacent)."""
        if self.adjacent:
            return x[self.spans[0][0]:self.spans[-1][1]]
        return torch.cat([x[a:b] for a, b in self.spans])

    def scatter(self, z: torch.Tensor, x: torch.Tensor | _Shifted) -> None:
        """Write the component's vector `z` back into `x` (in `x`'s dtype)."""
        if self.adjacent:
            x[self.spans[0][0]:self.spans[-1][1]] = z
            return
        at = 0
        for a, b in self.spans:
            x[a:b] = z[at:at + b - a]
            at += b - a

    def V(self, thetas: Sequence[torch.Tensor]) -> torch.Tensor:
        """$V \theta$ on the component's vector (a buffer reused by the next call)."""
        out = self._buffer
        if out is None or out.device != thetas[0].device:
            out = self._buffer = torch.zeros(self.n, dtype=self.dtype, device=thetas[0].device)
        else:
            out.zero_()
        for t, th in zip(self.tangents, thetas, strict=True):
            t.apply(th, out)
        return out

    def Vt(self, y: torch.Tensor) -> list[torch.Tensor]:
        return [t.adjoint(y) for t in self.tangents]

    def _prepare(self, m: torch.Tensor | SlicedInvC2 | _Shifted
                 ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """`(m on the component's entries, m > 0 there, what a projection with the weights m
        needs)`. The preconditioners are kept for the last two `m` (a space alternates between
        its metric and a ball's weights); `m` on the entries is read again at every call (a
        view where they are adjacent, else a slice-by-slice read), never stored: two cached
        copies were 10 B per entry of the ascent state's peak."""
        mi = self.gather(m)
        live = mi > 0
        hit = self._pre.get(id(m))
        if hit is not None and hit[0] is m:
            return mi, live, hit[1]
        m64 = mi.to(self.dtype)  # the preconditioners are made in self.dtype, once per m
        if self.kind == "dense":
            pre: Any = _restricted_pinv((self.C * m64) @ self.C.T, self.C[:, ~live])
        else:
            pre = [_fold_preconditioner(t, m64, live, self.n, self.dtype) for t in self.tangents]
        del m64
        if len(self._pre) >= 2:
            self._pre.pop(next(iter(self._pre)))
        self._pre[id(m)] = (m, pre)
        return mi, live, pre

    def project(self, x: torch.Tensor | _Shifted, m: torch.Tensor | SlicedInvC2 | _Shifted,
                tol: float, max_iter: int) -> int:
        r"""`x` ← $\Pi_V x$ on this component's entries (in place); the iterations used."""
        mi, live, pre = self._prepare(m)
        z = self.gather(x)
        own = z.dtype == self.dtype and self.adjacent  # z is a view of x: written in place
        z = z.to(self.dtype)
        iters = 1
        if self.kind == "dense":
            z -= self.C.T @ (pre @ (self.C @ (mi * z)))
        elif self.kind == "diag":
            t = [pre[0][1] * self.tangents[0].adjoint(mi * z)]
            z -= self.V(t).mul_(live)  # V(t) is a buffer overwritten by the next call
        else:
            t, iters = _pcg(self, mi, z, pre, tol, max_iter)
            if iters:  # none: horizontal already, to rounding
                z -= self.V(t).mul_(live)  # V(t) is a buffer overwritten by the next call
        if not own:
            self.scatter(z, x)
        return iters


def _fold_preconditioner(t: FoldTangent, m: torch.Tensor, live: torch.Tensor, n: int,
                         dtype: torch.dtype) -> tuple[str, torch.Tensor]:
    r"""$(V_f^\top M V_f)^{+}$ on the directions of finite length ($(V_f t)_F = 0$), on the
    component's vector of length `n`."""
    if t._lines and all(e.index is None for e in t.slots.values()):
        g, dead = t.gram_diagonal(m, live)  # a broadcast: sums of m along its axes
        ok = (g > 0) & ~dead
        return "diag", torch.where(ok, 1.0 / torch.where(ok, g, 1.0), 0.0)
    if t.disjoint:
        v1 = torch.zeros(n, dtype=dtype, device=m.device)
        t.apply(torch.ones(t.k, dtype=dtype, device=m.device), v1)
        g = t.adjoint(m * v1)  # diag(V_fᵀ M V_f): its columns have disjoint supports
        ok = g > 0
        if bool((~live).any()):
            ok = ok & (t.adjoint((~live).to(dtype) * v1 * v1) == 0)
        return "diag", torch.where(ok, 1.0 / torch.where(ok, g, 1.0), 0.0)
    C = t.C if t.C is not None else t._columns()
    return "dense", _restricted_pinv((C * t.own(m)) @ C.T, C[:, ~t.own(live)])


def _restricted_pinv(G: torch.Tensor, CF: torch.Tensor) -> torch.Tensor:
    r"""$N (N^\top G N)^{+} N^\top$ with $N$ a basis of $\{t : C_F^\top t = 0\}$ (the
    directions that move no entry of infinite weight); $G^{+}$ when $C_F = 0$."""
    if CF.numel() == 0 or not bool(CF.ne(0).any()):
        return _pinv(G)
    U, S, _ = torch.linalg.svd(CF, full_matrices=True)
    rank = int((S > S.max() * _rcond(CF.dtype)).sum())
    N = U[:, rank:]
    return N @ _pinv(N.T @ G @ N) @ N.T


def _pcg(comp: _Component, m: torch.Tensor, x: torch.Tensor, pre: list, tol: float,
         max_iter: int) -> tuple[list[torch.Tensor], int]:
    r"""$t$ with $V^\top M V t = V^\top M x$ by conjugate gradients, preconditioned by each
    fold's own $(V_f^\top M V_f)^{+}$."""

    def precondition(r):
        return [p * ri if kind == "diag" else p @ ri for (kind, p), ri in zip(pre, r, strict=True)]

    def dot(a, b):
        return sum(float(ai @ bi) for ai, bi in zip(a, b, strict=True))

    mx = m * x
    b = comp.Vt(mx)
    mxx = float(mx @ x)
    del mx  # a vector of the component's size: not kept through the iterations
    z = precondition(b)
    rz0 = rz = dot(b, z)
    t = [torch.zeros_like(bi) for bi in b]
    if rz0 <= (1e3 * torch.finfo(x.dtype).eps) ** 2 * mxx:
        return t, 0  # horizontal already, to rounding
    r, d, it = b, z, 0
    while it < max_iter:
        it += 1
        Ad = comp.Vt(comp.V(d).mul_(m))  # V's buffer is overwritten by its next call
        dAd = dot(d, Ad)
        if dAd <= 0:
            break
        alpha = rz / dAd
        t = [ti + alpha * di for ti, di in zip(t, d, strict=True)]
        r = [ri - alpha * ai for ri, ai in zip(r, Ad, strict=True)]
        z = precondition(r)
        rz_new = dot(r, z)
        if rz_new <= tol**2 * rz0:
            break
        d = [zi + (rz_new / rz) * di for zi, di in zip(z, d, strict=True)]
        rz = rz_new
    return t, it


class TranslationConstraint:
    r"""$\Pi_V$ on the flat adaptive vector (see the module docstring): a
    [`LinearConstraint`][quotient_manifolds.manifolds.constrained.LinearConstraint].

    The folds are grouped into components that share adaptive entries; each component is
    projected on its own (`_Component`: closed form for one fold with disjoint columns, an
    explicit Gram matrix while `K × entries <= dense_limit`, conjugate gradients beyond).

    Parameters
    ----------
    folds : sequence of Fold
        The translation folds (`translation_folds`).
    base : dict
        Every parameter at the canonical point.
    entries : sequence of AdaptiveEntry
        Where each parameter's free entries sit in the flat vector.
    size : int
        The length of the flat adaptive vector.
    dtype : torch.dtype
        The working dtype.
    """

    dense_limit = 2e7
    """The largest (coordinates × entries) of a component whose Gram matrix is formed."""
    max_iter = 500
    """The most conjugate-gradient iterations of one projection of a `"cg"` component."""

    def __init__(self, folds: Sequence[Fold], base: Params, entries: Sequence[Any], size: int,
                 dtype: torch.dtype, dense_limit: float | None = None) -> None:
        params = {n: t.to(dtype) if t.is_floating_point() else t for n, t in base.items()}
        slots = {e.name: e for e in entries}
        self.size, self.dtype = size, dtype
        self.tol = 1e-14 if dtype == torch.float64 else 1e-6
        limit = self.dense_limit if dense_limit is None else dense_limit
        self.tangents = [t for t in (FoldTangent(f, params, slots, dtype, limit) for f in folds)
                         if t.names]
        self.components = [_Component(group, dtype, limit)
                           for group in _connected(self.tangents)]
        self.iterations = 0  # the most of any component in the last projection

    @property
    def folds(self) -> list[Fold]:
        """The folds with a component on the adaptive vector."""
        return [t.fold for t in self.tangents]

    def active(self, gradient: bool = False) -> list[_Component]:
        """The components a projection applies (with `gradient`: those whose $V$ depends on
        the point)."""
        return [c for c in self.components if not (gradient and c.fixed)]

    #: reads `m` only by slices of its components (`m` may be a
    #: [`SlicedInvC2`][quotient_manifolds.manifolds.constrained.SlicedInvC2])
    reads_slices = True

    def project(self, u: torch.Tensor, m: torch.Tensor | SlicedInvC2, gradient: bool = False,
                inplace: bool = False) -> torch.Tensor:
        r"""$\Pi_V u$, orthogonal in $\sum u v\, m$ (one projection per leading index); with
        `inplace`, into `u` itself when it is contiguous.

        `gradient=True` says that `u` is $c^2 \odot \nabla L$ for a loss that is invariant
        along every orbit, taken at a point $w + \xi$ reached by the first-order retraction.
        Then the components whose $V$ is the same at every point (centrings, table shifts, the
        reader centrings of norms whose gain and shift are not perturbed) are skipped:
        $L(w + V t) = L(w)$ for all $w$ and $t$ gives $V^\top \nabla L = 0$, so
        $V^\top M u = V^\top \nabla L = 0$ and $\Pi_V u = u$ there, in exact arithmetic."""
        components = self.active(gradient)
        if not components:
            return u
        x = u if inplace and u.is_contiguous() else u.clone(
            memory_format=torch.contiguous_format)
        rows = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.unsqueeze(0)
        self.iterations = 0
        for row in rows:
            for c in components:
                self.iterations = max(self.iterations,
                                      c.project(row, m, self.tol, self.max_iter))
        return x


class _Shifted:
    """A vector of a row layout read and written at the positions of the full adaptive vector,
    for spans inside entries the layout keeps whole (`shifts`: `(full start, full stop, offset
    of the layout's position)` of each run of whole entries)."""

    def __init__(self, x: Any, shifts: Sequence[tuple[int, int, int]]) -> None:
        self.x, self.shifts = x, shifts
        self.dtype = x.dtype

    def _key(self, key: slice) -> slice:
        for a, b, d in self.shifts:
            if a <= key.start and key.stop <= b:
                return slice(key.start + d, key.stop + d)
        raise RuntimeError(f"entries [{key.start}, {key.stop}) are not kept whole by the row "
                           "layout (RowsConstraint needs every component it applies there)")

    def __getitem__(self, key: slice) -> torch.Tensor:
        return self.x[self._key(key)]

    def __setitem__(self, key: slice, value: torch.Tensor) -> None:
        self.x[self._key(key)] = value


class RowsConstraint:
    r"""A [`TranslationConstraint`][quotient_manifolds.models.translations.TranslationConstraint]
    on the adaptive part of a vector of a
    [`RowLayout`][quotient_manifolds.models.row_layout.RowLayout].

    Only the components that apply to gradients (`active(gradient=True)`: those whose $V$
    depends on the point) are applied, and they must lie in entries the layout keeps whole
    (`local`); the others are skipped for a gradient of an invariant loss, as on the full
    vector, and a projection of any other vector raises. That is all the ascent on active rows
    asks of it: the iterates are those of the full packing, and a zero row stays zero."""

    reads_slices = True

    def __init__(self, constraint: TranslationConstraint, shifts: Sequence[tuple[int, int, int]]
                 ) -> None:
        self.constraint, self.shifts = constraint, list(shifts)
        self._m: list[tuple[Any, _Shifted]] = []  # one wrapper per m: the components cache on it

    @staticmethod
    def local(constraint: TranslationConstraint | None) -> list[tuple[int, int]]:
        """The full-vector spans of the components applied to gradients."""
        if constraint is None:
            return []
        return [span for c in constraint.active(gradient=True) for span in c.spans]

    def _wrapped(self, m: Any) -> _Shifted:
        for mm, w in self._m:
            if mm is m:
                return w
        w = _Shifted(m, self.shifts)
        self._m = [*self._m[-1:], (m, w)]
        return w

    def project(self, u: torch.Tensor, m: torch.Tensor | SlicedInvC2, gradient: bool = False,
                inplace: bool = False) -> torch.Tensor:
        r"""$\Pi_V u$ of a gradient `u` (1-D) in the layout's adaptive packing."""
        tc = self.constraint
        if not gradient:
            if tc.active():
                raise RuntimeError("a row layout's adaptive space projects gradients only")
            return u
        components = tc.active(gradient=True)
        if not components:
            return u
        if u.dim() != 1:
            raise RuntimeError("a row layout holds a single problem (a 1-D vector)")
        x = u if inplace and u.is_contiguous() else u.clone()
        xs, ms = _Shifted(x, self.shifts), self._wrapped(m)
        tc.iterations = 0
        for c in components:
            tc.iterations = max(tc.iterations, c.project(xs, ms, tc.tol, tc.max_iter))
        return x


def rows_space(manifold: AdaptiveEuclidean, w0: torch.Tensor,
               shifts: Sequence[tuple[int, int, int]],
               constraint: TranslationConstraint | None) -> AdaptiveTangentSpace:
    r"""The adaptive tangent space of a row layout (its kept weights `w0`, its `shifts`):
    horizontal to the translation orbits through `RowsConstraint` where there are any. Its
    gradients are those of an invariant loss at $w + \xi$ (the layouts' promise)."""
    if constraint is None:
        return manifold.at(w0)
    return ConstrainedAdaptiveTangentSpace(manifold, w0, RowsConstraint(constraint, shifts),
                                           invariant_gradients=True)


def _connected(tangents: Sequence[FoldTangent]) -> list[list[FoldTangent]]:
    """The tangents grouped by shared parameters (connected components)."""
    parent = list(range(len(tangents)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, t in enumerate(tangents):
        for n in t.names:
            if n in owner:
                parent[find(i)] = find(owner[n])
            else:
                owner[n] = i
    groups: dict[int, list[FoldTangent]] = {}
    for i, t in enumerate(tangents):
        groups.setdefault(find(i), []).append(t)
    return list(groups.values())


def _rcond(dtype: torch.dtype) -> float:
    """Relative size below which an eigenvalue counts as zero (rounding of the Gram matrix)."""
    return 1e3 * torch.finfo(dtype).eps


def _pinv(G: torch.Tensor) -> torch.Tensor:
    if G.numel() == 0:
        return G
    lam, U = torch.linalg.eigh(G)
    keep = lam > lam.abs().max() * _rcond(G.dtype)
    inv = torch.where(keep, 1.0 / torch.where(keep, lam, 1.0), 0.0)
    return (U * inv) @ U.T


def horizontal_translations(folds: Sequence[Fold], base: Params,
                            frozen: Mapping[str, torch.Tensor]
                            ) -> tuple[list[Fold], dict[str, torch.Tensor]]:
    """`(translation folds, frozen masks)`: the folds whose orbits the perturbations are made
    horizontal to, and the frozen masks without the slices those folds no longer need (a
    post-norm shift's $\\beta$, an embedding shift's first row: free now, and horizontal).

    The seam of [`ModelGeometry`][quotient_manifolds.models.model_geometry.ModelGeometry]:
    replace it by `lambda folds, base, frozen: ([], dict(frozen))` to measure with the folds'
    slices only (the base point alone canonical).
    """
    found = translation_folds(folds)
    if not found:
        return [], dict(frozen)
    return found, _unfreeze(frozen, folds, found, base)


def adaptive_space(geometry: Any, w0: torch.Tensor, folds: Sequence[Fold], base: Params,
                   entries: Sequence[Any], dtype: torch.dtype,
                   wrap: Callable[[TranslationConstraint], LinearConstraint] | None = None,
                   size: int | None = None
                   ) -> tuple[AdaptiveEuclidean, AdaptiveTangentSpace,
                              TranslationConstraint | None]:
    """`(manifold, space, constraint)` of the adaptive entries at `w0` (`geometry`: its
    `adaptive_eps` and `adaptive_retraction`): the space horizontal to the orbits of the
    translation `folds`, or the plain adaptive space (`constraint` `None`) when no fold moves
    an adaptive entry.

    `size` is the length of the whole flat adaptive vector that `entries` index (default
    `w0.numel()`); a `w0` that is a slice of it (a model-parallel rank's) needs `wrap`, the
    constraint the space applies to its slices (`wrap(constraint)`)."""
    manifold = AdaptiveEuclidean(geometry.adaptive_eps, geometry.adaptive_retraction, ndim=1,
                                 validate=False)
    n = w0.numel() if size is None else size
    tc = TranslationConstraint(folds, base, entries, n, dtype) if folds else None
    if tc is None or not tc.components:
        return manifold, manifold.at(w0), None
    space_tc = tc if wrap is None else wrap(tc)
    invariant = geometry.adaptive_retraction == "first_order"  # ξ ↦ w + ξ: ∇_ξ L = ∇_w L
    return manifold, ConstrainedAdaptiveTangentSpace(manifold, w0, space_tc, invariant), tc
