r"""Pure tensor kernels for the elementwise "adaptive" geometry.

Each weight ``w`` carries the one-dimensional metric ``ξ² / (w² + ε)``: the
GL(1) re-scaling metric that adaptive sharpness uses (App. F; App. C.1 applies it to every
weight outside a GL block).  With
``ε = 0``, ``‖ξ‖ = ‖ξ ⊘ |w|‖₂`` and the geodesic is $w e^{ξ/w}$.
"""

from __future__ import annotations

import math

import torch

__all__ = ["scale2", "egrad2rgrad", "christoffel", "geodesic"]


def scale2(w: torch.Tensor, eps: float) -> torch.Tensor:
    """``c² = w² + ε``, the inverse metric coefficient of every weight."""
    return w**2 + eps if eps else w**2


def egrad2rgrad(w: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """``(w² + ε) ⊙ ∇L`` (Alg. 1 line 12)."""
    return scale2(w, eps) * g


def christoffel(w: torch.Tensor, u: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    r"""``Γ(u, v) = −w u v / (w² + ε)`` (so $Γ^i_{ii} = -1/w_i$ at ``ε = 0``)."""
    return -w * u * v / scale2(w, eps)


def geodesic(w: torch.Tensor, u: torch.Tensor, eps: float, t: float = 1.0) -> torch.Tensor:
    r"""Exact geodesic of ``ξ²/(w² + ε)``.

    ``ε = 0``: $w e^{tξ/w}$.  ``ε > 0``: in the arc-length coordinate
    ``s = asinh(w/√ε)`` the metric is flat, so
    ``γ(t) = √ε sinh(asinh(w/√ε) + tξ/√(w² + ε))``.
    """
    if not eps:
        return w * torch.exp(t * u / w)
    r = math.sqrt(eps)
    return r * torch.sinh(torch.asinh(w / r) + t * u / torch.sqrt(w**2 + eps))
