r"""Block specifications: which parameter slices form the factors ``G`` and ``H``.

A GL(h) block (spec §3.3) is a pair ``G ∈ R^{n×h}``, ``H ∈ R^{m×h}`` that the
network uses only through ``G Hᵀ``.  In a PyTorch model the factors are slices
of ``nn.Linear`` weights (stored ``(out, in)``), possibly with a bias row
appended (spec §3.4c, §4).  A :class:`BlockSpec` describes one module's blocks
for all its heads at once: every factor is a row-wise concatenation of
:class:`FactorPart` s, and each part is read for all ``heads`` heads in one
reshape, so gathering is a handful of differentiable view/cat operations.

Layouts of a part (``t`` is the parameter tensor, ``r_i = [off + i h, off + (i+1) h)``):

``"rows"``  ``t[r_i, :]ᵀ`` — an ``(out, in)`` weight whose *output* features
            belong to head ``i`` (query/key/value, LoRA ``A``); gives ``in`` rows.
``"cols"``  ``t[:, r_i]`` — an ``(out, in)`` weight whose *input* features belong
            to head ``i`` (attention output projection, LoRA ``B``); gives ``out`` rows.
``"bias"``  ``t.flatten()[r_i]`` as one row (the appended bias row).
``"elem"``  ``t.flatten()[off + i]`` as a ``1×1`` factor (``h = 1``; diagonal nets).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..errors import BlockSpecError

__all__ = [
    "KINDS",
    "LAYOUTS",
    "FactorPart",
    "BlockSpec",
    "declare_block",
    "gather_factor",
    "gather_block",
    "scatter_block",
    "claimed_mask",
]

KINDS = ("attention.qk", "attention.vo", "lora", "diagonal", "custom")
LAYOUTS = ("rows", "cols", "bias", "elem")
Layout = Literal["rows", "cols", "bias", "elem"]


@dataclass(frozen=True)
class FactorPart:
    """A slice of one parameter that contributes rows to a factor, for every head.

    Parameters
    ----------
    param : str
        Full parameter name, as in ``model.named_parameters()``.
    layout : {"rows", "cols", "bias", "elem"}
        How the slice maps to factor rows (see the module docstring).
    offset : int
        First index of head 0 along the sliced dimension (e.g. ``d`` for the
        key rows of a fused ``in_proj_weight``).
    """

    param: str
    layout: Layout = "cols"
    offset: int = 0

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise BlockSpecError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.offset < 0:
            raise BlockSpecError(f"offset must be non-negative, got {self.offset}")

    def rows(self, t: torch.Tensor) -> int:
        """Number of factor rows this part contributes, given its parameter ``t``."""
        if self.layout == "rows":
            return t.shape[1]
        if self.layout == "cols":
            return t.shape[0]
        return 1

    def read(self, t: torch.Tensor, heads: int, h: int) -> torch.Tensor:
        """The part for all heads, shape ``(heads, rows, h)`` (a differentiable view)."""
        if self.layout == "rows":
            s = t.narrow(0, self.offset, heads * h)
            return s.reshape(heads, h, t.shape[1]).transpose(-1, -2)
        if self.layout == "cols":
            s = t.narrow(1, self.offset, heads * h)
            return s.reshape(t.shape[0], heads, h).permute(1, 0, 2)
        if self.layout == "bias":
            return t.reshape(-1).narrow(0, self.offset, heads * h).reshape(heads, 1, h)
        return t.reshape(-1).narrow(0, self.offset, heads).reshape(heads, 1, 1)

    def write(self, t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Out-of-place copy of ``t`` with this part replaced by ``value`` ``(heads, rows, h)``.

        Differentiable in ``value`` (``slice_scatter``); ``t`` is never modified.
        """
        heads, _, h = value.shape
        value = value.to(t.dtype)
        if self.layout == "rows":
            v = value.transpose(-1, -2).reshape(heads * h, t.shape[1])
            if self.offset == 0 and heads * h == t.shape[0]:  # the whole tensor: no copy of t
                return v
            return t.slice_scatter(v, 0, self.offset, self.offset + heads * h)
        if self.layout == "cols":
            v = value.permute(1, 0, 2).reshape(t.shape[0], heads * h)
            if self.offset == 0 and heads * h == t.shape[1]:
                return v
            return t.slice_scatter(v, 1, self.offset, self.offset + heads * h)
        k = heads * h if self.layout == "bias" else heads
        flat = t.reshape(-1).slice_scatter(value.reshape(k), 0, self.offset, self.offset + k)
        return flat.view(t.shape)

    def mark(self, mask: torch.Tensor, heads: int, h: int) -> None:
        """Set the entries of ``mask`` (shaped like the parameter) covered by this part."""
        if self.layout == "rows":
            mask.narrow(0, self.offset, heads * h).fill_(True)
        elif self.layout == "cols":
            mask.narrow(1, self.offset, heads * h).fill_(True)
        else:
            k = heads * h if self.layout == "bias" else heads
            mask.view(-1).narrow(0, self.offset, k).fill_(True)


@dataclass(frozen=True)
class BlockSpec:
    r"""The GL(h) blocks of one module, all heads together.

    The factors of head ``i`` are ``G_i = [part.read(...)[i] for part in G]``
    stacked row-wise (``n`` rows), and likewise ``H_i`` (``m`` rows); the
    network depends on them only through ``G_i H_iᵀ``.

    Attributes
    ----------
    kind : str
        ``"attention.qk"``, ``"attention.vo"``, ``"lora"``, ``"diagonal"`` or ``"custom"``.
    module : str
        Module path (``""`` for the root or a declared block).
    heads : int
        Number of independent blocks (heads) in this spec.
    h : int
        Block (head) dimension: the group is GL(h).
    G, H : tuple of FactorPart
        The parts of each factor, top to bottom (e.g. weight rows then the bias row).
    n, m : int
        Rows of ``G`` and ``H`` (filled in by :func:`discover_blocks` / :func:`declare_block`).
    """

    kind: str
    module: str
    heads: int
    h: int
    G: tuple[FactorPart, ...]
    H: tuple[FactorPart, ...]
    n: int = 0
    m: int = 0
    note: str = field(default="", compare=False)

    @property
    def params(self) -> tuple[str, ...]:
        """Names of every parameter this block reads (with repetitions removed)."""
        return tuple(dict.fromkeys(p.param for p in self.G + self.H))

    def resolved(self, params: Mapping[str, torch.Tensor]) -> BlockSpec:
        """Validate against ``params`` and fill in ``n``, ``m`` (and ``h`` if it is 0)."""
        spec = self
        if self.h == 0:
            first = self.G[0]
            if first.param not in params:
                raise BlockSpecError(
                    f"a declared block names {first.param!r}, which the model does not have; "
                    "use a name from model.named_parameters()"
                )
            t = params[first.param]
            size = {"rows": t.shape[0], "cols": t.shape[-1]}.get(first.layout, t.numel())
            spec = BlockSpec(self.kind, self.module, self.heads, size // self.heads, self.G,
                             self.H, note=self.note)
        return spec._resolved(params)

    def _resolved(self, params: Mapping[str, torch.Tensor]) -> BlockSpec:
        if self.h < 1:
            raise BlockSpecError(f"block {self.kind!r} at {self.module!r} has h = {self.h}")
        for part in self.G + self.H:
            if part.param not in params:
                raise BlockSpecError(
                    f"block {self.kind!r} at {self.module!r} names parameter {part.param!r}, "
                    "which the model does not have; use a name from model.named_parameters()"
                )
            t = params[part.param]
            need = self.heads if part.layout == "elem" else self.heads * self.h
            if part.layout in ("rows", "cols"):
                if t.dim() != 2:
                    raise BlockSpecError(
                        f"part {part.param!r} with layout {part.layout!r} needs a 2-D weight, "
                        f"got shape {tuple(t.shape)}"
                    )
                size = t.shape[0 if part.layout == "rows" else 1]
            else:
                size = t.numel()
            if part.offset + need > size:
                raise BlockSpecError(
                    f"part {part.param!r} ({part.layout}, offset {part.offset}) needs "
                    f"{need} entries for {self.heads} head(s) of size {self.h}, but the "
                    f"parameter has only {size} along that dimension (shape {tuple(t.shape)})"
                )
        n = sum(p.rows(params[p.param]) for p in self.G)
        m = sum(p.rows(params[p.param]) for p in self.H)
        return BlockSpec(
            self.kind, self.module, self.heads, self.h, self.G, self.H, n, m, self.note
        )

    def describe(self) -> dict:
        """A JSON-friendly summary."""
        return {
            "kind": self.kind,
            "module": self.module,
            "heads": self.heads,
            "h": self.h,
            "n": self.n,
            "m": self.m,
            "G": [(p.param, p.layout, p.offset) for p in self.G],
            "H": [(p.param, p.layout, p.offset) for p in self.H],
        }


def _parts(spec) -> tuple[FactorPart, ...]:
    if isinstance(spec, (str, FactorPart)):
        spec = [spec]
    out = []
    for s in spec:
        if isinstance(s, FactorPart):
            out.append(s)
        elif isinstance(s, str):
            out.append(FactorPart(s, "cols"))
        else:
            out.append(FactorPart(*s))
    return tuple(out)


def declare_block(
    G: str | FactorPart | Sequence,
    H: str | FactorPart | Sequence,
    *,
    heads: int = 1,
    h: int | None = None,
    kind: str = "custom",
    module: str = "",
) -> BlockSpec:
    r"""Declare "these tensors are ``G`` and ``H``" of a GL(h) block.

    A bare parameter name is used **as is**: a 2-D tensor ``T`` of shape
    ``(n, h)`` is the factor itself (layout ``"cols"``).  Give a tuple
    ``(name, layout[, offset])`` or a :class:`FactorPart` for anything else,
    and a sequence of them to stack parts row-wise (e.g. a weight and its bias row).

    Examples
    --------
    Two linear layers with nothing in between, ``y = W₂(W₁x + b₁)``, have
    ``G = W₂`` and ``H = [W₁ᵀ; b₁ᵀ]`` (spec §3.4d)::

        qm.declare_block(G="fc2.weight", H=[("fc1.weight", "rows"), ("fc1.bias", "bias")])

    Parameters
    ----------
    G, H : str, FactorPart, tuple or sequence of those
        The factor parts.
    heads : int
        Number of independent blocks side by side in these tensors.
    h : int, optional
        Block size.  Default: the column count of the first ``G`` part
        divided by ``heads`` (``1`` for ``"elem"`` layouts).
    kind : str
        Recorded kind, ``"custom"`` by default (``"diagonal"`` for ``h = 1``
        elementwise pairs ``u ⊙ v``).
    module : str
        Recorded module path.

    Returns
    -------
    BlockSpec
        Unresolved (``n = m = 0``); pass it in ``blocks=`` or ``declared=``, where
        it is validated against the model.
    """
    if kind not in KINDS:
        raise BlockSpecError(f"kind must be one of {KINDS}, got {kind!r}")
    if heads < 1:
        raise BlockSpecError(f"heads must be positive, got {heads}")
    g, hh = _parts(G), _parts(H)
    if not g or not hh:
        raise BlockSpecError("both G and H need at least one part")
    if h is None:
        h = 0 if g[0].layout != "elem" else 1
    return BlockSpec(kind, module, int(heads), int(h), g, hh)


def gather_factor(
    parts: Sequence[FactorPart], params: Mapping[str, torch.Tensor], heads: int, h: int
) -> torch.Tensor:
    """One factor for all heads, ``(heads, rows, h)``."""
    return torch.cat([p.read(params[p.param], heads, h) for p in parts], dim=-2)


def gather_block(block: BlockSpec, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The packed points ``[G; H]`` of all heads of a block, ``(heads, n + m, h)``."""
    G = gather_factor(block.G, params, block.heads, block.h)
    H = gather_factor(block.H, params, block.heads, block.h)
    return torch.cat([G, H.to(G.dtype)], dim=-2)


def scatter_block(
    block: BlockSpec, x: torch.Tensor, params: dict[str, torch.Tensor]
) -> None:
    """Write the packed points ``x`` ``(heads, n + m, h)`` into ``params`` (out of place).

    Each affected entry of ``params`` is replaced by a new tensor; no tensor is
    modified in place, and the result is differentiable in ``x``.
    """
    row = 0
    for part in block.G + block.H:
        t = params[part.param]
        r = part.rows(t)
        params[part.param] = part.write(t, x[:, row : row + r, :])
        row += r


def claimed_mask(block: BlockSpec, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Boolean masks (shaped like each parameter) of the entries a block reads."""
    out: dict[str, torch.Tensor] = {}
    for part in block.G + block.H:
        t = params[part.param]
        m = out.setdefault(part.param, torch.zeros(t.shape, dtype=torch.bool, device=t.device))
        part.mark(m, block.heads, block.h)
    return out
