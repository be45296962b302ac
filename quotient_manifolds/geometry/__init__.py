"""Pure tensor math of the quotient geometries (no Manifold classes here)."""

from . import adaptive, diagonal, gl, linalg, ode, subgroup

__all__ = ["adaptive", "diagonal", "gl", "linalg", "ode", "subgroup"]
