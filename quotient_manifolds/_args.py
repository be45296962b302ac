"""Checks of scalar arguments (counts, real numbers, seeds, flags) shared by the configurations
and solvers.

Each check returns the value in its plain Python type (`int`, `float`, `bool`) or raises
[`ArgumentTypeError`][quotient_manifolds.errors.ArgumentTypeError] (not a number, a bool
where a number is expected, …) or
[`InvalidArgumentError`][quotient_manifolds.errors.InvalidArgumentError] (a number outside the
domain: NaN, Inf, out of range, a float where an integer is expected). Messages name the
argument, the value given and what is accepted.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable

import torch

from .errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["check_int", "check_real", "check_seed", "check_flag", "check_callable",
           "short_repr", "SEED_MAX"]

SEED_MAX = 2**63 - 1
"""The largest seed accepted (a seed is a non-negative signed 64-bit integer)."""


def short_repr(value: object, limit: int = 80) -> str:
    """`repr(value)` on one line, cut to `limit` characters (a tensor's repr can be long)."""
    r = " ".join(repr(value).split())
    return r if len(r) <= limit else r[:limit - 1] + "…"


def _is_bool(value: object) -> bool:
    """Python, numpy and torch booleans (which would otherwise pass as the numbers 0 and 1)."""
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):  # numpy 2 and 1
        return True
    return torch.is_tensor(value) and value.dtype == torch.bool


def _scalar_tensor(value: object) -> bool:
    return torch.is_tensor(value) and value.numel() == 1 and not value.is_complex()


def check_int(name: str, value: object, *, minimum: int = 1, maximum: int | None = None,
              example: int | None = None) -> int:
    """`value` as an `int`: a Python or numpy integer (or a one-element integer tensor) in
    `[minimum, maximum]`. Bools are refused, and so are floats, even integral ones."""
    top = "2**63 - 1" if maximum == SEED_MAX else str(maximum)
    what = f"an integer ≥ {minimum}" if maximum is None else f"an integer in [{minimum}, {top}]"
    hint = f"; pass e.g. {name}={minimum if example is None else example}"
    if _is_bool(value) or not (isinstance(value, numbers.Real) or _scalar_tensor(value)):
        raise ArgumentTypeError(f"{name} must be {what}, got {short_repr(value)} of type "
                                f"{type(value).__name__}{hint}")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:  # a float (or a float tensor): a number, but not an integer
        raise InvalidArgumentError(f"{name} must be {what}, got the non-integer "
                                   f"{short_repr(value)}{hint}") from None
    if n < minimum or (maximum is not None and n > maximum):
        raise InvalidArgumentError(f"{name} must be {what}, got {n!r}{hint}")
    return n


def check_real(name: str, value: object, *, minimum: float | None = None,
               maximum: float | None = None, open_min: bool = False,
               example: float | None = None) -> float:
    """`value` as a finite `float` in `[minimum, maximum]` (`(minimum, maximum]` with
    `open_min`): a Python or numpy real (or a one-element tensor). Bools, strings and `None`
    are refused; so are NaN and ±Inf."""
    bounds = ([] if minimum is None else [("> " if open_min else "≥ ") + f"{minimum:g}"]) + (
        [] if maximum is None else [f"≤ {maximum:g}"])
    what = " ".join(["a finite number", " and ".join(bounds)]).rstrip()
    ex = example if example is not None else (minimum if minimum is not None and not open_min
                                              else 1.0)
    hint = f"; pass e.g. {name}={ex:g}"
    if _is_bool(value) or not (isinstance(value, numbers.Real) or _scalar_tensor(value)):
        raise ArgumentTypeError(f"{name} must be {what}, got {short_repr(value)} of type "
                                f"{type(value).__name__}{hint}")
    try:
        x = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an integer beyond the float range
        x = math.inf
    if (not math.isfinite(x) or (minimum is not None and (x <= minimum if open_min
                                                          else x < minimum))
            or (maximum is not None and x > maximum)):
        raise InvalidArgumentError(f"{name} must be {what}, got {short_repr(value)}{hint}")
    return x


def check_seed(name: str, value: object) -> int | None:
    """`None` (a fresh random seed) or an integer seed in `[0, 2**63 - 1]`."""
    if value is None:
        return None
    return check_int(name, value, minimum=0, maximum=SEED_MAX, example=0)


def check_flag(name: str, value: object) -> bool:
    """`value` as a `bool`: `True` or `False` (numpy bools too)."""
    if not _is_bool(value) or (torch.is_tensor(value) and value.numel() != 1):
        raise ArgumentTypeError(f"{name} must be True or False, got {short_repr(value)} of "
                                f"type {type(value).__name__}")
    return bool(value)


def check_callable(name: str, value: object, what: str) -> Callable:
    """`value` if it is callable; `what` describes the call expected."""
    if not callable(value):
        raise ArgumentTypeError(f"{name} must be a callable {what}, got {short_repr(value)} "
                                f"of type {type(value).__name__}")
    return value
