r"""Residual-stream rotations: an orthogonal change of basis of the stream that every reader
undoes.

In a pre-norm model whose norms' gains are folded into their readers, the residual stream is
written by the embeddings and the sublayers' output projections and read only through norms
followed by linear maps. An RMSNorm is equivariant under every rotation,
$\mathrm{RMS}(Qx) = Q\,\mathrm{RMS}(x)$, so

$$
E \mapsto E Q^\top,\qquad W_{\mathrm{out}} \mapsto Q W_{\mathrm{out}},\quad
b_{\mathrm{out}} \mapsto Q b_{\mathrm{out}},\qquad W_{\mathrm{in}} \mapsto W_{\mathrm{in}} Q^\top
$$

for every $Q \in O(d)$ computes the same function; a LayerNorm (with the writers and readers
centred) is equivariant under the rotations that fix $\mathbb 1$, $O(d-1)$ on $\mathbb 1^\perp$.

The measure is made invariant by a **canonical representative**: the stream is expressed in the
principal axes of $S = \sum_k V_k^\top V_k / \sum_k \|V_k\|_F^2$, with $V_k$ every stream parameter
outside the GL blocks seen from the stream side ($E$, $W_{\mathrm{in}}$, $W_{\mathrm{out}}^\top$,
$b^\top$), which transforms as $S \mapsto Q S Q^\top$ and is moved by no other symmetry once the
folds before it are applied (a block's factors are moved by its GL element, which would change
$S$). With $S = U \Lambda U^\top$ (eigenvalues ascending) and
each axis' sign fixed by the sign of the third moment $\sum_k \sum_r (V_k u_j)_r^3$, the
canonical parameters $V_k U$ are the same for every point of the orbit. The parts share one
scale, not one each: a part that is zero at the canonical point (a bias folded away) is zero
only up to rounding, and scaled to unit norm it would decide the axes. The
other choice, a rotation-invariant metric for the weights outside the blocks, would change
adaptive sharpness' metric of those weights; the canonical basis keeps it, and costs one
$d \times d$ eigendecomposition per call. Its price is conditioning: where two eigenvalues (or a
third moment) nearly coincide, the basis is ill-determined, and `conditioning` records the
smallest relative gap (a warning is given below $10^{-6}$).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import ProbeWarning
from ..linear import ReadQuery, readers_of, storage
from ..norms import any_norm, is_norm, norm_bias, norm_offset, norm_weight
from ..paths import feeds_only, pooled_readers, reaches_only
from ..records import Symmetries
from ..stream import known_module, writer_params, writes_stream
from ..symmetry import Fold, Scene, SymmetryFamily
from .centring import CentringFold, ReaderCentringFold, centres
from .free_norm import free_norm, width
from .norm_gain import NormGainFold
from .shift_reader import ShiftReaderFold

__all__ = ["ResidualRotations", "RotationFold", "StreamPart"]

Params = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class StreamPart:
    """One parameter seen from the residual stream: `param` (a slice `start:stop` of its rows,
    for a reader), its stream axis `axis`, and whether it writes the stream (`writer`) or reads
    it."""

    param: str
    axis: int
    writer: bool
    start: int = 0
    stop: int = -1

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as `(rows, d)`: the stream axis last (a table, a class token, positions) or
        first (a linear map's or a convolution's output axis, the rest flattened)."""
        if t.dim() == 1:
            return t.reshape(1, -1)
        if self.axis == t.dim() - 1:
            return t.reshape(-1, t.shape[-1])
        if self.axis == 0:
            return t.reshape(t.shape[0], -1).T
        raise ValueError(f"stream axis {self.axis} of a {t.dim()}-d parameter {self.param!r}: "
                         "only the first or the last axis can be the stream's")

    def view(self, params: Params) -> torch.Tensor:
        """The `(rows, d)` stream-side view."""
        v = self._rows(params[self.param])
        return v[self.start:v.shape[0] if self.stop < 0 else self.stop]

    def write(self, params: dict, view: torch.Tensor) -> None:
        t = params[self.param]
        v = self._rows(t)
        stop = v.shape[0] if self.stop < 0 else self.stop
        new = v.slice_scatter(view.to(t.dtype), 0, self.start, stop)
        if t.dim() > 1 and self.axis == 0:
            new = new.T
        params[self.param] = new.reshape(t.shape)


def _ones_first_basis(d: int) -> torch.Tensor:
    r"""A fixed orthonormal basis of $\mathbb R^d$ whose first column is $\mathbb 1/\sqrt d$."""
    one = torch.full((d, 1), 1 / math.sqrt(d), dtype=torch.float64)
    B = torch.linalg.qr(torch.cat([one, torch.eye(d, dtype=torch.float64)], 1))[0][:, :d]
    B[:, 0] = one[:, 0]
    return B


def _haar(d: int, generator: torch.Generator | None) -> torch.Tensor:
    Z = torch.randn(d, d, generator=generator, dtype=torch.float64)
    Q, R = torch.linalg.qr(Z)
    return Q * torch.sign(torch.diagonal(R))


@dataclass(frozen=True)
class RotationFold(Fold):
    r"""$V_k \mapsto V_k Q^\top$ on every stream part (see the module docstring); canonical
    representative: the principal axes of the stream, signs by the third moment. `gauge` are
    the folds that bring the norms' gains to one (and, with `centred`, the writers and readers
    to $\mathbb 1^\perp$) first; `basis_parts` (default: all parts) are the parts the axes are
    computed from: those no other symmetry moves once the folds before it have been applied
    (a GL block's factors are moved by its group, so they are left out)."""

    parts: tuple[StreamPart, ...] = ()
    gauge: tuple[Fold, ...] = ()
    centred: bool = False
    d: int = 0
    basis_parts: tuple[StreamPart, ...] = ()

    kind = "rotation"
    order = 5.0

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([p.param for p in self.parts]
                                   + [n for f in self.gauge for n in f.params]))

    def _rotate(self, params: Params, Q: torch.Tensor) -> dict[str, torch.Tensor]:
        out = dict(params)
        for p in self.parts:
            v = p.view(out)
            p.write(out, v @ Q.to(v).T)
        return out

    def _gauged(self, params: Params) -> dict[str, torch.Tensor]:
        return Symmetries((), folds=self.gauge).canonicalize(params)[0]

    def basis(self, params: Params) -> tuple[torch.Tensor, float]:
        """`(U, conditioning)`: the canonical axes (columns) of the stream at `params` (gauged)
        and the smallest relative eigenvalue or third-moment gap."""
        d = self.d
        views = [p.view(params).to(torch.float64) for p in self.basis_parts or self.parts]
        dev = views[0].device if views else None
        S = torch.zeros(d, d, dtype=torch.float64, device=dev)
        for v in views:
            S += v.T @ v
        total = float(torch.diagonal(S).sum()) or 1.0  # sum of squares of every part
        S /= total
        if self.centred:
            one = torch.full((d, 1), 1 / math.sqrt(d), dtype=torch.float64, device=dev)
            P = torch.eye(d, dtype=torch.float64, device=dev) - one @ one.T
            lam, U = torch.linalg.eigh(P @ S @ P)
            keep = (U.T @ one).abs().squeeze(1) < 0.5  # drop the 1 direction
            lam, U = lam[keep][-(d - 1):], U[:, keep][:, -(d - 1):]
        else:
            lam, U = torch.linalg.eigh(S)
        third = torch.zeros(U.shape[1], dtype=torch.float64, device=dev)
        for v in views:  # one scale for all parts: a part that is zero up to rounding adds 0
            third += ((v @ U) / math.sqrt(total)).pow(3).sum(0)
        U = U * torch.where(third < 0, -1.0, 1.0)
        scale = float(lam.abs().max()) or 1.0
        gaps = (lam[1:] - lam[:-1]).abs() / scale if lam.numel() > 1 else lam.new_ones(1)
        cond = min(float(gaps.min()), float(third.abs().min() / (third.abs().max() or 1.0)))
        if self.centred:
            U = torch.cat([one, U], dim=1)
        return U, cond

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            params, frozen = Symmetries((), folds=self.gauge).canonicalize(params)
            U, cond = self.basis(params)
            if cond < 1e-6:
                warnings.warn(
                    f"the canonical basis of the residual stream of {self.module or '<root>'} "
                    f"is ill-conditioned (smallest relative eigenvalue or third-moment gap "
                    f"{cond:.1e}): the measure is invariant under rotations only to about that "
                    "precision", ProbeWarning, stacklevel=3)
            # the stream in the axes U; with LayerNorms, U's first axis (1) kept where it is
            Q = _ones_first_basis(self.d).to(U.device) @ U.T if self.centred else U.T
            return self._rotate(params, Q), frozen

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            Q = _haar(self.d, generator)
            if self.centred:  # a rotation of the complement of 1
                B = _ones_first_basis(self.d)
                R = torch.eye(self.d, dtype=torch.float64)
                R[1:, 1:] = _haar(self.d - 1, generator)
                Q = B @ R @ B.T
            return self._rotate(self._gauged(params), Q)

    def lie_dim(self, params: Params) -> int:
        return self.d * self.d

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        X = theta.reshape(self.d, self.d)
        X = X - X.T
        if self.centred:
            one = torch.full((self.d, 1), 1 / math.sqrt(self.d), dtype=torch.float64,
                             device=X.device)
            P = torch.eye(self.d, dtype=torch.float64, device=X.device) - one @ one.T
            X = P @ X @ P
        return self._rotate(params, torch.linalg.matrix_exp(X))

    def describe(self) -> dict:
        return {**super().describe(), "d": self.d, "centred": self.centred,
                "parts": len(self.parts)}


class ResidualRotations(SymmetryFamily):
    """The rotations of the residual stream of a pre-norm model (see the module docstring)."""

    name = "residual rotations"
    kind = "folds"
    symmetries = ("complete",)

    def present(self, scene: Scene) -> bool:
        return any_norm(scene.modules.values()) or any(map(free_norm, scene.modules.values()))

    def find(self, scene: Scene) -> None:
        p = scene.prober
        calls = p.parameterised_calls()
        tables = [m for m in p.modules.values() if isinstance(m, nn.Embedding)]
        first = next((c for c in p.calls if is_norm(p.modules[c.name])
                      or free_norm(p.modules[c.name])), None)
        if tables:  # the stream's width
            d = max(tables, key=lambda t: t.num_embeddings).embedding_dim
        elif first is not None and (wd := width(first.out)) is not None:
            d = wd  # no table (a vision model): the first norm's width
        else:
            return
        norms: dict[str, tuple] = {}
        for c in p.calls:
            m = p.modules[c.name]
            if (c.name in norms or not (is_norm(m) or free_norm(m))
                    or not isinstance(c.out, torch.Tensor) or width(c.out) != d):
                continue
            direct = readers_of(calls, ReadQuery(storage(c.out), d, p.name, p.pname))
            pooled = direct is not None and not direct[0]
            # read directly, or through a pooling that commutes with Q
            found = pooled_readers(p, c.name, d, linear=True) if pooled else direct
            if not found or not found[0] or not reaches_only(p, c.name, found[1],
                                                              through=pooled):
                return  # a norm that is not a pre-norm: the stream is read elsewhere
            norms[c.name] = (m, c, found[0])
        if not norms:
            return
        centred = [centres(m, c.args, c.kwargs) for m, c, _ in norms.values()]
        if any(centred) and not all(centred):
            return
        readers = {(x.weight, x.start, x.stop): x for _, _, cons in norms.values() for x in cons}
        gauge: list[Fold] = []
        parts = [StreamPart(x.weight, x.in_axis, False, x.start, x.stop)
                 for x in readers.values()]
        loose: set[str] = set()  # norms whose shift no reader's bias can take up
        for name, (m, c, cons) in norms.items():
            if free_norm(m):
                continue  # nothing to fold
            offset = norm_offset(m, c.args, c.kwargs)
            if offset is None:
                return
            w, b = p.name(norm_weight(m)), p.pname(norm_bias(m))
            if b is not None and any(x.bias is None for x in cons):
                loose.add(name)  # the shift stays: (1 after the fold below, or rotated)
                gauge.append(NormGainFold(name, w, b, offset, tuple(cons), "scale"))
                if centred[0]:
                    gauge.append(ShiftReaderFold(name, tuple(cons), w, b, offset))
                else:
                    parts.append(StreamPart(b, 0, True))
                continue
            gauge.append(NormGainFold(name, w, b, offset, tuple(cons),
                                      "none" if b is None else "fold"))
        reader_names = {x.weight for x in readers.values()}
        sources = [c.name for c in p.calls if c.name not in norms and writes_stream(
            p.modules[c.name], c.out[0] if isinstance(c.out, tuple) and c.out else c.out, {d})
            and not {n for n, _ in writer_params(p, c.name, p.modules[c.name], d)}
            & reader_names]
        feeds = feeds_only(p, sources, list(norms))
        writers = [(n, writer_params(p, n, p.modules[n], d)) for n in dict.fromkeys(sources)
                   if feeds[n]]
        # tables of width d owned by a module that returns something else (timm's class token
        # and positions on the model itself): stream writers too, if the probe agrees
        writers += [(n, [(q, a) for q, a in own if p.params[q].dim() >= 2])
                    for n, m in p.modules.items() if n not in sources and not known_module(m)
                    and (own := writer_params(p, n, m, d))]
        for name, params in writers:
            for param, axis in params:
                parts.append(StreamPart(param, axis, True))
                if centred[0]:
                    gauge.append(CentringFold(name, param, axis))
        if centred[0]:
            gauge += [ReaderCentringFold(name, x, "" if free_norm(m) else p.name(norm_weight(m)),
                                         None, 0.0)
                      for name, (m, _, cons) in norms.items() for x in cons
                      if name not in loose]
        gauge.sort(key=lambda f: f.order)
        in_blocks = {n for b in scene.blocks for n in b.params}
        basis = tuple(x for x in parts if x.param not in in_blocks)
        if not basis:
            return  # every stream part moves with a block: no invariant to fix the axes
        scene.propose([RotationFold("", tuple(parts), tuple(gauge), bool(centred[0]), d, basis)])
