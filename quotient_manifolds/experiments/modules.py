r"""Small network modules shared by the reproductions (one definition, several populations)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["Attention", "seeded"]


class Attention(nn.Module):
    r"""Multi-head self-attention with explicit per-head projections.

    Per head $i$ (rows $r_i$ of the projections):
    $\operatorname{softmax}(Q_i K_i^\top/\sqrt{d_h})\, V_i$, concatenated and mapped by
    `o_proj`. The `q_proj`/`k_proj`/`v_proj`/`o_proj` + `num_heads`/`head_dim` layout is the
    one [`discovery`][quotient_manifolds.models.discovery] recognises: one Q/K and one V/O
    GL($d_h$) block per head (with `bias=True` the q/k/v biases are appended rows of the
    factors).

    Parameters
    ----------
    d : int
        Model width.
    num_heads : int
        Number of heads; $d_h = d / \text{num\_heads}$.
    bias : bool
        Biases on the four projections.
    """

    def __init__(self, d: int, num_heads: int, *, bias: bool = True) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d // num_heads
        self.q_proj = nn.Linear(d, d, bias=bias)
        self.k_proj = nn.Linear(d, d, bias=bias)
        self.v_proj = nn.Linear(d, d, bias=bias)
        self.o_proj = nn.Linear(d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h, dh = self.num_heads, self.head_dim
        q, k, v = (p(x).view(b, t, h, dh).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh), dim=-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, d))


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Draw from the global generator seeded with `seed`, and restore its state afterwards.

    PyTorch's default initialisers read the global generator; inside this context a model's
    initial weights are a function of `seed` alone, and the caller's random state is left
    as it was (an experiment never changes the global RNG).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        yield
