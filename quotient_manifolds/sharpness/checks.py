"""Checks of the arguments shared by every sharpness driver and feasible set."""

from __future__ import annotations

import math

from ..errors import InvalidRadiusError

__all__ = ["check_rho"]


def check_rho(rho: float, name: str = "rho") -> float:
    r"""`rho` as a float, or [`InvalidRadiusError`][quotient_manifolds.errors.InvalidRadiusError]
    unless it is a positive finite number.

    Parameters
    ----------
    rho : float
        The radius $\rho$ of the perturbation ball $\|\xi\| \le \rho$.
    name : str
        The argument's name in the message (`"rho"`, `"radius"`).
    """
    try:
        r = float(rho)
    except (TypeError, ValueError):
        r = float("nan")
    if not (r > 0 and math.isfinite(r)):
        raise InvalidRadiusError(
            f"{name} must be a positive finite number, got {rho!r}; pass e.g. {name}=0.1 "
            "(the radius of the perturbation ball ‖ξ‖ ≤ ρ)"
        )
    return r
