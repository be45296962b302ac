"""Small batched linear-algebra helpers shared by the geometry kernels."""

from __future__ import annotations

import torch

__all__ = ["GRAM_DTYPE", "compute_dtype", "eye_like", "sym", "transpose"]

# Gram matrices, their factorisations and every h×h solve run in float64 whatever the
# input dtype: they cost O(n h²) per block, negligible next to a forward pass, and a
# float32 Gram matrix of a factor with condition number 1e3 is already near singular.
GRAM_DTYPE = torch.float64


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for elementwise geometry: float64 stays, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def eye_like(x: torch.Tensor) -> torch.Tensor:
    """Identity of size ``x.shape[-1]`` in the dtype and device of ``x``."""
    return torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)


def transpose(x: torch.Tensor) -> torch.Tensor:
    """Swap the last two dimensions."""
    return x.transpose(-1, -2)


def sym(x: torch.Tensor) -> torch.Tensor:
    """Symmetric part ``(X + Xᵀ)/2`` over the last two dimensions."""
    return 0.5 * (x + transpose(x))
