r"""Block specifications: which parameter slices form the factors $G$ and $H$.

A GL(h) block is a pair $G \in \mathbb R^{n\times h}$, $H \in \mathbb R^{m\times h}$ that the
network uses only through $G H^\top$ (paper App. A). In a PyTorch model the factors are slices
of `nn.Linear` weights (stored `(out, in)`), possibly with a bias row appended (App. C). A
[BlockSpec][quotient_manifolds.models.blocks.BlockSpec] describes one module's blocks for all
its heads at once: every factor is a row-wise concatenation of
[FactorPart][quotient_manifolds.models.blocks.FactorPart]s, and each part is read for all heads
in one reshape (or one strided `unfold`), so gathering is a handful of differentiable view/cat
operations, never a Python loop over heads.

Layouts of a part ($t$ is the parameter tensor; head slice $k$ covers the indices
$r_k = [\mathrm{off} + k s, \mathrm{off} + k s + h)$ with stride $s$, by default $s = h$):

* `"rows"`: `t[r_k, :]ᵀ`, `in` rows — an `(out, in)` weight whose *output* features belong
  to head $k$ (query/key/value, LoRA `A`, the output projection of a transposed `Conv1D`);
* `"cols"`: `t[:, r_k]`, `out` rows — an `(out, in)` weight whose *input* features belong to
  head $k$ (attention output projection, LoRA `B`, q/k/v of a transposed `Conv1D`);
* `"bias"`: `t.flatten()[r_k]` as one row (the appended bias row);
* `"elem"`: `t.flatten()[off + k s]` as a $1\times 1$ factor ($h = 1$; diagonal nets).

Two options cover the layouts beyond "head $k$ is the $k$-th run of $h$ features":

* `stride` — distance between consecutive head slices along the sliced dimension (`0` means
  $h$). GPT-NeoX stores each head's `[q; k; v]` together, so its query rows have stride $3h$.
* `stack` — how many consecutive head slices one block factor stacks row-wise. With grouped
  K/V heads (GQA/MQA) the $r$ query heads that read one key head share its group element: the
  Q/K block stacks their query slices into $G$ (`stack=r` on the query part), and the V/O block
  stacks their output-projection slices into $H$.

A block spec may carry a `group`: a Lie subalgebra $\mathfrak k \subseteq \mathfrak{gl}(h)$
whose connected group is the symmetry (e.g. the rotary commutant on rotary Q/K);
`None` means the full GL(h).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from ..errors import BlockSpecError
from ..manifolds import Subalgebra, group_action

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

KINDS = ("attention.qk", "attention.vo", "lora", "mlp", "diagonal", "custom")
LAYOUTS = ("rows", "cols", "bias", "elem")
Layout = Literal["rows", "cols", "bias", "elem"]


@dataclass(frozen=True)
class FactorPart:
    """A slice of one parameter that contributes rows to a factor, for every head.

    Parameters
    ----------
    param : str
        Full parameter name, as in `model.named_parameters()`.
    layout : {"rows", "cols", "bias", "elem"}
        How the slice maps to factor rows (see the module docstring).
    offset : int
        First index of head 0 along the sliced dimension (e.g. `d` for the key rows of a
        fused `in_proj_weight`).
    stride : int
        Distance between the first indices of consecutive head slices; `0` (default) means
        the slices are contiguous (stride $h$). Must be $\\ge h$ otherwise.
    stack : int
        Number of consecutive head slices stacked row-wise into one block factor (GQA: the
        query heads that share one key/value head). The part then contributes `stack` times
        the rows of one slice, and reads `heads · stack` slices.
    """

    param: str
    layout: Layout = "cols"
    offset: int = 0
    stride: int = 0
    stack: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.param, str) or not self.param:
            raise BlockSpecError(f"param must be a parameter name, got {self.param!r}")
        if self.layout not in LAYOUTS:
            raise BlockSpecError(
                f"layout of {self.param!r} must be one of {LAYOUTS}, got {self.layout!r}"
            )
        for key in ("offset", "stride"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 0:
                raise BlockSpecError(f"{key} of {self.param!r} must be an integer >= 0, got {v!r}")
        if not isinstance(self.stack, int) or self.stack < 1:
            raise BlockSpecError(f"stack of {self.param!r} must be an integer >= 1, got "
                                 f"{self.stack!r}")

    # -- geometry of the slices --------------------------------------------
    def _step(self, h: int) -> int:
        return self.stride or h

    def _width(self, h: int) -> int:
        return 1 if self.layout == "elem" else h

    def span(self, heads: int, h: int) -> int:
        """Entries along the sliced dimension from `offset` to the end of the last slice."""
        k = heads * self.stack
        return (k - 1) * self._step(self._width(h)) + self._width(h)

    def _contiguous(self, h: int) -> bool:
        return self._step(self._width(h)) == self._width(h)

    def _index(self, heads: int, h: int, device) -> torch.Tensor:
        w = self._width(h)
        k = heads * self.stack
        base = self.offset + torch.arange(k, device=device) * self._step(w)
        return (base[:, None] + torch.arange(w, device=device)[None, :]).reshape(-1)

    def rows(self, t: torch.Tensor) -> int:
        """Number of factor rows this part contributes, given its parameter `t`."""
        if self.layout == "rows":
            base = t.shape[1]
        elif self.layout == "cols":
            base = t.shape[0]
        else:
            base = 1
        return base * self.stack

    # -- read / write / mark -------------------------------------------------
    def _slices(self, t: torch.Tensor, k: int, h: int) -> torch.Tensor:
        """The `k` head slices, `(k, rows_per_slice, h)` (a view where possible)."""
        w = self._width(h)
        step = self._step(w)
        span = (k - 1) * step + w
        if self.layout == "rows":
            s = t.narrow(0, self.offset, span)
            if step == w:
                return s.reshape(k, w, t.shape[1]).transpose(-1, -2)
            return s.unfold(0, w, step)  # (k, in, h)
        if self.layout == "cols":
            s = t.narrow(1, self.offset, span)
            if step == w:
                return s.reshape(t.shape[0], k, w).permute(1, 0, 2)
            return s.unfold(1, w, step).permute(1, 0, 2)  # (k, out, h)
        flat = t.reshape(-1).narrow(0, self.offset, span)
        if step == w:
            return flat.reshape(k, 1, w)
        return flat.unfold(0, w, step).reshape(k, 1, w)

    def read(self, t: torch.Tensor, heads: int, h: int) -> torch.Tensor:
        """The part for all heads, shape `(heads, rows, h)` (differentiable)."""
        sl = self._slices(t, heads * self.stack, h)
        if self.stack == 1:
            return sl
        return sl.reshape(heads, self.stack * sl.shape[1], sl.shape[2])

    def write(self, t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Out-of-place copy of `t` with this part replaced by `value` `(heads, rows, h)`.

        Differentiable in `value` and `t` (`slice_scatter` / `index_copy`); `t` is never
        modified.
        """
        heads, rows, h = value.shape
        value = value.to(t.dtype)
        k = heads * self.stack
        value = value.reshape(k, rows // self.stack, h)
        w = self._width(h)
        if self.layout == "elem":
            src = value.reshape(k)
        elif self.layout == "rows":
            src = value.transpose(-1, -2).reshape(k * w, t.shape[1])
        elif self.layout == "cols":
            src = value.permute(1, 0, 2).reshape(t.shape[0], k * w)
        else:
            src = value.reshape(k * w)
        dim = {"rows": 0, "cols": 1}.get(self.layout)
        if self._contiguous(h):
            stop = self.offset + k * w
            if dim is not None and self.offset == 0 and k * w == t.shape[dim]:
                return src  # the part is the whole tensor: no copy of t
            if dim is None:
                flat = t.reshape(-1).slice_scatter(src, 0, self.offset, stop)
                return flat.view(t.shape)
            return t.slice_scatter(src, dim, self.offset, stop)
        idx = self._index(heads, h, t.device)
        if dim is None:
            return t.reshape(-1).index_copy(0, idx, src).view(t.shape)
        return t.index_copy(dim, idx, src)

    def mark(self, mask: torch.Tensor, heads: int, h: int) -> None:
        """Set the entries of `mask` (shaped like the parameter) covered by this part."""
        idx = self._index(heads, h, mask.device)
        if self.layout == "rows":
            mask.index_fill_(0, idx, True)
        elif self.layout == "cols":
            mask.index_fill_(1, idx, True)
        else:
            mask.view(-1).index_fill_(0, idx, True)


@dataclass(frozen=True)
class BlockSpec:
    r"""The blocks of one module, all heads together.

    The factors of block $i$ are $G_i$ = the parts of `G` read for block $i$, stacked
    row-wise ($n$ rows), and likewise $H_i$ ($m$ rows); the network depends on them only
    through $G_i H_i^\top$, and the symmetry is $(G_i, H_i) \mapsto (G_i A^{-1}, H_i A^\top)$
    for $A$ in the block's group.

    Attributes
    ----------
    kind : str
        `"attention.qk"`, `"attention.vo"`, `"lora"`, `"diagonal"` or `"custom"`.
    module : str
        Module path (`""` for the root or a declared block).
    heads : int
        Number of independent blocks in this spec (for GQA: the number of key/value heads).
    h : int
        Block (head) dimension.
    G, H : tuple of FactorPart
        The parts of each factor, top to bottom (e.g. weight rows then the bias row).
    n, m : int
        Rows of `G` and `H` (filled in by `resolved`).
    note : str
        Free text (not compared).
    group : Subalgebra or None
        The Lie subalgebra $\mathfrak k \subseteq \mathfrak{gl}(h)$ of the symmetry group
        (e.g. a `RotaryCommutant`); `None` is the full GL(h).
    connected : bool
        Only the identity component of the group is a symmetry (a ReLU unit's positive
        scalings $GL^+(1)$); the quotient geometry is the same (it is local), but random
        elements are drawn in the identity component.
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
    group: Subalgebra | None = None
    connected: bool = False

    @property
    def params(self) -> tuple[str, ...]:
        """Names of every parameter this block reads (with repetitions removed)."""
        return tuple(dict.fromkeys(p.param for p in self.G + self.H))

    def resolved(self, params: Mapping[str, torch.Tensor]) -> BlockSpec:
        """Validate against `params` and fill in `n`, `m` (and `h` if it is 0).

        Raises
        ------
        BlockSpecError
            If a part names a parameter the model does not have, reads past its end,
            `h` cannot be inferred, or the group does not act on $\\mathbb R^h$.
        """
        spec = self
        if self.h == 0:
            spec = replace(self, h=self._infer_h(params))
        return spec._resolved(params)

    def _infer_h(self, params: Mapping[str, torch.Tensor]) -> int:
        first = self.G[0]
        t = self._param(first, params)
        if first.layout == "elem":
            return 1
        size = {"rows": t.shape[0], "cols": t.shape[-1]}.get(first.layout, t.numel())
        k = self.heads * first.stack
        if first.offset or first.stride or size % k:
            raise BlockSpecError(
                f"cannot infer the block size h of {self.kind!r} at {self.module!r} from "
                f"{first.param!r} (shape {tuple(t.shape)}, offset {first.offset}, stride "
                f"{first.stride}, {k} slice(s)); pass h= to declare_block"
            )
        return size // k

    def _param(self, part: FactorPart, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if part.param not in params:
            raise BlockSpecError(
                f"block {self.kind!r} at {self.module!r} names parameter {part.param!r}, "
                "which the model does not have; use a name from model.named_parameters()"
            )
        return params[part.param]

    def _resolved(self, params: Mapping[str, torch.Tensor]) -> BlockSpec:
        if self.h < 1:
            raise BlockSpecError(f"block {self.kind!r} at {self.module!r} has h = {self.h}")
        if self.heads < 1:
            raise BlockSpecError(f"block {self.kind!r} at {self.module!r} has heads = "
                                 f"{self.heads}")
        if not self.G or not self.H:
            raise BlockSpecError(f"block {self.kind!r} at {self.module!r} needs at least one "
                                 "part in G and in H")
        if self.group is not None and self.group.h != self.h:
            raise BlockSpecError(
                f"block {self.kind!r} at {self.module!r}: its group acts on R^{self.group.h} "
                f"but the block size is h = {self.h}"
            )
        for part in self.G + self.H:
            t = self._param(part, params)
            if part.layout == "elem" and self.h != 1:
                raise BlockSpecError(f"part {part.param!r} has layout 'elem', which needs "
                                     f"h = 1 (got h = {self.h})")
            if part.stride and part.stride < part._width(self.h):
                raise BlockSpecError(
                    f"part {part.param!r} has stride {part.stride} < h = {self.h}: head slices "
                    "would overlap; use stride 0 for contiguous heads"
                )
            if part.layout in ("rows", "cols"):
                if t.dim() != 2:
                    raise BlockSpecError(
                        f"part {part.param!r} with layout {part.layout!r} needs a 2-D weight, "
                        f"got shape {tuple(t.shape)}"
                    )
                size = t.shape[0 if part.layout == "rows" else 1]
            else:
                size = t.numel()
            need = part.span(self.heads, self.h)
            if part.offset + need > size:
                raise BlockSpecError(
                    f"part {part.param!r} ({part.layout}, offset {part.offset}, stride "
                    f"{part.stride}, stack {part.stack}) needs {need} entries for "
                    f"{self.heads * part.stack} slice(s) of size {self.h}, but the parameter "
                    f"has only {size - part.offset} from the offset on (shape "
                    f"{tuple(t.shape)}); check heads=, h= and the offsets"
                )
        n = sum(p.rows(params[p.param]) for p in self.G)
        m = sum(p.rows(params[p.param]) for p in self.H)
        return replace(self, n=n, m=m)

    # -- the group action -----------------------------------------------------------------------
    def apply_element(self, params: Mapping[str, torch.Tensor], A: torch.Tensor, *,
                      one_sided: bool = False) -> dict[str, torch.Tensor]:
        r"""`params` with every head's factors moved by its element $A_i$ (`(heads, h, h)`):
        $(G_i A_i^{-1}, H_i A_i^\top)$, or only $G_i A_i^{-1}$ with `one_sided` (not a
        symmetry: the probe's control). Out of place; the block must be resolved."""
        x = gather_block(self, params)
        out = dict(params)
        scatter_block(self, group_action(x, A.to(x), self.n, one_sided=one_sided), out)
        return out

    def random_element(self, generator: torch.Generator | None = None, a: float = 1.0
                       ) -> torch.Tensor:
        r"""A random element per head, `(heads, h, h)` float64, as the paper draws them (§6.2).

        GL(h): $A = a\,\tilde G$, $\tilde G_{ij} \sim N(0, 1)$. A subgroup: $A = a \exp(X)$
        with $X$ a random element of its Lie algebra of spectral norm 1 (the subalgebra's
        `random_element`), the factor $a$ kept only where $a I$ belongs to the subgroup (it
        does for the rotary commutant).
        """
        if self.group is None and self.connected:
            X = torch.randn(self.heads, self.h, self.h, generator=generator, dtype=torch.float64)
            return a * torch.linalg.matrix_exp(X / math.sqrt(self.h))
        if self.group is None:
            return a * torch.randn(self.heads, self.h, self.h, generator=generator,
                                   dtype=torch.float64)
        try:
            A = self.group.random_element(generator, scale=1.0, dtype=torch.float64,
                                          batch=(self.heads,))
        except TypeError:  # a subalgebra without batched draws
            A = torch.stack([self.group.random_element(generator, scale=1.0,
                                                       dtype=torch.float64)
                             for _ in range(self.heads)])
        eye = torch.eye(self.h, dtype=torch.float64)
        if float((self.group.project(eye) - eye).abs().max()) < 1e-12:
            A = a * A
        return A

    def lie_dim(self, params: Mapping[str, torch.Tensor] | None = None) -> int:
        r"""Coordinates of `act_at`: an $h \times h$ matrix per head (projected onto the
        subalgebra of a subgroup, so then redundant)."""
        return self.heads * self.h * self.h

    def act_at(self, params: Mapping[str, torch.Tensor], theta: torch.Tensor
               ) -> dict[str, torch.Tensor]:
        r"""`params` moved by $A_i = \exp(X_i)$ per head, $X_i$ the `(h, h)` slices of `theta`
        (projected onto the block's subalgebra); differentiable in `theta`."""
        X = theta.reshape(self.heads, self.h, self.h)
        if self.group is not None:
            X = self.group.project(X)
        return self.apply_element(params, torch.linalg.matrix_exp(X))

    def act(self, params: Mapping[str, torch.Tensor], generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        """`params` moved by a random element of the block's group
        ([`random_element`][quotient_manifolds.models.blocks.BlockSpec.random_element])."""
        return self.apply_element(params, self.random_element(generator, a))

    def describe(self) -> dict:
        """A JSON-friendly summary."""

        def parts(ps):
            return [(p.param, p.layout, p.offset, p.stride, p.stack) for p in ps]

        return {
            "kind": self.kind,
            "module": self.module,
            "heads": self.heads,
            "h": self.h,
            "n": self.n,
            "m": self.m,
            "G": parts(self.G),
            "H": parts(self.H),
            "group": None if self.group is None else repr(self.group),
            **({"connected": True} if self.connected else {}),
        }


_PART_HELP = (
    "a factor part is a parameter name, a FactorPart, a tuple (name, layout[, offset"
    "[, stride[, stack]]]) or a dict of FactorPart fields; give a list of them (not a "
    "tuple) to stack parts row-wise"
)


def _part(s) -> FactorPart:
    if isinstance(s, FactorPart):
        return s
    if isinstance(s, str):
        return FactorPart(s, "cols")
    if isinstance(s, Mapping):
        try:
            return FactorPart(**s)
        except TypeError as e:
            raise BlockSpecError(f"bad factor part {dict(s)!r} ({e}); {_PART_HELP}") from None
    if isinstance(s, tuple) and 1 <= len(s) <= 5 and isinstance(s[0], str):
        try:
            return FactorPart(*s)
        except TypeError as e:
            raise BlockSpecError(f"bad factor part {s!r} ({e}); {_PART_HELP}") from None
    raise BlockSpecError(f"bad factor part {s!r}; {_PART_HELP}")


def _is_single(spec) -> bool:
    if isinstance(spec, (str, FactorPart, Mapping)):
        return True
    return isinstance(spec, tuple) and len(spec) >= 1 and isinstance(spec[0], str)


def _parts(spec) -> tuple[FactorPart, ...]:
    if _is_single(spec):
        return (_part(spec),)
    if isinstance(spec, Sequence):
        return tuple(_part(s) for s in spec)
    raise BlockSpecError(f"bad factor {spec!r}; {_PART_HELP}")


def declare_block(
    G: str | FactorPart | tuple | Mapping | Sequence,
    H: str | FactorPart | tuple | Mapping | Sequence,
    *,
    heads: int = 1,
    h: int | None = None,
    kind: str = "custom",
    module: str = "",
    group: Subalgebra | None = None,
) -> BlockSpec:
    r"""Declare "these tensors are $G$ and $H$" of a block, in one line.

    A bare parameter name is used **as is**: a 2-D tensor of shape `(n, h)` is the factor
    itself (layout `"cols"`). Give a tuple `(name, layout[, offset[, stride[, stack]]])`, a
    dict of [FactorPart][quotient_manifolds.models.blocks.FactorPart] fields or a `FactorPart`
    for anything else, and a list of them to stack parts row-wise (e.g. a weight and its bias
    row).

    Examples
    --------
    Two linear layers with nothing in between, $y = W_2(W_1 x + b_1)$, have $G = W_2$ and
    $H = [W_1^\top; b_1^\top]$:

        qm.declare_block(G="fc2.weight", H=[("fc1.weight", "rows"), ("fc1.bias", "bias")])

    The query/key heads of a fused `qkv` projection (`d = 16`, 2 heads of size 8):

        qm.declare_block(G=("attn.qkv.weight", "rows", 0), H=("attn.qkv.weight", "rows", 16),
                         heads=2, h=8, kind="attention.qk")

    Grouped value/output heads (GQA: 4 query heads read 2 value heads, so each value head's
    group element also acts on the output columns of the 2 query heads that read it):

        qm.declare_block(G=("attn.v_proj.weight", "rows"),
                         H={"param": "attn.o_proj.weight", "layout": "cols", "stack": 2},
                         heads=2, h=8, kind="attention.vo")

    Parameters
    ----------
    G, H : str, FactorPart, tuple, dict or list of those
        The factor parts.
    heads : int
        Number of independent blocks side by side in these tensors (for grouped heads: the
        number of key/value heads).
    h : int, optional
        Block size. Default: inferred from the first `G` part when it starts at offset 0 and
        is contiguous (its sliced size divided by `heads · stack`; `1` for `"elem"` layouts).
    kind : str
        Recorded kind, `"custom"` by default (`"diagonal"` for $h = 1$ elementwise pairs
        $u \odot v$).
    module : str
        Recorded module path.
    group : Subalgebra, optional
        Restrict the symmetry to the connected group of this subalgebra of
        $\mathfrak{gl}(h)$ (e.g. `RotaryCommutant(h, pairs)` for rotary Q/K).

    Returns
    -------
    BlockSpec
        Unresolved (`n = m = 0`); pass it in `blocks=` or `declared=`, where it is validated
        against the model.

    Raises
    ------
    BlockSpecError
        For a malformed part, an unknown kind or a non-positive `heads`.
    """
    if kind not in KINDS:
        raise BlockSpecError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(heads, int) or heads < 1:
        raise BlockSpecError(f"heads must be a positive integer, got {heads!r}")
    if h is not None and (not isinstance(h, int) or h < 1):
        raise BlockSpecError(f"h must be a positive integer, got {h!r}")
    if group is not None and not isinstance(group, Subalgebra):
        raise BlockSpecError(f"group must be a Subalgebra (or None for GL(h)), got {group!r}")
    g, hh = _parts(G), _parts(H)
    if not g or not hh:
        raise BlockSpecError("both G and H need at least one part")
    if h is None:
        h = 0 if g[0].layout != "elem" else 1
    return BlockSpec(kind, module, int(heads), int(h), g, hh, group=group)


def gather_factor(
    parts: Sequence[FactorPart], params: Mapping[str, torch.Tensor], heads: int, h: int
) -> torch.Tensor:
    """One factor for all heads, `(heads, rows, h)`."""
    return torch.cat([p.read(params[p.param], heads, h) for p in parts], dim=-2)


def gather_block(block: BlockSpec, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The packed points `[G; H]` of all heads of a block, `(heads, n + m, h)`."""
    G = gather_factor(block.G, params, block.heads, block.h)
    H = gather_factor(block.H, params, block.heads, block.h)
    return torch.cat([G, H.to(G.dtype)], dim=-2)


def scatter_block(
    block: BlockSpec, x: torch.Tensor, params: dict[str, torch.Tensor]
) -> None:
    """Write the packed points `x` `(heads, n + m, h)` into `params` (out of place).

    Each affected entry of `params` is replaced by a new tensor; no tensor is modified in
    place, and the result is differentiable in `x`.
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
