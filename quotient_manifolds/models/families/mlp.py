r"""MLP neurons: the scaling of each hidden unit against its output column, a GL(1) block.

A hidden unit $i$ of an MLP $y = \sum_i w^{\mathrm{out}}_i\, \phi_i(x)$ whose activation is
positively homogeneous, $\phi(\lambda z) = \lambda \phi(z)$ for $\lambda > 0$ (ReLU, leaky ReLU),
has the symmetry $(w^{\mathrm{in}}_i, b^{\mathrm{in}}_i, w^{\mathrm{out}}_i) \mapsto
(\lambda w^{\mathrm{in}}_i, \lambda b^{\mathrm{in}}_i, w^{\mathrm{out}}_i / \lambda)$; in a gated
MLP, $\phi_i(x) = \sigma(g_i^\top x)\, (u_i^\top x)$ (SwiGLU, GeGLU), the linear branch $u_i$
scales with any $\lambda \ne 0$ whatever the gate's activation. Either is a GL(1) block per unit
(paper §3.2's simple rescaling, App. A's block with $h = 1$):
$G_i = [w^{\mathrm{in}}_i; b^{\mathrm{in}}_i]$, $H_i = w^{\mathrm{out}}_i$, batched over the units
as `heads`, with the positive scalings only (`connected=True`) for a homogeneous activation.

[`Neurons`][quotient_manifolds.models.families.mlp.Neurons] recognises the MLP modules by their
projections (below) and, for an ungated one, tests the activation for positive homogeneity
numerically; the probe then checks every claim.

* gated: `gate_proj`/`up_proj`/`down_proj` (Llama, Mistral, Qwen, Gemma), `wi_0`/`wi_1`/`wo`
  (T5 gated), `w1`/`w3`/`w2` (Mixtral experts), `fc1_g`/`fc1_x`/`fc2` (timm SwiGLU);
* ungated: `fc1`/`fc2` (timm, OPT, CLIP), `linear1`/`linear2` (`nn.TransformerEncoderLayer`),
  `c_fc`/`c_proj` (GPT-2), `wi`/`wo` (T5), `lin1`/`lin2` (DistilBERT),
  `dense_h_to_4h`/`dense_4h_to_h` (GPT-NeoX, BLOOM).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..blocks import BlockSpec
from ..linear import LinearLayer, linear_layer
from ..symmetry import Scene, SymmetryFamily
from .attention_layouts import Projection, base_layer

__all__ = ["Neurons", "positively_homogeneous"]

GATED = (("gate_proj", "up_proj", "down_proj"), ("wi_0", "wi_1", "wo"), ("w1", "w3", "w2"),
         ("fc1_g", "fc1_x", "fc2"))
"""`(gate, linear branch, output)` attribute names of gated MLPs."""

UNGATED = (("fc1", "fc2"), ("linear1", "linear2"), ("c_fc", "c_proj"), ("wi", "wo"),
           ("lin1", "lin2"), ("dense_h_to_4h", "dense_4h_to_h"))
"""`(input, output)` attribute names of ungated MLPs."""

_ACTIVATIONS = ("act", "act_fn", "activation", "activation_fn", "act_layer")


def positively_homogeneous(fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    r"""Whether $\phi(\lambda z) = \lambda \phi(z)$ for $\lambda > 0$, on random $z$ (float64)."""
    z = torch.randn(64, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    try:
        with torch.no_grad():
            return all(bool(torch.allclose(fn(lam * z), lam * fn(z), rtol=1e-12, atol=1e-12))
                       for lam in (0.37, 2.9))
    except Exception:  # noqa: BLE001 -- not an elementwise function of one tensor
        return False


def _activation(m: nn.Module) -> Callable | None:
    for a in _ACTIVATIONS:
        f = getattr(m, a, None)
        if callable(f) and not isinstance(f, type):
            return f
    return None


def _proj(scene: Scene, lin: LinearLayer) -> Projection:
    return Projection(scene.pname(lin.weight), lin.transposed, 0, 0, scene.pname(lin.bias))


class Neurons(SymmetryFamily):
    """One GL(1) block per hidden unit of every recognised MLP (see the module docstring)."""

    name = "MLP neurons"
    kind = "blocks"
    symmetries = ("complete",)

    def find(self, scene: Scene) -> None:
        for name, m in scene.modules.items():
            if name in scene.accounted:
                continue
            for gate, lin, out in GATED:
                layers = [linear_layer(base_layer(getattr(m, a, None))) for a in (gate, lin, out)]
                if all(x is not None for x in layers):
                    g, u, o = (x for x in layers if x is not None)
                    if g.out_features == u.out_features == o.in_features:
                        self._claim(scene, name, m, u, o, connected=False, note=f"gated {lin}")
                    break
            else:
                for a, b in UNGATED:
                    i, o2 = (linear_layer(base_layer(getattr(m, x, None))) for x in (a, b))
                    act = _activation(m)
                    if (i is not None and o2 is not None and i.out_features == o2.in_features
                            and act is not None and positively_homogeneous(act)):
                        self._claim(scene, name, m, i, o2, connected=True, note=f"{a} + {b}")
                        break

    @staticmethod
    def _claim(scene: Scene, name: str, m: nn.Module, inp: LinearLayer, out: LinearLayer,
               connected: bool, note: str) -> None:
        p_in, p_out = _proj(scene, inp), _proj(scene, out)
        if p_in.weight is None or p_out.weight is None:
            return
        scene.account(name, m)
        G = tuple(x for x in (p_in.part(), p_in.bias_part()) if x is not None)
        scene.claim(BlockSpec("mlp", name, inp.out_features, 1, G, (p_out.out_part(),),
                              note=note, connected=connected), inp.in_features)
