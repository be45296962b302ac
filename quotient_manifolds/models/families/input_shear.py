r"""The shear of a post-norm model's first stream: a table read directly by the first block.

When the first post-norm block reads the rows $x = E[\text{token}]$ of an embedding table
itself (`nn.TransformerEncoder(norm_first=False)` over token embeddings), $x$ is read by the
block's linear maps $z_j = W_j x + b_j$ and, through the residual connection, by a LayerNorm
that removes every per-token constant, $\mathrm{LN}(y + c\,\mathbb 1) = \mathrm{LN}(y)$. The
shear $T_a = I + \mathbb 1 a^\top$ adds to each token the constant $a^\top x$:
$$
E \mapsto E\,T_a^\top = E + (E a)\,\mathbb 1^\top,\qquad
W_j \mapsto W_j T_a^{-1} = W_j - \frac{(W_j \mathbb 1)\, a^\top}{\lambda},
\qquad \lambda = 1 + a^\top \mathbb 1 \ne 0,
$$
keeps every $z_j$ and moves the LayerNorm's input by $(a^\top x)\,\mathbb 1$ only: the same
function for every $a \in \mathbb R^d$
([`ShearFold`][quotient_manifolds.models.families.input_shear.ShearFold]). With the table
shift $E + \mathbb 1 t^\top$ (a post-norm table shift) it makes the affine group
$x \mapsto T_a x + t$.

Canonical representative. Write each row as $x = \alpha u + P x$ with $u = \mathbb 1/\sqrt d$,
$P = I - u u^\top$: the shear keeps $P x$ and maps the column $\alpha = E u$ to
$\lambda \alpha + (E P) c$, $c = \sqrt d\, P a$. So the part $r$ of $\alpha$ orthogonal to the
columns of $E P$ is fixed up to $\lambda$; the canonical table has $\alpha = \rho\, r / \|r\|$,
$\rho = \|E P\|_F / \sqrt{d - 1}$ (the $u$-coordinate as large as the others, in root mean
square), reached by $\lambda = \rho / \|r\|$, $c = -\lambda (E P)^+ \alpha$ and
$a = c / \sqrt d + \mathbb 1 (\lambda - 1)/d$. Every quantity is read from the table alone
(no GL block moves it) and is unchanged by the table shift, applied before. No entry is frozen
(as for the stream rotations); where $r = 0$ the table is left as it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..linear import Consumer, ReadQuery, readers_of, storage
from ..norms import is_norm
from ..symmetry import Fold, Scene, SymmetryFamily, random_normal
from .centring import centres

__all__ = ["InputShears", "ShearFold"]

Params = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class ShearFold(Fold):
    r"""$(E, W_j) \mapsto (E + (E a)\mathbb 1^\top,\ W_j - (W_j \mathbb 1) a^\top/\lambda)$,
    $\lambda = 1 + a^\top \mathbb 1$; canonical representative in the module docstring."""

    table: str = ""
    consumers: tuple[Consumer, ...] = ()

    kind = "input_shear"
    order = 0.3  # after the table shift (0.25), whose canonical row it keeps at zero

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([self.table, *(c.weight for c in self.consumers)]))

    def _move(self, params: Params, a: torch.Tensor) -> dict[str, torch.Tensor]:
        out = dict(params)
        E = out[self.table]
        a = a.to(E.dtype)
        out[self.table] = E + (E @ a)[:, None]
        lam = 1 + a.sum()
        for c in self.consumers:
            M, _ = c.read(out)
            c.write(out, M - M.sum(1, keepdim=True) * (a.to(M.dtype) / lam)[None], None)
        return out

    def apply(self, params: Params) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            E = params[self.table].to(torch.float64)
            d = E.shape[1]
            alpha = E.sum(1) / math.sqrt(d)
            PX = E - E.mean(1, keepdim=True)
            coef = torch.linalg.pinv(PX) @ alpha
            r = alpha - PX @ coef
            rho = float(PX.norm()) / math.sqrt(d - 1)
            if float(r.norm()) <= 1e-12 * max(float(alpha.norm()), rho, 1e-300):
                return dict(params), {}
            lam = rho / float(r.norm())
            c = -lam * coef
            a = c / math.sqrt(d) + (lam - 1) / d
            return self._move(params, a), {}

    def act(self, params: Params, generator: torch.Generator | None = None,
            a: float = 1.0) -> dict[str, torch.Tensor]:
        E = params[self.table]
        d = E.shape[1]
        g = random_normal((d,), generator, E.dtype, E.device)
        lam = math.exp(a * float(random_normal((), generator, E.dtype, E.device)))
        return self._move(params, a * (g - g.mean()) / math.sqrt(d) + (lam - 1) / d)

    def lie_dim(self, params: Params) -> int:
        return int(params[self.table].shape[1])

    def act_at(self, params: Params, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._move(params, theta.view(params[self.table].shape[1:]))


class InputShears(SymmetryFamily):
    """An embedding table read directly by a post-norm block: the first centring LayerNorm of
    the forward pass comes after it, and linear maps read the table's output (the probe
    confirms that the LayerNorm reads it too, through the residual, and nothing else does)."""

    name = "input shears"
    kind = "folds"
    symmetries = ("complete",)

    def find(self, scene: Scene) -> None:
        p = scene.prober
        order = p.calls
        first = next((i for i, c in enumerate(order) if is_norm(p.modules[c.name])
                      and isinstance(c.out, torch.Tensor)
                      and centres(p.modules[c.name], c.args, c.kwargs)), None)
        if first is None:
            return
        tables = [c for c in order[:first] if isinstance(p.modules[c.name], nn.Embedding)]
        if len(tables) != 1 or not isinstance(tables[0].out, torch.Tensor):
            return  # several tables summed: the embedding shifts' case
        c = tables[0]
        weight = p.modules[c.name].weight
        found = readers_of(p.parameterised_calls(),
                           ReadQuery(storage(c.out), int(weight.shape[-1]), p.name, p.pname))
        if found and found[0]:
            scene.propose([ShearFold(c.name, p.name(weight), tuple(found[0]))])
