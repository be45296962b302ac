r"""Homogeneous pairs: two linear maps with a positively homogeneous function between them.

The [`Neurons`][quotient_manifolds.models.families.mlp.Neurons] family reads MLP modules by their
attribute names and activation attribute. A classifier head such as DistilBERT's,
$z = W_2\,\mathrm{ReLU}(W_1 h + b_1) + b_2$ with the ReLU applied functionally inside the
model's `forward`, has the same symmetry without that structure: per hidden unit $i$,
$(W_{1,i}, b_{1,i}, W_{2,:i}) \mapsto (\lambda_i W_{1,i}, \lambda_i b_{1,i}, W_{2,:i}/\lambda_i)$
for $\lambda_i > 0$, a $GL^+(1)$ block per unit.

[`HomogeneousPairs`][quotient_manifolds.models.families.relu_pairs.HomogeneousPairs] finds such
pairs on the traced forward pass, for the linear maps no earlier block claimed: the output $y$
of a linear map $L_1$ is replaced by $c \odot y$ with a random positive $c$ (one entry per unit),
and every later linear map whose input moves to exactly $c \odot x$ (its traced input $x$) reads
$y$ through an elementwise positively homogeneous function. The block is then probed like every
other.
"""

from __future__ import annotations

import torch
from torch import nn

from ..blocks import BlockSpec
from ..linear import LinearLayer, linear_layer
from ..precision import float64_internals, no_fastpath
from ..prober import Prober
from ..symmetry import Scene, SymmetryFamily
from .attention_layouts import Projection

__all__ = ["HomogeneousPairs"]


def _proj(p: Prober, lin: LinearLayer) -> Projection:
    return Projection(p.pname(lin.weight), lin.transposed, 0, 0, p.pname(lin.bias))


def _scaled_readers(p: Prober, source: str, units: int, later: list[str]) -> list[str]:
    """The modules of `later` whose (first) input becomes $c \\odot x$ when the (first) output
    of `source` becomes $c \\odot y$, for a random positive $c$ of length `units`."""
    c = torch.rand(units, generator=p.gen, dtype=torch.float64) * 2.5 + 0.25
    seen: dict[str, torch.Tensor] = {}
    done: set[str] = set()

    def post(mod, args, out):
        if "source" in done or not isinstance(out, torch.Tensor):
            return None
        done.add("source")
        return out * c.to(out.dtype)

    def pre(name):
        def f(mod, args):
            if name not in seen and args and isinstance(args[0], torch.Tensor):
                seen[name] = args[0]
        return f

    hooks = [p.modules[source].register_forward_hook(post)]
    hooks += [p.modules[n].register_forward_pre_hook(pre(n)) for n in later]
    try:
        with torch.no_grad(), no_fastpath(), float64_internals():
            torch.func.functional_call(p.model, {**p.params, **p.buffers}, p.args, p.kwargs)
    except Exception:  # noqa: BLE001 -- the scaled output broke the forward pass
        return []
    finally:
        for hk in hooks:
            hk.remove()
    out = []
    for n in later:
        call = p.first_call(n)
        x = call.args[0] if call is not None and call.args else None
        new = seen.get(n)
        if not isinstance(x, torch.Tensor) or new is None or new.shape != x.shape:
            continue
        ref = x * c.to(x.dtype)
        scale = float(x.abs().max())
        if scale > 0 and bool((new - ref).abs().max() <= 1e-12 * scale) and not torch.equal(
                new, x):
            out.append(n)
    return out


class HomogeneousPairs(SymmetryFamily):
    """One $GL^+(1)$ block per hidden unit between a linear map and its readers through a
    positively homogeneous function (see the module docstring)."""

    name = "homogeneous pairs"
    kind = "blocks"
    symmetries = ("complete",)

    def find(self, scene: Scene) -> None:
        p = scene.prober
        if p.reference is None or p.problem is not None:
            return
        claimed = {q for b in scene.blocks for q in b.params}
        order: list[str] = []
        for c in p.calls:
            if c.name not in order and linear_layer(p.modules[c.name]) is not None:
                order.append(c.name)
        for i, name in enumerate(order):
            lin = linear_layer(p.modules[name])
            assert lin is not None
            if p.name(lin.weight) in claimed or p.tied(p.name(lin.weight)):
                continue
            later = [n for n in order[i + 1:] if _in_features(p.modules[n]) == lin.out_features
                     and p.name(_weight(p.modules[n])) not in claimed]
            readers = _scaled_readers(p, name, lin.out_features, later) if later else []
            if not readers:
                continue
            outs = [linear_layer(p.modules[n]) for n in readers]
            H = tuple(_proj(p, o).out_part() for o in outs if o is not None)
            pin = _proj(p, lin)
            G = tuple(x for x in (pin.part(), pin.bias_part()) if x is not None)
            module = _common(name, readers)
            scene.claim(BlockSpec("mlp", module, lin.out_features, 1, G, H,
                                  note=f"{name} -> {', '.join(readers)}", connected=True),
                        lin.in_features)
            claimed |= {q for part in G + H for q in (part.param,)}


def _weight(m: nn.Module) -> torch.Tensor:
    lin = linear_layer(m)
    assert lin is not None
    return lin.weight


def _in_features(m: nn.Module) -> int:
    lin = linear_layer(m)
    return -1 if lin is None else lin.in_features


def _common(name: str, others: list[str]) -> str:
    parts = [n.split(".") for n in (name, *others)]
    out = []
    for xs in zip(*parts):
        if all(x == xs[0] for x in xs):
            out.append(xs[0])
        else:
            break
    return ".".join(out)
