"""Shared generators and reference computations for the geometry tests, and the tiny model
population of the command-line tests."""

from __future__ import annotations

import json
import math
import sys
import textwrap

import torch

import quotient_manifolds as qm
from quotient_manifolds.manifolds.checks import metric_tensor


def conditioned_factor(rows: int, h: int, gen: torch.Generator, batch=(), scale: float = 1.0):
    """Random ``rows × h`` matrices with singular values in [0.3, 3]·scale (well conditioned)."""
    a = torch.randn(*batch, rows, h, generator=gen)
    b = torch.randn(*batch, h, h, generator=gen)
    U, _ = torch.linalg.qr(a)
    V, _ = torch.linalg.qr(b)
    s = torch.exp(torch.empty(*batch, h).uniform_(math.log(0.3), math.log(3.0), generator=gen))
    return scale * (U * s.unsqueeze(-2)) @ V.transpose(-1, -2)


def gl_point(M: qm.GLQuotient, h: int, gen: torch.Generator, batch=(), scale_g=1.0, scale_h=1.0):
    G = conditioned_factor(M.n, h, gen, batch, scale_g)
    H = conditioned_factor(M.m, h, gen, batch, scale_h)
    return torch.cat([G, H], dim=-2)


def diag_point(d: int, gen: torch.Generator, batch=()):
    mag = torch.exp(torch.empty(*batch, 2, d).uniform_(-1.0, 1.0, generator=gen))
    sign = torch.where(torch.rand(*batch, 2, d, generator=gen) < 0.5, -1.0, 1.0)
    return mag * sign


def random_gl_element(h: int, gen: torch.Generator, batch=()):
    """A well-conditioned random element of GL(h) (with random sign of det)."""
    return conditioned_factor(h, h, gen, batch)


def vertical_basis(M, x: torch.Tensor, k: int) -> torch.Tensor:
    """Columns spanning the vertical space at one point, via ``M.vertical`` on a basis."""
    shape = _omega_shape(M, x)
    return torch.stack([M.vertical(x, e.reshape(shape)).reshape(-1) for e in torch.eye(k)], dim=1)


def _omega_shape(M, x):
    if isinstance(M, qm.GLQuotient):
        return (x.shape[-1], x.shape[-1])
    return (x.shape[-1],)


def reference_projection(M, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Metric-orthogonal projection onto the complement of the vertical space, by dense algebra.

    Independent of the manifold's closed forms: it uses only ``inner`` (through the
    metric tensor) and ``vertical``.
    """
    k = x.shape[-1] ** 2 if isinstance(M, qm.GLQuotient) else x.shape[-1]
    V = vertical_basis(M, x, k)
    g = metric_tensor(M, x)
    coeff = torch.linalg.lstsq(V.T @ g @ V, V.T @ g @ u.reshape(-1, 1)).solution
    return (u.reshape(-1, 1) - V @ coeff).reshape(u.shape)


# -- the population of the command-line tests ------------------------------------------------
POP_FACTORY = textwrap.dedent(
    """
    import os, time
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self, d=8, heads=2, classes=3):
            super().__init__()
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.head = nn.Linear(d, classes)

        def forward(self, x):
            return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))

    def make_model():
        torch.manual_seed(0)
        return Tiny()

    def make_data():
        if os.environ.get("POP_PIDS"):  # the kill test needs each rank's process id
            path = os.path.join(os.environ["POP_PIDS"], "pid" + os.environ.get("RANK", "0"))
            with open(path, "w") as f:
                f.write(str(os.getpid()))
        if os.environ.get("POP_SLOW"):
            time.sleep(float(os.environ["POP_SLOW"]))
        g = torch.Generator().manual_seed(1)
        return [(torch.randn(4, 3, 8, generator=g), torch.randint(0, 3, (4,), generator=g))
                for _ in range(2)]

    def other_model():
        return nn.Linear(8, 3)

    def mse_loss(model, batch):
        x, y = batch
        return ((model(x) - nn.functional.one_hot(y, 3).to(x.dtype)) ** 2).mean()
    """
)
"""The factory module `popmod` of the command-line tests: a tiny attention classifier
(`make_model`), its data (`make_data`; `POP_SLOW` delays it, `POP_PIDS` records the process
id), a second model and a second loss."""


def population_states(folder, n: int) -> list[dict]:
    """Write `popmod.py` into `folder`; `n` state dicts of its model, member `i` perturbed by
    Gaussian noise of scale `0.3 (i + 1)` (generator seed `100 + i`)."""
    (folder / "popmod.py").write_text(POP_FACTORY)
    sys.path.insert(0, str(folder))
    try:
        import popmod

        base = popmod.make_model().state_dict()
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("popmod", None)
    states = []
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        states.append({k: v + 0.3 * (i + 1) * torch.randn(v.shape, generator=g, dtype=v.dtype)
                       for k, v in base.items()})
    return states


def jsonl_lines(path) -> list[dict]:
    """Every line of a results file, each a complete JSON object ending in a newline."""
    raw = path.read_bytes()
    assert raw == b"" or raw.endswith(b"\n"), "the file ends in a torn line"
    return [json.loads(line) for line in raw.decode().splitlines()]
