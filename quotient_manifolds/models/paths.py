r"""Where activations flow, read off one forward and backward pass of the prober's copy.

Two questions the fold families ask: does a module's output reach the model's outputs only
through given readers ([`reaches_only`][quotient_manifolds.models.paths.reaches_only]: a
pre-norm's output, read only by its linear consumers), and do modules' outputs reach the outputs
only through the inputs of given modules
([`feeds_only`][quotient_manifolds.models.paths.feeds_only]: the writers into a LayerNorm). Both
cut the graph at the given modules' inputs and test whether a gradient still arrives.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable, Sequence

import torch

from .linear import Consumer, linear_layer, storage
from .precision import float64_internals, no_fastpath
from .prober import Prober, output_tensors

__all__ = ["feeds_only", "pooled_readers", "reaches_only", "shift_readers"]


def _outputs(p: Prober, out: object) -> list[torch.Tensor]:
    return [t for t in output_tensors(out) if t.requires_grad]


def _projection(p: Prober, outs: Sequence[torch.Tensor]) -> torch.Tensor:
    return functools.reduce(operator.add, (
        (t * torch.randn(t.shape, generator=p.gen, dtype=t.dtype).to(t.device)).sum()
        for t in outs))


def reaches_only(p: Prober, module: str, readers: Sequence[str], *,
                 through: bool = False) -> bool:
    """Whether the output of `module` reaches the model's outputs only through the modules
    `readers`.

    One forward and backward pass with the readers' inputs detached where they are the
    module's output (with `through`: every tensor input of theirs, for readers that read it
    through a pooling): the gradient of the outputs with respect to the module's output is
    then zero exactly when no other path (a residual connection, a returned hidden state)
    reads it.
    """
    store: dict = {}
    ptrs: set = set()

    def post(mod, args, out):
        y = out.detach().requires_grad_(True)
        store["y"] = y
        ptrs.add(storage(y))
        return y

    def cut_here(a: object) -> bool:
        return isinstance(a, torch.Tensor) and (through or storage(a) in ptrs)

    def pre(mod, args, kwargs):
        cut = tuple(a.detach() if cut_here(a) else a for a in args)
        kw = {k: (v.detach() if cut_here(v) else v) for k, v in kwargs.items()}
        return cut, kw

    hooks = [p.modules[module].register_forward_hook(post)]
    hooks += [p.modules[name].register_forward_pre_hook(pre, with_kwargs=True)
              for name in set(readers)]
    try:
        with torch.enable_grad(), no_fastpath(), float64_internals():
            out = _outputs(p, torch.func.functional_call(
                p.model, {**p.params, **p.buffers}, p.args, p.kwargs))
            y = store.get("y")
            if y is None:
                return False
            if not out:
                return True
            (g,) = torch.autograd.grad(_projection(p, out), [y], allow_unused=True)
    finally:
        for hk in hooks:
            hk.remove()
    return g is None or not bool(g.abs().max() > 0)


def feeds_only(p: Prober, sources: Iterable[str], sinks: Iterable[str]) -> dict[str, bool]:
    """For each module of `sources`, whether its output (its first call's; the first element of
    a tuple) reaches the model's
    outputs only through the inputs of the modules `sinks` (every input of a sink is cut); a
    source that is not called is `False`. A necessary condition for a translation of the
    source's output to be invisible, not a sufficient one (it may pass a nonlinearity first):
    the probe decides."""
    sources = list(dict.fromkeys(sources))
    leaves: dict[str, torch.Tensor] = {}

    def post(name):
        def f(mod, args, out):
            first = out[0] if isinstance(out, tuple) and out else out
            if name in leaves or not isinstance(first, torch.Tensor):
                return None
            y = first.detach().requires_grad_(True)
            leaves[name] = y
            return (y, *out[1:]) if isinstance(out, tuple) else y
        return f

    def pre(mod, args, kwargs):
        return (tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
                {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

    hooks = [p.modules[n].register_forward_hook(post(n)) for n in sources]
    hooks += [p.modules[n].register_forward_pre_hook(pre, with_kwargs=True)
              for n in dict.fromkeys(sinks)]
    try:
        with torch.enable_grad(), no_fastpath(), float64_internals():
            out = _outputs(p, torch.func.functional_call(
                p.model, {**p.params, **p.buffers}, p.args, p.kwargs))
            found = [n for n in sources if n in leaves]
            grads = torch.autograd.grad(_projection(p, out), [leaves[n] for n in found],
                                        allow_unused=True) if out and found else [None] * len(found)
    finally:
        for hk in hooks:
            hk.remove()
    zero = {n: g is None or not bool(g.abs().max() > 0) for n, g in zip(found, grads, strict=True)}
    return {n: zero.get(n, False) for n in sources}


def shift_readers(p: Prober, module: str, readers: Sequence[str], *,
                  linear: bool = False) -> list[str]:
    r"""The modules of `readers` whose (first) input moves by exactly $t$ when the output $y$ of
    `module` moves by $t$, a random vector along the last axis broadcast over the others: they
    read $y$ through a map that commutes with such a shift (a mean over the sequence, a slice,
    a dropout in eval mode). With `linear`, $y$ is mapped to $y A^\top$ instead, $A$ a random
    matrix on the last axis, and the input must become $x A^\top$: the map commutes with every
    linear map of the features (a mean pooling does; a residual rotation needs it). A
    necessary condition for a fold that compensates in them (the probe decides)."""
    d = p.first_call(module)
    y0 = d.out if d is not None else None
    if not isinstance(y0, torch.Tensor) or not y0.shape:
        return []
    width = y0.shape[-1]
    t = torch.randn(width, generator=p.gen, dtype=y0.dtype) * (float(y0.abs().max()) + 1)
    A = (torch.randn(width, width, generator=p.gen, dtype=y0.dtype) / math.sqrt(width)
         if linear else None)
    seen: dict[str, torch.Tensor] = {}
    done: set[str] = set()

    def moved(y: torch.Tensor) -> torch.Tensor:
        return y @ A.T if A is not None else y + t

    def post(mod, args, out):
        if "y" in done or not isinstance(out, torch.Tensor):
            return None
        done.add("y")
        return moved(out)

    def pre(name):
        def f(mod, args):
            if name not in seen and args and isinstance(args[0], torch.Tensor):
                seen[name] = args[0]
        return f

    hooks = [p.modules[module].register_forward_hook(post)]
    hooks += [p.modules[n].register_forward_pre_hook(pre(n)) for n in dict.fromkeys(readers)]
    try:
        with torch.no_grad(), no_fastpath(), float64_internals():
            torch.func.functional_call(p.model, {**p.params, **p.buffers}, p.args, p.kwargs)
    finally:
        for hk in hooks:
            hk.remove()
    out = []
    for n in dict.fromkeys(readers):
        call, new = p.first_call(n), seen.get(n)
        x = call.args[0] if call is not None and call.args else None
        if not (isinstance(x, torch.Tensor) and new is not None and new.shape == x.shape
                and x.shape[-1:] == t.shape):
            continue
        want = moved(x)
        if bool((new - want).abs().max() <= 1e-10 * (float(want.abs().max()) + 1e-300)):
            out.append(n)
    return out


def pooled_readers(p: Prober, norm: str, d: int, *, linear: bool = False,
                   ) -> tuple[list[Consumer], list[str]]:
    """The linear maps of input width `d` called after `norm` that read its output through a
    map commuting with a shift along the features (with `linear`: with every linear map of
    them) ([`shift_readers`][quotient_manifolds.models.paths.shift_readers]: a mean pooling
    before a classifier head), as [`Consumer`][quotient_manifolds.models.linear.Consumer]s, and
    their modules. For a norm that no linear map reads directly."""
    later, started = [], False
    for c in p.calls:
        started = started or c.name == norm
        lin = linear_layer(p.modules[c.name])
        if started and lin is not None and lin.in_features == d and c.name not in later:
            later.append(c.name)
    mods = shift_readers(p, norm, later, linear=linear) if later else []
    cons = []
    for n in mods:
        lin = linear_layer(p.modules[n])
        assert lin is not None
        cons.append(Consumer(p.name(lin.weight), 0 if lin.transposed else 1, 0, -1,
                             p.pname(lin.bias)))
    return cons, mods
