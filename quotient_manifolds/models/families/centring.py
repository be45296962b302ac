r"""LayerNorm centring: the translations that a LayerNorm's centring makes invisible.

A LayerNorm subtracts the mean of its input, $\mathrm{LN}(x + c\mathbb 1) = \mathrm{LN}(x)$, and
its normalised output is centred, $\mathbb 1^\top \hat x = 0$. Two families of translations
follow (the paper's §3.2 "translation" symmetry, applied to LayerNorm):

* **writers** ([`CentringFold`][quotient_manifolds.models.families.centring.CentringFold]): a
  linear map, bias or embedding table whose output reaches the model's outputs only through the
  inputs of LayerNorms can be translated along $\mathbb 1$: $W \mapsto W + \mathbb 1 u^\top$,
  $b \mapsto b + c\,\mathbb 1$, $E \mapsto E + c\,\mathbb 1^\top$ (one constant per embedding
  row). In a pre-norm model these are the sublayer outputs and the embeddings, which write into
  the residual stream; in a post-norm model the sublayer outputs and the embedding sum, which
  write into the norm that follows;
* **readers**
  ([`ReaderCentringFold`][quotient_manifolds.models.families.centring.ReaderCentringFold]): a
  linear map $z = W y + b$ that reads $y = \gamma \odot \hat x + \beta$ can be translated
  along $v = \mathbb 1 \oslash \gamma$: $W \mapsto W + u v^\top$,
  $b \mapsto b - u\,(v^\top \beta)$, since $v^\top y = \mathbb 1^\top \hat x + v^\top\beta$.
  After the gain fold ($\gamma = \mathbb 1$, $\beta = 0$) this is $W + u \mathbb 1^\top$.

Canonical representative: the Euclidean projection onto the complement of the orbit, i.e.
the translation removed (centring along $\mathbb 1$, or along $v$). The removed directions are
frozen: perturbations keep the canonical constraint (their sums along the translation axis, or
their products with $v$, are zero), so no part of the radius is spent along these orbits.

[`LayerNormCentring`][quotient_manifolds.models.families.centring.LayerNormCentring] finds the
writers by cutting the graph at the LayerNorms' inputs
([`feeds_only`][quotient_manifolds.models.paths.feeds_only]) and the readers with the linear
readers of [`linear`][quotient_manifolds.models.linear]; the probe confirms every one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..linear import Consumer, ReadQuery, readers_of, storage
from ..norms import any_norm, is_norm, norm_bias, norm_offset, norm_weight
from ..paths import feeds_only, pooled_readers
from ..precision import run_module
from ..prober import Prober
from ..stream import writer_params, writes_stream
from ..symmetry import Centring, Fold, Scene, SymmetryFamily, random_normal, rms
from .free_norm import free_norm, width
from .shift_reader import ShiftReaderFold

__all__ = ["CentringFold", "LayerNormCentring", "ReaderCentringFold", "centres"]

Params = Mapping[str, torch.Tensor]


def _line_shape(t: torch.Tensor, axis: int) -> list[int]:
    shape = list(t.shape)
    shape[axis] = 1
    return shape


@dataclass(frozen=True)
class CentringFold(Fold):
    r"""$w \mapsto w + c$ with $c$ constant along `axis` (one value per line along it);
    canonical representative: the mean along `axis` removed."""

    param: str = ""
    axis: int = 0

    kind = "centring"
    order = 2.5

    @property
    def params(self) -> tuple[str, ...]:
        return (self.param,)

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            w = params[self.param]
            return {**params, self.param: w - w.mean(dim=self.axis, keepdim=True)}, {}

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        w = params[self.param]
        c = a * rms(w) * random_normal(_line_shape(w, self.axis), generator, w.dtype, w.device)
        return {**params, self.param: w + c}

    def lie_dim(self, params: Params) -> int:
        w = params[self.param]
        return w.numel() // w.shape[self.axis]

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        w = params[self.param]
        return {**params, self.param: w + theta.to(w.dtype).view(_line_shape(w, self.axis))}

    def constraints(self, params: Params) -> tuple[Centring, ...]:
        return (Centring(self.param, self.axis),)

    def describe(self) -> dict:
        return {**super().describe(), "axis": self.axis}


@dataclass(frozen=True)
class ReaderCentringFold(Fold):
    r"""$W \mapsto W + u v^\top$, $b \mapsto b - u\,(v^\top\beta)$ on a reader of a LayerNorm's
    output, $v = \mathbb 1 \oslash (o + w)$ the inverse gain; canonical representative: the
    $v$-component of every row removed (with the bias compensated)."""

    consumer: Consumer = Consumer("")
    gain: str = ""
    shift: str | None = None
    offset: float = 0.0

    kind = "reader_centring"
    order = 0.5

    @property
    def params(self) -> tuple[str, ...]:
        names = [self.consumer.weight, self.consumer.bias]
        return tuple(dict.fromkeys(n for n in names if n is not None))

    def _v(self, params: Params) -> torch.Tensor:
        if not self.gain:  # a parameter-free norm
            M = self.consumer.read(params)[0]
            return torch.ones(M.shape[1], dtype=M.dtype, device=M.device)
        return 1.0 / (params[self.gain] + self.offset).reshape(-1)

    def _move(self, params: Params, u: torch.Tensor) -> dict[str, torch.Tensor]:
        out = dict(params)
        M, b = self.consumer.read(out)
        v = self._v(params).to(M.dtype)
        M2 = M + u[:, None] * v[None, :]
        if b is not None and self.shift is not None:
            b = b - u * (v @ params[self.shift].reshape(-1).to(M.dtype))
        self.consumer.write(out, M2, b)
        return out

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            M, _ = self.consumer.read(params)
            v = self._v(params).to(M.dtype)
            return self._move(params, -(M @ v) / (v @ v)), {}

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        M, _ = self.consumer.read(params)
        scale = rms(M) / rms(self._v(params))  # u vᵀ of the size of M
        return self._move(params, a * scale * random_normal((M.shape[0],), generator, M.dtype,
                                                            M.device))

    def lie_dim(self, params: Params) -> int:
        return int(self.consumer.read(params)[0].shape[0])

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._move(params, theta)

    def constraints(self, params: Params) -> tuple[Centring, ...]:
        c = self.consumer
        return (Centring(c.weight, c.in_axis, c.start, c.stop, self._v(params)),)

    def describe(self) -> dict:
        c = self.consumer
        return {**super().describe(), "gain": self.gain,
                "consumer": c.weight + ("" if c.stop < 0 else f"[{c.start}:{c.stop}]")}


def centres(m: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the norm `m` (called with `args`, `kwargs`) is blind to a constant added to its
    input (a LayerNorm, not an RMSNorm)."""
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    x = args[0]
    y0 = run_module(m, {}, (x, *args[1:]), kwargs)
    y1 = run_module(m, {}, (x + 3.0, *args[1:]), kwargs)
    if not (isinstance(y0, torch.Tensor) and isinstance(y1, torch.Tensor)):
        return False
    return bool((y0 - y1).abs().max() <= 1e-10 * max(float(y0.abs().max()), 1e-300))


class LayerNormCentring(SymmetryFamily):
    """Writers into LayerNorms and readers of LayerNorm outputs (see the module docstring)."""

    name = "LayerNorm centring"
    kind = "folds"
    symmetries = ("complete",)

    def present(self, scene: Scene) -> bool:
        return any_norm(scene.modules.values()) or any(map(free_norm, scene.modules.values()))

    def find(self, scene: Scene) -> None:
        p = scene.prober
        norms = {}
        for c in p.calls:
            m = p.modules[c.name]
            if c.name not in norms and (is_norm(m) or free_norm(m)) and centres(m, c.args,
                                                                              c.kwargs):
                norms[c.name] = c
        if not norms:
            return
        widths = {w for c in norms.values() if (w := width(c.out)) is not None}
        self._writers(scene, p, list(norms), widths)
        self._readers(scene, p, norms)

    @staticmethod
    def _writers(scene: Scene, p: Prober, norms: list[str], widths: set[int]) -> None:
        sources: dict[str, int] = {}
        for c in p.calls:
            m = p.modules[c.name]
            out = c.out[0] if isinstance(c.out, tuple) and c.out else c.out
            if c.name in sources:
                continue
            if writes_stream(m, out, widths):
                assert isinstance(out, torch.Tensor)
                conv = isinstance(m, nn.modules.conv._ConvNd)
                sources[c.name] = int(out.shape[1] if conv else out.shape[-1])
        if not sources:
            return
        feeds = feeds_only(p, sources, norms)
        for name in sources:
            if feeds[name]:
                for param, axis in writer_params(p, name, p.modules[name], sources[name]):
                    scene.propose([CentringFold(name, param, axis)])

    @staticmethod
    def _readers(scene: Scene, p: Prober, norms: dict) -> None:
        calls = p.parameterised_calls()
        for name, call in norms.items():
            m = p.modules[name]
            free = free_norm(m)  # no gain, no shift: v = 1
            offset = 0.0 if free else norm_offset(m, call.args, call.kwargs) if isinstance(
                call.out, torch.Tensor) else None
            d = width(call.out)
            if offset is None or d is None:
                continue
            found = readers_of(calls, ReadQuery(storage(call.out), d, p.name, p.pname))
            if not found:
                continue
            consumers = found[0] or pooled_readers(p, name, d)[0]
            gain = "" if free else p.name(norm_weight(m))
            shift = None if free else p.pname(norm_bias(m))
            for cons in consumers:
                if shift is not None and cons.bias is None:
                    continue  # no bias to take up the shift's part: the shift takes it up
                scene.propose([ReaderCentringFold(name, cons, gain, shift, offset)])
            if shift is not None and any(c.bias is None for c in consumers):
                scene.propose([ShiftReaderFold(name, tuple(consumers), gain, shift, offset)])
