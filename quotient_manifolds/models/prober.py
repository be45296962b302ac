r"""The prober: a float64 traced copy of a model, and the function-preservation probes.

Discovery recognises symmetries by structure; a structure can look right and still be wrong
(channel attention, an unexpected fused layout, a norm the recogniser did not see). Every claim
is therefore checked numerically before it is used, by one
[`Prober`][quotient_manifolds.models.prober.Prober] per discovery:

1. a float64 deep copy of the model, without the user's hooks, is run once on an example input
   (the first [`PROBE_ROWS`][quotient_manifolds.models.prober.PROBE_ROWS] rows of the user's,
   or one built by [`example_inputs`][quotient_manifolds.models.inputs.example_inputs]); forward
   hooks record every module call `(args, kwargs, output)` and the outputs are kept as the
   reference;
2. **the function changed** means one thing everywhere
   ([`relative_change`][quotient_manifolds.models.prober.relative_change]): the largest
   $\max |y' - y| / \max |y|$ over the output tensors, against $10^{-10}$
   ([`PROBE_RTOL`][quotient_manifolds.models.records.PROBE_RTOL]);
3. a **block** (a GL(h) or subgroup factor pair) is probed on the smallest module holding its
   parameters ([`check_block`][quotient_manifolds.models.prober.Prober.check_block]): the weights
   of that module are redrawn at random (HF's $\mathcal N(0, 0.02^2)$ initialisation makes
   attention nearly uniform and would hide a wrong Q/K claim), its hidden-state inputs are
   redrawn as Gaussians, and it is re-run with the redrawn weights, after a random element $A$
   of the claimed group, $(G, H) \mapsto (G A^{-1}, H A^\top)$, and after the one-sided,
   non-symmetric change $G \mapsto G A^{-1}$. The claim passes if the symmetric change moves the
   output by at most the tolerance while the control moves it by at least $10^{-3}$
   ([`PROBE_EXCITATION`][quotient_manifolds.models.records.PROBE_EXCITATION]): the probe must
   demonstrably see the block (if it cannot, the inputs are scaled and the probe repeated);
4. a **fold** (a symmetry with a canonical representative) is probed on the whole copy: a random
   element of its group must leave every output unchanged (to the larger of $10^{-10}$ and 100
   times the copy's rounding noise,
   [`fold_tolerance`][quotient_manifolds.models.prober.Prober.fold_tolerance]). Candidates are
   probed together by
   group testing ([`passing`][quotient_manifolds.models.prober.Prober.passing]): one forward
   pass for all of them, halving only a group that fails.

Nothing here touches the user's model: every probe runs on the float64 copy, through
`torch.func.functional_call`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from ..errors import ExampleInputError
from ..manifolds import Subalgebra
from ..tree import first_tensor, leading_size, tree_leaves, tree_map
from .blocks import BlockSpec
from .inputs import (
    cast_inputs,
    example_inputs,
    float_dtype,
    model_device,
    signature_names,
)
from .loss_probe import LossOf
from .precision import float64_copy, float64_internals, lowest_precision, no_fastpath, run_module
from .probe_inputs import randomise_inputs, redraw_weights, synthesise_inputs
from .records import PROBE_EXCITATION, PROBE_RTOL, ProbeRecord

__all__ = [
    "PROBE_ROWS",
    "ROUNDING_FACTOR",
    "Candidate",
    "Joint",
    "ModuleCall",
    "Prober",
    "random_group_element",
    "relative_change",
    "output_tensors",
    "tolerance",
]

PROBE_ROWS = 2
"""Rows of the example input (along dim 0) on which the model is traced: the forward passes of
the probes are the cost of discovery, and a random group element that is not a symmetry changes
the output of every row."""

_SCALES = (1.0, 8.0, 64.0, 1 / 8, 1 / 64)
_RATIO = 1e-4  # a symmetric change must move the output 10⁴ times less than the control
Params = Mapping[str, torch.Tensor]


class Candidate(Protocol):
    """A claimed symmetry that knows how to act: a block spec or a fold."""

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        """`params` moved by a random element of the candidate's group (out of place)."""
        ...


class ModuleCall(NamedTuple):
    """One call of a module in the traced forward pass."""

    name: str
    args: tuple
    kwargs: dict
    out: Any


def output_tensors(out: Any) -> list[torch.Tensor]:
    """The floating-point output tensors of a forward pass, key/value caches skipped (not
    detached)."""
    return [t for t in tree_leaves(out, skip_key=lambda k: not _is_output(k))
            if t.is_floating_point()]


def _is_output(key: Any) -> bool:
    """Whether a mapping entry of a model's output is an output (not a key/value cache)."""
    return not any(s in str(key) for s in ("past", "cache"))


def _floats(out: Any) -> list[torch.Tensor]:
    """The floating-point output tensors of a forward pass, key/value caches skipped."""
    return [t.detach() for t in output_tensors(out)]


ROUNDING_FACTOR = 100.0
"""How many times its rounding noise the outputs of the copy may change under a fold's random
group element
([`Prober.fold_tolerance`][quotient_manifolds.models.prober.Prober.fold_tolerance])."""


def relative_change(ref: Sequence[torch.Tensor], new: Sequence[torch.Tensor]) -> float:
    r"""How much the function changed: $\max_k \max |y'_k - y_k| / \max |y_k|$ over the output
    tensors $y_k$ (`inf` if their number or shapes differ, or a value is not finite).

    The one definition every probe compares against its tolerance.
    """
    if len(ref) != len(new):
        return math.inf
    worst = 0.0
    for a, b in zip(ref, new, strict=True):
        if a.shape != b.shape:
            return math.inf
        if not a.numel():
            continue
        diff = float((a - b).abs().max())
        if not math.isfinite(diff):
            return math.inf
        worst = max(worst, diff / max(float(a.abs().max()), 1e-300))
    return worst


def random_group_element(
    group: Subalgebra | None,
    heads: int,
    h: int,
    generator: torch.Generator | None = None,
    *,
    scale: float = 0.7,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    r"""Random elements $A = \exp(X)$ of the connected group of `group`, `(heads, h, h)`.

    $X$ has i.i.d. $\mathcal N(0, \mathrm{scale}^2/h)$ entries, projected onto the subalgebra
    when `group` is given (`None`: all of $\mathfrak{gl}(h)$), so $A$ is invertible and
    well conditioned. A subalgebra with its own `random_element(generator, scale=, dtype=,
    batch=)` sampler is asked for the elements instead.
    """
    if group is not None and hasattr(group, "random_element"):
        try:  # the subalgebra's own sampler, where it has one
            return group.random_element(generator, scale=scale, dtype=dtype, batch=(heads,))
        except (NotImplementedError, TypeError):
            pass
    X = torch.randn(heads, h, h, generator=generator, dtype=dtype) * (scale / math.sqrt(h))
    if group is not None:
        X = group.project(X)
    return torch.linalg.matrix_exp(X)


# -- the module a block is probed on ---------------------------------------------------------
def _common_module(names: Iterable[str]) -> str:
    paths = [n.split(".")[:-1] for n in names]
    out = []
    for parts in zip(*paths):
        if all(p == parts[0] for p in parts):
            out.append(parts[0])
        else:
            break
    return ".".join(out)


def _probe_module(block: BlockSpec, lookup: Mapping[str, nn.Module]) -> str:
    """The smallest module that holds every parameter of the block (and its `module`), one
    level up if that module owns them all directly (a fused projection alone cannot show a
    symmetry between its rows)."""
    names = list(block.params)
    if block.module in lookup and block.module:
        names.append(block.module + ".*")
    prefix = _common_module(names)
    mod = lookup.get(prefix)
    own = {n for n, _ in mod.named_parameters(recurse=False)} if mod is not None else set()
    cut = len(prefix) + 1 if prefix else 0
    if prefix and all(p[cut:] in own for p in block.params):
        prefix = prefix.rsplit(".", 1)[0] if "." in prefix else ""
    return prefix


def _local(prefix: str, params: Params, names: Iterable[str]) -> dict:
    cut = len(prefix) + 1 if prefix else 0
    return {n[cut:]: params[n] for n in names}


def _first_float(out: Any) -> torch.Tensor:
    t = first_tensor(out, lambda t: t.is_floating_point())
    if t is None:
        raise TypeError("the module returned no floating-point tensor")
    return t


def tolerance(module: nn.Module, params: Params, args: tuple, kwargs: dict) -> float:
    r"""`PROBE_RTOL` for a module that computes in float64 throughout, else $100\,\epsilon$ of the
    lowest precision it uses (some models run their rotary embedding in float32 even in a
    float64 model)."""
    eps = lowest_precision(lambda: run_module(module, params, args, kwargs))
    if eps <= float(torch.finfo(torch.float64).eps):
        return PROBE_RTOL
    return max(PROBE_RTOL, 100.0 * eps)


def _float32_calls(model: nn.Module, args: tuple, kwargs: dict) -> list[ModuleCall]:
    """The module calls of a float32 run, cast to float64, for the block probes of a model
    that cannot run in float64 as a whole (e.g. grouped expert matmuls)."""
    try:
        cap = float64_copy(model).to(torch.float32)
        dt, dev = float_dtype(cap), model_device(cap)
        a32, kw32 = cast_inputs((args, kwargs), dt, dev)
        calls: list[ModuleCall] = []
        hooks = [m.register_forward_hook(
            lambda mod, a, kw, out, name=name: calls.append(ModuleCall(name, a, kw, None)),
            with_kwargs=True) for name, m in cap.named_modules()]
        try:
            with torch.no_grad(), no_fastpath():
                cap(*a32, **kw32)
        finally:
            for hk in hooks:
                hk.remove()
    except Exception:  # noqa: BLE001 -- the model does not run on this input at all
        return []

    def wide(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float64) if t.is_floating_point() else t

    return [ModuleCall(c.name, tree_map(wide, tuple(c.args)), tree_map(wide, dict(c.kwargs)),
                       None) for c in calls]


class Prober:
    """A float64 copy of a model, one traced forward pass, and function-preservation probes.

    Parameters
    ----------
    model : nn.Module
        Only read: it is deep-copied to float64 (without the user's hooks).
    inputs : optional
        An input of the model: `(args, kwargs)`, a dict of keyword arguments, a tuple of
        positional arguments or a tensor. Default: built by
        [`example_inputs`][quotient_manifolds.models.inputs.example_inputs].
    seed : int
        Seed of the redrawn weights and inputs and of the group elements.

    Attributes
    ----------
    model : nn.Module
        The float64 copy.
    params, buffers : dict
        Its parameters and buffers, detached.
    calls : list of ModuleCall
        Every module call of the traced forward pass, in order.
    reference : list of Tensor or None
        The floating outputs of the traced forward pass (`None` if the whole model cannot be
        run in float64).
    problem : str or None
        Why the whole model cannot be probed (no input, the model fails on it, a non-finite
        output), said so that a fold family can record it; `None` if it can.
    """

    def __init__(self, model: nn.Module, inputs: Any = None, *, seed: int = 0,
                 loss: tuple[Callable, Any] | None = None) -> None:
        self.model = float64_copy(model)
        self.loss = LossOf(self.model, *loss) if loss is not None else None
        self.gen = torch.Generator().manual_seed(seed)
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        self.users: dict[int, int] = {}
        for _, m in self.model.named_modules(remove_duplicate=False):
            for p in m.parameters(recurse=False):
                self.users[id(p)] = self.users.get(id(p), 0) + 1
        self.params = {n: p.detach() for n, p in self.model.named_parameters()}
        self.buffers = {n: b.detach() for n, b in self.model.named_buffers()}
        self.modules = dict(self.model.named_modules())
        self.calls: list[ModuleCall] = []
        self.reference: list[torch.Tensor] | None = None
        self._fold_tolerance: float | None = None
        self.problem: str | None = None
        self.args: tuple = ()
        self.kwargs: dict = {}
        if inputs is None:
            try:
                inputs = example_inputs(self.model, torch.Generator().manual_seed(seed))
            except ExampleInputError:
                self.problem = ("no example input is known for this model, so norm gains and "
                                "bias translations cannot be probed and are not removed; pass "
                                "example_inputs=(args, kwargs)")
                return
        args, kwargs = cast_inputs(inputs, torch.float64, model_device(self.model))
        if "use_cache" in signature_names(self.model.forward):
            kwargs.setdefault("use_cache", False)
        try:
            self._trace_rows(args, kwargs)
        except Exception as e:  # noqa: BLE001 -- any failure of the user's forward pass
            self.problem = (f"the model failed on the example input ({type(e).__name__}: {e}), "
                            "so no fold can be probed; pass example_inputs= with an input the "
                            "model accepts")
            self.calls = _float32_calls(model, args, kwargs)
            return
        if not self.reference or not all(bool(torch.isfinite(t).all()) for t in self.reference):
            self.problem = ("the model's output on the example input has no floating-point "
                            "tensor, or a non-finite one, so no probe can confirm a fold; pass "
                            "example_inputs= with an input that gives finite outputs")

    # -- names -------------------------------------------------------------------------------
    def pname(self, p: torch.Tensor | None) -> str | None:
        """The name of `p` in the copy (`None` for `None` or a tensor that is no parameter)."""
        return None if p is None else self.names.get(id(p))

    def name(self, p: torch.Tensor) -> str:
        """The name of `p`, a parameter of the copy (`KeyError` if it is none, e.g. the tensor
        that a parametrisation computes)."""
        n = self.names.get(id(p))
        if n is None:
            raise KeyError(f"a tensor of shape {tuple(p.shape)} is not a parameter of the model")
        return n

    def tied(self, name: str) -> bool:
        """Whether the parameter is used by more than one module (tied weights)."""
        p = dict(self.model.named_parameters())[name]
        return self.users.get(id(p), 0) > 1

    def parameterised_calls(self) -> list[tuple[str, nn.Module, tuple, dict]]:
        """`(name, module, args, kwargs)` of every traced call of a module with parameters of
        its own (what the linear readers are asked about)."""
        return [(c.name, self.modules[c.name], c.args, c.kwargs) for c in self.calls
                if any(True for _ in self.modules[c.name].parameters(recurse=False))]

    def first_call(self, module: str) -> ModuleCall | None:
        """The first call of `module` in the traced forward pass."""
        return next((c for c in self.calls if c.name == module), None)

    # -- tracing ------------------------------------------------------------------------------
    def _trace(self, args: tuple, kwargs: dict) -> None:
        calls: list[ModuleCall] = []

        def hook(name):
            def f(mod, a, kw, out):
                calls.append(ModuleCall(name, tuple(a), dict(kw), out))
            return f

        hooks = [m.register_forward_hook(hook(name), with_kwargs=True)
                 for name, m in self.modules.items()]
        try:
            with torch.no_grad(), no_fastpath(), float64_internals():
                out = self.model(*args, **kwargs)
        finally:
            for hk in hooks:
                hk.remove()
        self.args, self.kwargs, self.calls, self.reference = args, kwargs, calls, _floats(out)

    def _trace_rows(self, args: tuple, kwargs: dict) -> None:
        """Trace on the first `PROBE_ROWS` rows, or on the whole input if dim 0 was no batch."""
        batch = leading_size((args, kwargs))
        if batch is None or batch <= PROBE_ROWS:
            return self._trace(args, kwargs)

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[:PROBE_ROWS] if t.dim() and t.shape[0] == batch else t

        try:
            self._trace(tree_map(cut, args), tree_map(cut, kwargs))
        except Exception:  # noqa: BLE001 -- dim 0 was not a batch dimension: the whole input
            self._trace(args, kwargs)

    # -- whole-model probes (folds) ---------------------------------------------------------------
    @property
    def fold_tolerance(self) -> float:
        r"""The tolerance of the whole-model probes: `PROBE_RTOL`, or
        [`ROUNDING_FACTOR`][quotient_manifolds.models.prober.ROUNDING_FACTOR] times the rounding
        noise of the copy where that is larger.

        The noise is the change of the outputs (and of the user's loss) when every parameter is
        perturbed by a relative $4\epsilon$ of random sign: a backward-stable forward pass
        computes the exact function at such a perturbation, so no probe can tell a change below
        it from rounding. It is larger than $10^{-12}$ only far along an orbit (a GL element
        of condition number $10^3$, translations a hundred times the weights), where a fixed
        $10^{-10}$ would reject exact symmetries.
        """
        if self._fold_tolerance is None:
            gen = torch.Generator().manual_seed(0)  # not the probes' generator: their draws
            eps = 4 * float(torch.finfo(torch.float64).eps)  # stay those of a fixed tolerance
            moved = {n: t * (1 + eps * (2 * torch.randint(0, 2, t.shape, generator=gen).to(
                t.dtype) - 1)) if t.is_floating_point() else t for n, t in self.params.items()}
            noise = max(self.change(moved), self.loss_change(moved) if self.loss else 0.0)
            self._fold_tolerance = (max(PROBE_RTOL, ROUNDING_FACTOR * noise)
                                    if math.isfinite(noise) else PROBE_RTOL)
        return self._fold_tolerance

    def run(self, params: Params) -> list[torch.Tensor]:
        """The floating outputs of the copy at `params` (buffers: the copy's own)."""
        d = dict(params)
        d.update(self.buffers)
        with torch.no_grad(), no_fastpath(), float64_internals():
            out = torch.func.functional_call(self.model, d, self.args, self.kwargs)
        return _floats(out)

    def change(self, params: Params) -> float:
        """How much the outputs at `params` differ from the traced ones
        ([`relative_change`][quotient_manifolds.models.prober.relative_change])."""
        assert self.reference is not None, "the whole model could not be traced"
        return relative_change(self.reference, self.run(params))

    def loss_change(self, params: Params) -> float:
        """How much the user's loss on the example batch at `params` differs from its value at
        the traced parameters (relative; `inf` without a loss)."""
        if self.loss is None:
            return math.inf
        return self.loss.change({**params, **self.buffers})

    def probe(self, candidate: Candidate, repeats: int = 1) -> float:
        """The largest change under random elements of the candidate's group: of the outputs,
        or of the user's loss for a candidate whose `invariant` is `"loss"` (a symmetry of
        the loss, such as the softmax shift, but not of the outputs)."""
        change = self.loss_change if _invariant(candidate) == "loss" else self.change
        worst = 0.0
        for _ in range(repeats):
            worst = max(worst, change(candidate.act(self.params, self.gen)))
        return worst

    def passing(self, candidates: Sequence[Candidate]) -> list[bool]:
        """Which candidates pass their probe, by group testing.

        All candidates of one invariant (the outputs, or the loss) are probed together (one
        forward pass); only a failing group is halved. Every candidate is a symmetry exactly
        when the joint random element leaves the outputs unchanged (barring a cancellation of
        probability zero).
        """
        out = [False] * len(candidates)
        for kind in ("outputs", "loss"):
            idx = [i for i, c in enumerate(candidates) if _invariant(c) == kind]
            for i, ok in zip(idx, self._passing([candidates[i] for i in idx]), strict=True):
                out[i] = ok
        return out

    def _passing(self, candidates: Sequence[Candidate]) -> list[bool]:
        if not candidates:
            return []
        # the rounding of k composed group elements grows with k
        if self.probe(Joint(candidates)) <= self.fold_tolerance * len(candidates):
            return [True] * len(candidates)
        if len(candidates) == 1:
            return [False]
        k = len(candidates) // 2
        return self._passing(candidates[:k]) + self._passing(candidates[k:])

    def select(self, alternatives: Sequence[Sequence[Candidate]]) -> list[Candidate | None]:
        """For each structure, the first of its alternatives that passes (`None` if none)."""
        chosen: list[Candidate | None] = [None] * len(alternatives)
        pending = [i for i, alt in enumerate(alternatives) if alt]
        r = 0
        while pending:
            ok = self.passing([alternatives[i][r] for i in pending])
            nxt = []
            for i, good in zip(pending, ok, strict=True):
                if good:
                    chosen[i] = alternatives[i][r]
                elif r + 1 < len(alternatives[i]):
                    nxt.append(i)
            pending, r = nxt, r + 1
        return chosen

    # -- module-level probes (blocks) ----------------------------------------------------------
    def check_block(self, block: BlockSpec, input_dims: Mapping[str, int] | None = None
                    ) -> ProbeRecord | None:
        """The function-preservation probe of one resolved block (see the module docstring);
        `None` if its module cannot be run at all: not reached by the traced forward, and no
        input can be synthesised (`input_dims`, `{module path: hidden size}`, allows a random
        `(2, 7, d)` input for the block's module)."""
        prefix = _probe_module(block, self.modules)
        module = self.modules[prefix]
        traced = self.first_call(prefix)
        dims = input_dims or {}
        call = (traced.args, traced.kwargs) if traced is not None else synthesise_inputs(
            module, dims.get(block.module) or dims.get(prefix), self.gen)
        if call is None:
            return None
        try:
            return self._check_block(block, module, prefix, call)
        except Exception as e:  # noqa: BLE001 -- the module rejects the synthesised input
            if traced is None:
                return None
            return ProbeRecord(block.module, block.kind, prefix, math.nan, math.nan, 1.0, False,
                               f"re-running {prefix or '<root>'} failed: {e!r}")

    def _check_block(self, block: BlockSpec, module: nn.Module, prefix: str,
                     call: tuple[tuple, dict]) -> ProbeRecord:
        names = block.params
        # every other weight the probed module reads is redrawn too: whether the probe can
        # excite the block must not depend on where the model sits on its orbit (a value bias
        # translated far by a fold, norm gains scaled by 100, would otherwise hide the Q/K block)
        inside = prefix + "." if prefix else ""
        others = [n for n in self.params if n.startswith(inside) and n not in names
                  and self.params[n].is_floating_point()]
        base = redraw_weights(self.params, [*names, *others], self.gen)
        A = random_group_element(block.group, block.heads, block.h, self.gen)
        sym = block.apply_element(base, A)
        ctrl = block.apply_element(base, A, one_sided=True)
        pa, ps, pc = (_local(prefix, d, [*names, *others]) for d in (base, sym, ctrl))
        args, kwargs = call
        err = ref = math.nan
        scale = _SCALES[0]
        for scale in _SCALES:
            a, kw = randomise_inputs(args, kwargs, scale, self.gen)
            y0 = [_first_float(run_module(module, pa, a, kw))]
            err = relative_change(y0, [_first_float(run_module(module, ps, a, kw))])
            ref = relative_change(y0, [_first_float(run_module(module, pc, a, kw))])
            if ref >= PROBE_EXCITATION:
                break
        tol = PROBE_RTOL if err <= PROBE_RTOL else tolerance(module, pa, a, kw)
        where = prefix or "<root>"
        if not math.isfinite(err) or err > tol:
            reason = (f"a random element of the claimed group changes the output of {where} by "
                      f"{err:.2e} (relative; allowed {tol:.0e}; a non-symmetric change: "
                      f"{ref:.2e})")
            passed = False
        elif ref < PROBE_EXCITATION or err > _RATIO * ref:
            reason = (f"the probe cannot excite the block: a non-symmetric change moves the "
                      f"output of {where} by only {ref:.2e} (the claimed symmetry: {err:.2e})")
            passed = False
        else:
            reason, passed = "", True
        return ProbeRecord(block.module, block.kind, prefix, err, ref, scale, passed, reason, tol)


def _invariant(candidate: object) -> str:
    return getattr(candidate, "invariant", "outputs")


class Joint:
    """Every candidate's random group element, one after the other (for the joint probe)."""

    def __init__(self, candidates: Sequence[Candidate]) -> None:
        self.candidates = tuple(candidates)
        self.invariant = "loss" if any(_invariant(c) == "loss" for c in candidates) else (
            "outputs")

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        for c in self.candidates:
            params = c.act(params, generator, a)
        return dict(params)
