r"""Float64 machinery of the probes: a float64 copy of a model, and the context that keeps it
in float64 all the way through.

A function-preservation probe compares outputs to a relative $10^{-10}$, which only float64 can
resolve; but many models cast part of their forward pass down to float32 whatever their dtype.
[`float64_internals`][quotient_manifolds.models.precision.float64_internals] undoes those casts,
[`float64_copy`][quotient_manifolds.models.precision.float64_copy] makes the copy that is probed,
and [`lowest_precision`][quotient_manifolds.models.precision.lowest_precision] tells what a
module computes in when a cast cannot be undone.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from ..errors import UnsupportedModelError

__all__ = ["float64_copy", "float64_internals", "lowest_precision", "no_fastpath",
           "run_module"]


@contextlib.contextmanager
def no_fastpath() -> Iterator[None]:
    """Disable torch's fused Transformer fast path, which bypasses the attention module."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "set_fastpath_enabled"):
        yield
        return
    old = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(old)


_LOW_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_DOWNCASTS = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)


def _widen(v):
    return torch.float64 if isinstance(v, torch.dtype) and v in _LOW_FLOATS else v


class float64_internals(TorchFunctionMode):
    """Inside this context, float64 tensors are not cast down to a lower float precision.

    Many models compute part of a forward pass in float32 whatever their dtype (eager
    attention's `softmax(..., dtype=torch.float32)`, RMS norms, rotary embeddings that call
    `.float()`); in a float64 probe such a cast rounds every output to float32 and would hide a
    break below $10^{-7}$. Casts of a float64 tensor (`.float()`, `.half()`, `.bfloat16()`,
    `.to(dtype)`, `.to(other)`, `.type_as(other)`, `dtype=` arguments) keep float64 here;
    everything else runs unchanged.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.dtype == torch.float64:
            if func in _DOWNCASTS:
                return first
            if func is torch.Tensor.type_as and args[1].dtype in _LOW_FLOATS:
                return first.to(args[1].device)
            if func is torch.Tensor.to:
                if len(args) > 1 and isinstance(args[1], torch.Tensor):
                    if args[1].dtype in _LOW_FLOATS:
                        args = (first, args[1].device, torch.float64, *args[2:])
                else:
                    args = tuple(_widen(a) for a in args)
            if "dtype" in kwargs:
                kwargs["dtype"] = _widen(kwargs["dtype"])
        return func(*args, **kwargs)


def run_module(module: nn.Module, params: Mapping[str, torch.Tensor], args: Sequence = (),
               kwargs: Mapping | None = None) -> Any:
    """`module(*args, **kwargs)` with `params` overriding its own parameters (names relative to
    `module`; the others and the buffers are the module's), without gradients, with torch's
    fused Transformer fast path off and float64 kept throughout."""
    with torch.no_grad(), no_fastpath(), float64_internals():
        return functional_call(module, dict(params), tuple(args), dict(kwargs or {}),
                               strict=False)


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")


def _weight_hook(fn: Any) -> bool:
    """Hooks that compute weights (old-style weight/spectral norm) are part of the function."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return isinstance(fn, (WeightNorm, SpectralNorm))


def float64_copy(model: nn.Module) -> nn.Module:
    """A float64 deep copy of `model` in eval mode, without the user's hooks.

    The user's model is not touched, and the user's forward/backward hooks do not see the
    probe's calls (hooks that compute weights, such as the old-style weight norm, are kept).
    """
    try:
        new = copy.deepcopy(model)
    except Exception as e:  # noqa: BLE001 - a lock, a file, an open connection, ...
        raise UnsupportedModelError(
            f"{type(model).__name__} cannot be copied for the symmetry probes "
            f"(copy.deepcopy: {type(e).__name__}: {e}); move what cannot be copied (a lock, "
            "a file) out of the module, or pass geometry=Geometry(symmetries=...) discovered "
            "on a copyable twin, or Geometry(blocks=[...]), so that nothing is probed"
        ) from e
    for m in new.modules():
        for attr in _HOOK_DICTS:
            hooks = getattr(m, attr, None)
            if isinstance(hooks, dict):
                for key in [k for k, fn in hooks.items() if not _weight_hook(fn)]:
                    del hooks[key]
    new.eval()
    return new.to(torch.float64)


class _Precision(TorchFunctionMode):
    """Records the lowest floating precision of any tensor a call produces."""

    def __init__(self) -> None:
        super().__init__()
        self.eps = float(torch.finfo(torch.float64).eps)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.eps = max(self.eps, float(torch.finfo(t.dtype).eps))
        return out


def lowest_precision(call: Callable[[], Any]) -> float:
    """The machine epsilon of the lowest floating precision of any tensor `call()` produces."""
    mode = _Precision()
    with mode:
        call()
    return mode.eps
