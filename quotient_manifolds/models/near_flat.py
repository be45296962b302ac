r"""Near-flat directions: the scaling of a norm's input, flat only up to the norm's $\varepsilon$.

A LayerNorm computes $\mathrm{LN}(x) = \gamma \odot (x - \bar x)/\sqrt{\sigma^2(x) + \varepsilon}
+ \beta$. At $\varepsilon = 0$ it is blind to a scaling of its input, $\mathrm{LN}(\lambda x) =
\mathrm{LN}(x)$ for $\lambda > 0$; at $\varepsilon > 0$ only nearly:
$\partial_\lambda \mathrm{LN}(\lambda x)|_{\lambda = 1} = -\gamma \odot \hat x\,
\varepsilon / (\sigma^2 + \varepsilon)$, a relative change of order $\varepsilon / \sigma^2$. A
post-norm model (BERT) writes the input of each LayerNorm with a few maps only, so scaling
them together is a direction of the parameters along which the function changes by
$O(\varepsilon)$: below any threshold that counts flat directions when
$\varepsilon = 10^{-12}$, yet no symmetry (the measure does not quotient it out, and at
$\varepsilon = 10^{-5}$ it is not flat at all).

[`near_flat`][quotient_manifolds.models.near_flat.near_flat] finds these directions on the
traced forward pass of a [`Prober`][quotient_manifolds.models.prober.Prober] and verifies each:

* the **direct writers** of a norm's input $x$: the linear maps and embedding tables whose
  output $y$ enters $x$ additively ($y \mapsto y + \delta$ moves $x$ by exactly $\delta$);
* the **norm writers**: another norm whose output $y$ enters $x$ additively once its linear
  readers are cut (they keep reading the unmoved $y$): the residual of a post-norm block;
* the group element $\lambda$: the direct writers' weights and biases and the norm writers'
  gains and shifts times $\lambda$, the norm writers' readers' weights times $1/\lambda$.

* **the padding token's rows** (RoBERTa): where a token reads position row $p$ exactly when it
  is the padding token $p$ (the padding pair), that token's input to the embeddings' norm is
  $e = E_w[p] + E_p[p] + \sum_k E_k[r_k]$ (the other tables at the one row $r_k$ the traced
  input reads) and nothing else writes it: $E_w[p] \mapsto E_w[p] + (\lambda - 1)\, e$ scales
  it alone ([`RowNearFlat`][quotient_manifolds.models.near_flat.RowNearFlat]), checked on the
  traced input with padding tokens added.

* **the residual stream** of a pre-norm model: every module that writes the stream
  ([`stream`][quotient_manifolds.models.stream]: tables, output projections, a patch
  convolution, a class token and position table) reaches the outputs only through the norms
  that read it, so all of them times $\lambda$ scale every norm's input at once
  ([`StreamNearFlat`][quotient_manifolds.models.near_flat.StreamNearFlat]); checked with
  every one of these norms at $\varepsilon = 0$.

It is reported only if a finite element ($\lambda = 1.7$) leaves the outputs unchanged to
$10^{-10}$ (relative) once this norm's $\varepsilon$ is set to $0$: a symmetry of the
$\varepsilon = 0$ model, broken by $\varepsilon$ alone. The audit then counts the directions
that lie in the kernel it measured as **near-flat**, a separate category (not claimed, not
unexplained), each with its norm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .linear import Consumer, ReadQuery, linear_layer, readers_of, storage
from .norms import is_norm, norm_bias, norm_weight
from .paths import feeds_only
from .precision import float64_internals, no_fastpath
from .prober import Prober, output_tensors, relative_change
from .stream import norm_readers, writer_params, writes_stream

__all__ = ["NearFlat", "RowNearFlat", "StreamNearFlat", "near_flat"]

Params = Mapping[str, torch.Tensor]

_EXACT_RTOL = 1e-10  # a finite element at eps = 0 keeps the outputs to this (relative)
_LAMBDA = 1.7


@dataclass(frozen=True)
class NearFlat:
    """The scaling of one norm's input by its writers, flat up to the norm's `eps`.

    Attributes
    ----------
    norm : str
        The norm whose input is scaled.
    eps : float
        Its $\\varepsilon$.
    up : tuple of str
        Parameters times $\\lambda$ (the writers).
    down : tuple of Consumer
        Linear maps times $1/\\lambda$ (the readers of a norm writer).
    exact : float
        Relative change of the outputs under $\\lambda = 1.7$ with this norm's
        $\\varepsilon = 0$ (below $10^{-10}$).
    change : float
        The same with the model's $\\varepsilon$ (of order $\\varepsilon / \\sigma^2$).
    """

    norm: str
    eps: float
    up: tuple[str, ...]
    down: tuple[Consumer, ...]
    exact: float = 0.0
    change: float = 0.0

    def act(self, params: Params, lam: float) -> dict[str, torch.Tensor]:
        """`params` with the writers times `lam` and the readers times `1/lam`."""
        out = dict(params)
        for n in self.up:
            out[n] = params[n] * lam
        for c in self.down:
            M, _ = c.read(out)
            c.write(out, M / lam, None)
        return out

    def tangent(self, params: Params, names: Sequence[str]) -> torch.Tensor:
        r"""$\partial_\lambda\,\mathrm{act}_\lambda(w)|_{\lambda = 1}$, flattened over `names`."""
        zero = {n: torch.zeros_like(params[n]) for n in names}
        moved = dict(zero)
        for n in self.up:
            moved[n] = params[n].clone()
        for c in self.down:
            M, _ = c.read(params)
            c.write(moved, -M, None)
        return torch.cat([moved[n].reshape(-1).to(torch.float64) for n in names])

    def describe(self) -> dict:
        """A JSON-friendly summary."""
        return {"norm": self.norm, "eps": self.eps, "up": list(self.up),
                "down": [c.weight for c in self.down], "exact": self.exact,
                "change": self.change,
                "reason": f"scaling of the input of {self.norm}: flat only up to its "
                          f"eps={self.eps:g}"}



@dataclass(frozen=True)
class RowNearFlat(NearFlat):
    r"""The scaling of a norm's input at the tokens that read one row of each table (the
    padding token of a padding pair): $E_w[p] \mapsto E_w[p] + (\lambda - 1)\, e$,
    $e = \sum_k E_k[r_k]$ over `rows` (the first is written)."""

    rows: tuple[tuple[str, int], ...] = ()

    def _e(self, params: Params) -> torch.Tensor:
        return sum((params[t][r] for t, r in self.rows[1:]), params[self.rows[0][0]][
            self.rows[0][1]])

    def _write(self, base: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        i = torch.tensor([self.rows[0][1]], device=base.device)
        return base.index_add(0, i, v.to(base.dtype)[None])

    def act(self, params: Params, lam: float) -> dict[str, torch.Tensor]:
        t = self.rows[0][0]
        return {**params, t: self._write(params[t], (lam - 1) * self._e(params))}

    def tangent(self, params: Params, names: Sequence[str]) -> torch.Tensor:
        t = self.rows[0][0]
        moved = {n: torch.zeros_like(params[n]) for n in names}
        moved[t] = self._write(moved[t], self._e(params))
        return torch.cat([moved[n].reshape(-1).to(torch.float64) for n in names])

    def describe(self) -> dict:
        """A JSON-friendly summary."""
        return {**super().describe(), "rows": [list(r) for r in self.rows],
                "reason": f"scaling of the input of {self.norm} at the tokens reading rows "
                          f"{list(self.rows)} alone: flat only up to its eps={self.eps:g}"}

@dataclass(frozen=True)
class StreamNearFlat(NearFlat):
    """The scaling of a whole residual stream by its writers (`up`), read by the norms
    `norms` (`norm` is the first of them, `eps` their largest)."""

    norms: tuple[str, ...] = ()

    def describe(self) -> dict:
        """A JSON-friendly summary."""
        return {**super().describe(), "norms": list(self.norms),
                "reason": f"scaling of the residual stream read by {len(self.norms)} norms: "
                          f"flat only up to their eps={self.eps:g}"}


@contextlib.contextmanager
def _eps(*mods: nn.Module, value: float = 0.0) -> Iterator[None]:
    old = [m.eps for m in mods]
    for m in mods:
        m.eps = value  # type: ignore[assignment]  # a norm's float attribute
    try:
        yield
    finally:
        for m, e in zip(mods, old, strict=True):
            m.eps = e


def _first(out: object) -> torch.Tensor | None:
    y = out[0] if isinstance(out, tuple) and out else out
    return y if isinstance(y, torch.Tensor) and y.is_floating_point() else None


def _moves_by_delta(p: Prober, source: str, cut: Sequence[str], norm: str,
                    x: torch.Tensor) -> bool:
    """Whether adding a random $\\delta$ to the first output of `source` (the modules `cut`
    still reading the unmoved output) moves the input of `norm` by exactly $\\delta$."""
    state: dict = {}

    def post(mod, args, out):
        y = _first(out)
        if "y" in state or y is None:
            return None
        d = torch.randn(y.shape, generator=p.gen, dtype=y.dtype) * (float(y.abs().max()) + 1)
        state["y"], state["d"] = y, d
        moved = y + d
        state["ptr"] = storage(moved)
        return (moved, *out[1:]) if isinstance(out, tuple) else moved

    def pre(mod, args, kwargs):
        def back(t):
            return state["y"] if "y" in state and storage(t) == state["ptr"] else t
        return tuple(back(a) for a in args), {k: back(v) for k, v in kwargs.items()}

    def grab(mod, args, kwargs):
        if "x" not in state and args and isinstance(args[0], torch.Tensor):
            state["x"] = args[0]

    hooks = [p.modules[source].register_forward_hook(post),
             p.modules[norm].register_forward_pre_hook(grab, with_kwargs=True)]
    hooks += [p.modules[n].register_forward_pre_hook(pre, with_kwargs=True) for n in cut]
    try:
        with torch.no_grad(), no_fastpath(), float64_internals():
            torch.func.functional_call(p.model, {**p.params, **p.buffers}, p.args, p.kwargs)
    except Exception:  # noqa: BLE001 -- the moved output broke the forward: not a writer
        return False
    finally:
        for hk in hooks:
            hk.remove()
    if "x" not in state or "d" not in state:
        return False
    try:
        d = state["d"].expand_as(x)
    except RuntimeError:
        return False
    err = (state["x"] - x - d).abs().max()
    return bool(err <= 1e-10 * float(d.abs().max()))


def _writers(p: Prober, norm: str, x: torch.Tensor, d: int
             ) -> tuple[list[str], list[Consumer]]:
    up: list[str] = []
    down: list[Consumer] = []
    calls = p.parameterised_calls()
    seen: set[str] = set()
    for c in p.calls:
        if c.name in seen or c.name == norm:
            continue
        seen.add(c.name)
        m, y = p.modules[c.name], _first(c.out)
        if y is None or not y.shape or y.shape[-1] != d:
            continue
        if isinstance(m, nn.Embedding) or linear_layer(m) is not None:
            if _moves_by_delta(p, c.name, (), norm, x):
                lin = linear_layer(m)
                up += [p.name(m.weight)] + ([p.name(lin.bias)] if lin is not None
                                            and lin.bias is not None else [])
        elif is_norm(m) and norm_weight(m).numel() == d:
            found = readers_of(calls, ReadQuery(storage(y), d, p.name, p.pname))
            if found is None or not _moves_by_delta(p, c.name, found[1], norm, x):
                continue
            gain, shift = norm_weight(m), norm_bias(m)
            if gain is not None:
                up.append(p.name(gain))
            if shift is not None:
                up.append(p.name(shift))
            down += found[0]
    return list(dict.fromkeys(up)), down


def near_flat(p: Prober, params: Params) -> list[NearFlat]:
    """The verified near-flat scalings of the norms of `p`'s model, at `params` (see the
    module docstring)."""
    if p.reference is None or p.problem is not None:
        return []
    found = []
    done: set[str] = set()
    for c in p.calls:
        m = p.modules[c.name]
        eps = getattr(m, "eps", None)
        if (c.name in done or not is_norm(m) or not isinstance(eps, float) or eps <= 0
                or not c.args or not isinstance(c.args[0], torch.Tensor)):
            continue
        done.add(c.name)
        d = norm_weight(m).numel()
        up, down = _writers(p, c.name, c.args[0], d)
        if not up:
            continue
        cand = NearFlat(c.name, eps, tuple(up), tuple(down))
        moved = cand.act(params, _LAMBDA)
        with _eps(m):
            exact = relative_change(p.run(params), p.run(moved))
        if exact > _EXACT_RTOL:
            continue
        change = relative_change(p.run(params), p.run(moved))
        found.append(NearFlat(c.name, eps, tuple(up), tuple(down), exact, change))
    return found + _stream(p, params) + _padding_rows(p, params)


def _eps_of(m: nn.Module) -> float:
    """A norm's $\\varepsilon$ (a float attribute)."""
    eps = getattr(m, "eps", None)
    return float(eps) if isinstance(eps, float) else 0.0


def _stream(p: Prober, params: Params) -> list[NearFlat]:
    """The scaling of a pre-norm model's residual stream (module docstring), if exact at
    $\varepsilon = 0$: empty for a model with fewer than two norms of the stream's width."""
    norms: dict[str, nn.Module] = {}
    for c in p.calls:
        m = p.modules[c.name]
        if is_norm(m) and isinstance(getattr(m, "eps", None), float) and m.eps > 0:
            norms.setdefault(c.name, m)
    widths = [norm_weight(m).numel() for m in norms.values()]
    if len(norms) < 2:
        return []
    d = max(set(widths), key=widths.count)
    stream = {n: m for n, m in norms.items() if norm_weight(m).numel() == d}
    readers = norm_readers(p, set(stream), d)
    sources = list(dict.fromkeys(
        c.name for c in p.calls if c.name not in stream and writes_stream(
            p.modules[c.name], _first(c.out), {d}) and not {
            n for n, _ in writer_params(p, c.name, p.modules[c.name], d)} & readers))
    feeds = feeds_only(p, sources, list(stream)) if sources else {}
    up = tuple(dict.fromkeys(param for n in sources if feeds[n]
                             for param, _ in writer_params(p, n, p.modules[n], d)))
    if not up or len(stream) < 2:
        return []
    cand = StreamNearFlat(next(iter(stream)), max(_eps_of(m) for m in stream.values()), up, (),
                          norms=tuple(stream))
    moved = cand.act(params, _LAMBDA)
    with _eps(*stream.values()):
        exact = relative_change(p.run(params), p.run(moved))
    if exact > _EXACT_RTOL:
        return []
    change = relative_change(p.run(params), p.run(moved))
    return [StreamNearFlat(cand.norm, cand.eps, up, (), exact, change, norms=tuple(stream))]


def _one_row(p: Prober, table: nn.Embedding) -> int | None:
    """The one row of `table` the traced pass reads (`None`: several, or none)."""
    for c in p.calls:
        if p.modules[c.name] is table and c.args and isinstance(c.args[0], torch.Tensor):
            rows = c.args[0].unique()
            return int(rows[0]) if rows.numel() == 1 else None
    return None


def _padding_rows(p: Prober, params: Params) -> list[NearFlat]:
    """The padding token's near-flat scaling, for each padding pair (module docstring)."""
    from .families.embeddings import _padded, _paired  # the pair's test, shared

    found: list[NearFlat] = []
    for m in p.modules.values():
        tables = [c for c in m.children() if isinstance(c, nn.Embedding)]
        norms = [c for c in m.children() if is_norm(c) and isinstance(getattr(c, "eps", None),
                                                                    float) and c.eps > 0]
        if len(tables) < 2 or len(norms) != 1:
            continue
        word = max(tables, key=lambda t: t.num_embeddings)
        pad = next((x for x in (*(t.padding_idx for t in tables if t is not word),
                                getattr(m, "padding_idx", None)) if isinstance(x, int)), None)
        w = p.name(word.weight)
        pos = next((t for t in tables if t is not word and isinstance(pad, int)
                    and 0 <= pad < t.num_embeddings - 1 and pad < word.num_embeddings
                    and _paired(p, w, p.name(t.weight), pad)), None)
        if pos is None or pad is None:
            continue
        rest = [(p.name(t.weight), _one_row(p, t)) for t in tables if t not in (word, pos)]
        inputs = _padded(p, pad)
        if inputs is None or any(r is None for _, r in rest):
            continue
        rows = ((w, pad), (p.name(pos.weight), pad), *((t, int(r)) for t, r in rest
                                                       if r is not None))
        norm = next(n for n, x in p.modules.items() if x is norms[0])
        cand = RowNearFlat(norm, float(norms[0].eps), tuple(dict.fromkeys(t for t, _ in rows)),
                           (), rows=rows)

        def run(q: Params, inputs=inputs) -> list[torch.Tensor]:
            with torch.no_grad(), no_fastpath(), float64_internals():
                return output_tensors(torch.func.functional_call(
                    p.model, {**q, **p.buffers}, inputs[0], inputs[1]))
        moved = cand.act(params, _LAMBDA)
        with _eps(norms[0]):
            exact = relative_change(run(params), run(moved))
        if exact <= _EXACT_RTOL:
            found.append(RowNearFlat(cand.norm, cand.eps, cand.up, (), exact,
                                     relative_change(run(params), run(moved)), rows=rows))
    return found
