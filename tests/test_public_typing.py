"""The public API is fully annotated: every function and method named in a module's `__all__`
has a type for each parameter and for its return (mypy checks the types themselves:
`make typecheck`)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterator

import quotient_manifolds as qm


def _public() -> Iterator[tuple[str, Callable]]:
    mods = [qm] + [importlib.import_module(m.name)
                   for m in pkgutil.walk_packages(qm.__path__, "quotient_manifolds.")
                   if not m.name.endswith("__main__") and "._" not in m.name]
    seen: set[int] = set()
    for mod in mods:
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name, None)
            if obj is None or id(obj) in seen:
                continue
            seen.add(id(obj))
            if inspect.isfunction(obj) and obj.__module__.startswith("quotient_manifolds"):
                yield f"{obj.__module__}.{obj.__qualname__}", obj
            elif inspect.isclass(obj) and obj.__module__.startswith("quotient_manifolds"):
                for k, v in vars(obj).items():
                    if k.startswith("_") and k != "__init__":
                        continue
                    f = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
                    if inspect.isfunction(f) and f.__module__.startswith("quotient_manifolds"):
                        yield f"{obj.__module__}.{obj.__qualname__}.{k}", f


def _missing(f: Callable) -> list[str]:
    sig = inspect.signature(f)
    out = [p.name for p in sig.parameters.values()
           if p.annotation is inspect.Parameter.empty and p.name not in ("self", "cls")]
    if sig.return_annotation is inspect.Signature.empty and f.__name__ != "__init__":
        out.append("return")
    return out


def test_public_functions_are_fully_annotated():
    found = dict(_public())
    assert len(found) > 200  # the walk sees the library
    bad = {name: _missing(f) for name, f in found.items() if _missing(f)}
    assert bad == {}, bad
