r"""The modules that write a residual stream (or a norm's input) and their parameters.

A module *may write* a width-$d$ stream when it is a linear map, an embedding table, attention
(`nn.MultiheadAttention`: its output projection), a convolution with $d$ output channels (ViT's
patches), or a module whose own floating parameters all have width $d$ on their last axis
(added to what it returns: a class token, a position table). Whether it does is decided by the
graph ([`feeds_only`][quotient_manifolds.models.paths.feeds_only]); these helpers name the
candidates and the parameters that carry the stream's axis, shared by the LayerNorm-centring
and residual-rotation families and by the near-flat search.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import ReadQuery, linear_layer, readers_of, storage
from .norms import is_norm
from .prober import Prober

__all__ = ["known_module", "norm_readers", "writer_params", "writes_stream"]


def known_module(m: nn.Module) -> bool:
    """A linear map, embedding table, attention, convolution or norm: a module whose
    parameters the helpers here read by their role, not as own width-$d$ tables."""
    return (isinstance(m, (nn.Embedding, nn.MultiheadAttention, nn.modules.conv._ConvNd))
            or linear_layer(m) is not None or is_norm(m))


def writes_stream(m: nn.Module, out: object, widths: set[int]) -> bool:
    """Whether the module call may write a width-`d` output into a LayerNorm: a linear map, an
    embedding table, attention, a convolution (channels on axis 1), or a module with own
    parameters of width `d` (added to what it returns: a class token, position tables)."""
    if not isinstance(out, torch.Tensor) or not out.shape:
        return False
    if isinstance(m, nn.modules.conv._ConvNd):
        return out.dim() >= 2 and out.shape[1] in widths
    if out.shape[-1] not in widths:
        return False
    if isinstance(m, (nn.Embedding, nn.MultiheadAttention)) or linear_layer(m) is not None:
        return True
    if known_module(m):
        return False
    own = [t for t in m.parameters(recurse=False) if t.is_floating_point() and t.dim()]
    return bool(own) and all(t.shape[-1] == out.shape[-1] for t in own)


def writer_params(p: Prober, name: str, m: nn.Module, d: int) -> list[tuple[str, int]]:
    """`(parameter, axis)` of a module that writes width-`d` outputs, `axis` the one that carries
    the stream: the weight's output axis (an embedding table: its columns; a convolution: its
    output channels) and the bias; a module's own width-`d` parameters (their last axis)."""
    if isinstance(m, nn.Embedding):
        return [(p.name(m.weight), 1)]
    if isinstance(m, nn.modules.conv._ConvNd):  # (out, in, *kernel): one constant per input
        return [(p.name(m.weight), 0)] + ([(p.name(m.bias), 0)] if m.bias is not None else [])
    if not known_module(m):  # own parameters added to the output (a class token, positions)
        return [(n if not name else f"{name}.{n}", t.dim() - 1)
                for n, t in m.named_parameters(recurse=False)
                if t.is_floating_point() and t.dim() and t.shape[-1] == d]
    if isinstance(m, nn.MultiheadAttention):
        m = m.out_proj
    lin = linear_layer(m)
    if lin is None:
        return []
    out = [(p.name(lin.weight), 1 if lin.transposed else 0)]
    if lin.bias is not None:
        out.append((p.name(lin.bias), 0))
    return out


def norm_readers(p: Prober, norms: set[str], d: int) -> set[str]:
    """The weights of the linear maps that read the width-`d` output of a module of `norms`
    directly (q/k/v, an MLP's input): readers of the stream, never its writers."""
    calls = p.parameterised_calls()
    out: set[str] = set()
    for c in p.calls:
        if c.name in norms and isinstance(c.out, torch.Tensor):
            found = readers_of(calls, ReadQuery(storage(c.out), d, p.name, p.pname))
            out |= {x.weight for x in (found[0] if found else ())}
    return out
