r"""Random GL reparametrisation of a model (paper §6.2, spec §11.3, §12.6).

Every discovered block is moved along its orbit by ``A = a·G̃`` per head,
``G̃_ij ~ N(0, 1)``: ``(G, H) ↦ (G A⁻¹, H Aᵀ)``, written back into the weights
and their bias rows.  The function ``G Hᵀ`` of each head, hence the model's
outputs, is unchanged (up to rounding).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from ..geometry.linalg import transpose
from .blocks import BlockSpec, gather_block, scatter_block
from .discovery import discover

__all__ = ["reparametrize"]


def reparametrize(
    model: nn.Module,
    scale: float,
    seed: int = 0,
    *,
    blocks: Sequence[BlockSpec] | None = None,
) -> nn.Module:
    r"""A deep copy of ``model`` with every GL block moved by ``A = scale·G̃`` per head.

    Parameters
    ----------
    model : nn.Module
        Not modified.
    scale : float
        ``a`` in ``A = a·G̃`` (the paper sweeps ``a ∈ [10⁻², 10²]``).
    seed : int
        Seed of the Gaussian ``G̃`` (one ``h×h`` matrix per head, drawn in block order).
    blocks : sequence of BlockSpec, optional
        Blocks to transform; default: :func:`discover_blocks` of the copy (without warnings).

    Returns
    -------
    nn.Module
        The reparametrised copy.  The algebra runs in float64 and is cast back
        to each parameter's dtype.
    """
    new = copy.deepcopy(model)
    params = dict(new.named_parameters())
    if blocks is None:
        blocks = list(discover(new, symmetry="paper", warn=False, probe=False).blocks)
    else:
        blocks = [b.resolved(params) for b in blocks]
    gen = torch.Generator().manual_seed(int(seed))
    cur = {n: p.detach() for n, p in params.items()}
    for b in blocks:
        x = gather_block(b, cur).to(torch.float64)
        A = scale * torch.randn(b.heads, b.h, b.h, generator=gen, dtype=torch.float64).to(x.device)
        G, H = x[:, : b.n], x[:, b.n :]
        G2 = transpose(torch.linalg.solve(transpose(A), transpose(G)))  # G A⁻¹
        H2 = H @ transpose(A)  # H Aᵀ
        scatter_block(b, torch.cat([G2, H2], dim=-2), cur)
    with torch.no_grad():
        for n, p in params.items():
            if cur[n] is not p:
                p.copy_(cur[n])
    return new
