r"""Discovery once: a small cache of [`Symmetries`][quotient_manifolds.models.Symmetries] for
repeated measures of one model.

[`discover`][quotient_manifolds.models.discover] runs float64 probes of every claim (seconds
on a small transformer); a sweep over radii, measures or solvers of one model would repeat it
on every call. Every sharpness call that discovers (no `symmetries=`, no `blocks=`) asks
[`discovery_cache`][quotient_manifolds.models.cache.discovery_cache] first.

**The key.** A hit returns what a fresh discovery would return, so the key holds everything
the result depends on:

* the model object (a weak reference: the cache never keeps a model alive), every module's
  name, class and `training` flag, and every attribute of every module that is not a
  parameter, buffer or submodule: numbers, strings, dtypes by value; a configuration with
  `to_dict()` (Hugging Face) by its contents; a function by its code, defaults and closure;
  hooks in order (a Hugging Face `problem_type` still unset counts as the value the
  classifier sets it to at its first forward with the example `labels`); any other object by
  identity (weakly; an object that cannot be weakly
  referenced makes the call uncacheable, and it then discovers as before);
* every parameter and buffer: its name, the tying pattern, shape, dtype, device,
  `requires_grad`, its version counter (bumped by every in-place write through the tensor,
  however small, e.g. an optimizer step) and a fingerprint of its values, the float64 sums of
  $w$, $w^2$ and $\sum_i c_i w_i$ with distinct weights $c_i$ (a write through `.data`,
  which bumps no version counter, and a permutation of the entries both change it);
* discovery's options: `symmetry`, `declared`, `probe`, `families` and the example inputs the
  probes run on (structure and values), and what discovery reads from the registries: the
  families of `FAMILIES` (when `families` is not given), the attention layouts, the
  linear-layer readers and the input builders, and torch's default dtype;
* for `symmetry="complete"` (or any custom `families`), the loss and the example batch, since
  the softmax shift is claimed only when `loss_fn(model, batch)` is unchanged by it: the loss
  by its code, defaults and closure (a bound method by its function and its object), the batch
  by structure and values.

**After a weight change** the call misses and discovers afresh: whether a probe passes (output
change $\le 10^{-10}$, a non-symmetric control $\ge 10^{-3}$) is a property of the weights, not
only of the structure, so no verdict is provably the same at new weights. What discovery
returns holds no weights (folds compute the canonical point from the weights they are given),
so the cached object is small.

**Not seen by the key**: a change to a class (a method patched on the class), to a global
variable the loss or the model reads (or a constant of the library, such as the probes'
tolerances), or to an object the loss or a module holds and reads (matched by identity, not
contents). After such a change, call `discovery_cache.clear()`.

Sharded parameters (`DTensor`, FSDP2) are not cached: a rank-local fingerprint could let the
ranks disagree on a hit, and one rank would then probe alone.

Every discovery logs ``discovered ... in X s`` and every hit ``cache hit ...`` at level
`INFO` on the logger `quotient_manifolds.discovery` (the records carry `seconds` and
`cpu_seconds`, wall and process time, look-up included). The warnings of a discovery (fallbacks,
unprobed claims) are kept with the result and emitted again on each hit, as a fresh discovery
would.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import discovery as _discovery
from . import inputs as _inputs
from . import linear as _linear
from .blocks import BlockSpec
from .families import attention_layouts as _layouts
from .records import Symmetries
from .symmetry import SymmetryFamily

__all__ = ["DiscoveryCache", "discovery_cache", "weights_fingerprint"]

log = logging.getLogger("quotient_manifolds.discovery")

_CHUNK = 1 << 20
_PHI = 0.6180339887498949
_SIMPLE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
           torch.Size, type, types.BuiltinFunctionType)
_MODULE_SKIP = frozenset({"_parameters", "_buffers", "_modules"})


class _Uncacheable(Exception):
    """Something the key cannot capture: the call discovers without the cache."""


_WEYL: dict[torch.device, torch.Tensor] = {}


def _weyl(device: torch.device) -> torch.Tensor:
    """The distinct weights $c_j = \\{(j + 1)\\varphi\\} \\in (0, 1)$ of one chunk, float64 on
    `device` (made once per device: 8 MiB)."""
    c = _WEYL.get(device)
    if c is None:
        j = torch.arange(1, _CHUNK + 1, dtype=torch.float64, device=device)
        c = _WEYL[device] = torch.frac(j * _PHI)
    return c


def weights_fingerprint(t: torch.Tensor) -> tuple[float, float, float]:
    r"""The float64 sums $\sum_i w_i$, $\sum_i w_i^2$ and $\sum_i c_i w_i$ of a tensor (of its
    real view if complex), $c_{kC + j} = k + \{(j + 1)\varphi\}$ distinct for every index
    (chunks of $C = 2^{20}$ entries, so the temporary memory is bounded): a write changes it
    unless it keeps all three sums, which a permutation of unequal entries does not.

    Computed on the tensor's device; only three numbers are moved to the host."""
    if t.is_meta or t.numel() == 0:
        return (0.0, 0.0, 0.0)
    with torch.no_grad():
        d = t.detach()
        d = torch.view_as_real(d) if d.is_complex() else d
        d = d.reshape(-1)
        n = d.numel()
        c = _weyl(d.device)
        s = torch.zeros((), dtype=torch.float64, device=d.device)
        q, w = s.clone(), s.clone()
        for k, start in enumerate(range(0, n, _CHUNK)):
            x = d[start:start + _CHUNK].double()
            sx = x.sum()
            s += sx
            q += x.square().sum()
            w += x @ c[:x.numel()] + k * sx
        out = torch.stack([s, q, w]).tolist()
        return (out[0], out[1], out[2])


class _Ident:
    """An object matched by identity through a weak reference (keeps nothing alive)."""

    __slots__ = ("ref", "oid", "__weakref__")

    def __init__(self, obj: Any) -> None:
        try:
            self.ref = weakref.ref(obj)
        except TypeError:
            raise _Uncacheable(f"a {type(obj).__name__} cannot be weakly referenced") from None
        self.oid = id(obj)

    def __hash__(self) -> int:
        return self.oid

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Ident):
            return NotImplemented
        a = self.ref()
        return a is not None and a is other.ref()


class _Keyer:
    """Builds the key of one call (memoised by object id while building, so a configuration
    shared by every layer is read once)."""

    def __init__(self, labels: torch.Tensor | None = None) -> None:
        self.labels = labels
        self.memo: dict[int, Any] = {}
        self.keep: list[Any] = []  # objects of the memo stay alive while building

    def value(self, v: Any, depth: int = 0) -> Any:
        if isinstance(v, _SIMPLE):
            return (type(v).__name__, v)
        if depth > 6:
            raise _Uncacheable("a nested value too deep to key")
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if isinstance(v, (tuple, list)):
            return (type(v).__name__, tuple(self.value(x, depth + 1) for x in v))
        if isinstance(v, (set, frozenset)):
            items = [self.value(x, depth + 1) for x in v]
            return (type(v).__name__, tuple(sorted(items, key=repr)))
        if isinstance(v, dict):
            return ("dict", tuple((self.value(k, depth + 1), self.value(x, depth + 1))
                                  for k, x in v.items()))
        if id(v) in self.memo:
            return self.memo[id(v)]
        self.keep.append(v)
        if isinstance(v, nn.Module):
            out: Any = ("module", _Ident(v))
        elif isinstance(v, types.MethodType):
            out = ("method", self.value(v.__func__, depth + 1), _Ident(v.__self__))
        elif isinstance(v, types.FunctionType):
            cells = tuple(self.value(c.cell_contents, depth + 1) if _filled(c) else ("empty",)
                          for c in v.__closure__ or ())
            out = ("function", v.__code__, self.value(v.__defaults__, depth + 1),
                   self.value(v.__kwdefaults__, depth + 1), cells)
        elif hasattr(v, "to_dict") and hasattr(v, "to_json_string"):  # a model configuration
            d = v.to_dict()
            if "problem_type" in d and d["problem_type"] is None and self.labels is not None:
                d["problem_type"] = _problem_type(getattr(v, "num_labels", 0), self.labels)
            out = ("config", type(v), json.dumps(d, sort_keys=True, default=repr))
        else:
            out = ("object", type(v), _Ident(v))
        self.memo[id(v)] = out
        return out

    def tensor(self, t: torch.Tensor, version: bool = False) -> tuple:
        if type(t).__name__ == "DTensor" or hasattr(t, "device_mesh"):
            raise _Uncacheable("sharded (DTensor) parameters")
        return (tuple(t.shape), t.dtype, t.device.type, t.device.index, t.requires_grad,
                t._version if version else None, weights_fingerprint(t))

    def model(self, model: nn.Module) -> tuple:
        mods: list[tuple] = []
        tensors: list[tuple] = []
        first: dict[int, str] = {}
        for name, m in model.named_modules(remove_duplicate=False):
            attrs = tuple((k, self.value(v)) for k, v in vars(m).items() if k not in _MODULE_SKIP)
            mods.append((name, type(m), attrs))
            for kind, table in (("p", m._parameters), ("b", m._buffers)):
                for pn, t in table.items():
                    full = f"{name}.{pn}" if name else pn
                    if t is None:
                        tensors.append((kind, full, None))
                    elif id(t) in first:  # tied: the same tensor under another name
                        tensors.append((kind, full, first[id(t)]))
                    else:
                        first[id(t)] = full
                        tensors.append((kind, full, self.tensor(t, version=True)))
        return (_Ident(model), tuple(mods), tuple(tensors))


def _labels(example_inputs: Any) -> torch.Tensor | None:
    """The `labels=` tensor among the example inputs, if any."""
    kwargs = example_inputs[1] if (isinstance(example_inputs, tuple) and len(example_inputs) == 2
                                   and isinstance(example_inputs[1], dict)) else example_inputs
    t = kwargs.get("labels") if isinstance(kwargs, dict) else None
    return t if isinstance(t, torch.Tensor) else None


def _problem_type(num_labels: int, labels: torch.Tensor) -> str:
    """What a Hugging Face classifier sets `config.problem_type` to at its first forward with
    `labels` (so that the key does not change when it does)."""
    if num_labels == 1:
        return "regression"
    if num_labels > 1 and labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


@dataclass
class _Entry:
    ref: weakref.ref
    symmetries: Symmetries
    warnings: list[warnings.WarningMessage]


class DiscoveryCache:
    """A bounded cache of discovery results (see the module docstring for the key).

    Parameters
    ----------
    maxsize : int
        Results kept (least recently used dropped first); 0 disables the cache.

    Attributes
    ----------
    enabled : bool
        `False`: every call discovers afresh (and nothing is stored).
    hits, misses : int
        Calls answered from the cache, and calls that discovered (uncacheable ones included).
    """

    def __init__(self, maxsize: int = 8) -> None:
        self.maxsize = maxsize
        self.enabled = True
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every result (the counters too)."""
        self._entries.clear()
        self.hits = self.misses = 0

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Within the block, every call discovers afresh."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    def key(self, model: nn.Module, *, symmetry: str = "full", declared: Iterable[BlockSpec] = (),
            probe: bool = True, example_inputs: Any = None,
            families: Sequence[SymmetryFamily] | None = None,
            loss_fn: Callable[[nn.Module, Any], Any] | None = None, batch: Any = None
            ) -> tuple | None:
        """The key of a call of [`discover`][quotient_manifolds.models.discover] with these
        arguments, or `None` when the call cannot be cached (the reason is logged at
        `DEBUG`)."""
        k = _Keyer(_labels(example_inputs))
        try:
            loss_used = symmetry == "complete" or families is not None
            fams = _discovery.FAMILIES if families is None else families  # as discover reads
            return (symmetry, probe, k.value(tuple(declared)),
                    tuple((_Ident(f), f.kind, tuple(f.symmetries)) for f in fams),
                    tuple(k.value(r) for r in (*_linear.READERS, *_inputs.INPUT_BUILDERS,
                                               *_layouts.LAYOUTS)),
                    torch.get_default_dtype(), k.value(example_inputs),
                    (k.value(loss_fn), k.value(batch)) if loss_used else None,
                    k.model(model))
        except _Uncacheable as e:
            log.debug("discovery of %s not cached: %s", type(model).__name__, e)
            return None

    def discover(self, model: nn.Module, *, symmetry: str = "full",
                 declared: Iterable[BlockSpec] = (), warn: bool = True, probe: bool = True,
                 example_inputs: Any = None, families: Sequence[SymmetryFamily] | None = None,
                 loss_fn: Callable[[nn.Module, Any], Any] | None = None, batch: Any = None
                 ) -> Symmetries:
        """[`discover`][quotient_manifolds.models.discover] with the same arguments, answered
        from the cache when an equal call on this model at these weights was made."""
        declared = tuple(declared)
        opts = dict(symmetry=symmetry, declared=declared, probe=probe,
                    example_inputs=example_inputs, families=families, loss_fn=loss_fn,
                    batch=batch)
        t0, c0 = time.perf_counter(), time.process_time()
        key = self.key(model, **opts) if self.enabled and self.maxsize > 0 else None
        t_key = time.perf_counter() - t0
        what = f"the {symmetry!r} symmetries of {type(model).__name__}"
        entry = None if key is None else self._entries.get(key)
        if key is not None and entry is not None and entry.ref() is model:
            self._entries.move_to_end(key)
            self.hits += 1
            log.info("cache hit: %s (key in %.2f s; discovery skipped)", what, t_key,
                     extra={"seconds": t_key, "cpu_seconds": time.process_time() - c0})
            if warn:
                _replay(entry.warnings)
            return entry.symmetries
        self.misses += 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sym = _discovery.discover(model, warn=True, **opts)
        dt = time.perf_counter() - t0
        log.info("discovered %s in %.2f s (%d blocks, %d folds)%s", what, dt, len(sym.blocks),
                 len(sym.folds), "" if key is not None else "; not cached",
                 extra={"seconds": dt, "cpu_seconds": time.process_time() - c0})
        if key is not None:
            self._store(key, model, _Entry(weakref.ref(model), sym, list(caught)))
        if warn:
            _replay(caught)
        return sym

    def _store(self, key: tuple, model: nn.Module, entry: _Entry) -> None:
        entries = self._entries

        def drop(_: weakref.ref, key: tuple = key) -> None:  # the model was collected
            if key in entries and entries[key].ref() is None:
                del entries[key]

        entry.ref = weakref.ref(model, drop)
        entries[key] = entry
        entries.move_to_end(key)
        while len(entries) > self.maxsize:
            entries.popitem(last=False)


def _replay(caught: Iterable[warnings.WarningMessage]) -> None:
    """Emit the recorded warnings again, from where they were first emitted (file, line and
    module, so that the warning filters treat them as they treated the originals)."""
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno,
                               module=_module_of(w.filename), registry=_REGISTRY)


@functools.lru_cache(maxsize=64)
def _module_of(filename: str) -> str | None:
    for name, mod in list(sys.modules.items()):
        if getattr(mod, "__file__", None) == filename:
            return name
    return None


_REGISTRY: dict = {}

discovery_cache = DiscoveryCache()
"""The cache every sharpness call asks before discovering: `discovery_cache.clear()` forgets
everything, `discovery_cache.enabled = False` (or `with discovery_cache.disabled():`) turns it
off, `discovery_cache.maxsize` bounds it."""
