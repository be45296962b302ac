r"""Function-preservation probes: check a claimed symmetry by running the module.

Discovery recognises attention by its structure; a structure can look right and still be
wrong (channel attention, an unexpected fused layout, a norm the recogniser did not see).
Every claimed block is therefore checked numerically before it is used:

1. a float64 deep copy of the model is run once on a small random input
   ([example_inputs][quotient_manifolds.models.probe.example_inputs]), and forward hooks record
   each probed module's `(args, kwargs, output)`
   ([capture_module_calls][quotient_manifolds.models.probe.capture_module_calls]);
2. for each block, the parameters it reads are redrawn at random (so that zero-initialised
   adapters or HF's $\mathcal N(0, 0.02^2)$ initialisation, which makes attention nearly
   uniform and hides a wrong Q/K claim, cannot make a break invisible), the hidden-state
   inputs of its module are redrawn as Gaussians, and the module is re-run three times:
   with the redrawn weights, after a random element $A$ of the claimed group,
   $(G, H) \mapsto (G A^{-1}, H A^\top)$, and after the one-sided, non-symmetric change
   $G \mapsto G A^{-1}$;
3. the claim passes if the symmetric change moves the output by at most
   $10^{-10}$ (relative), while the non-symmetric change moves it by at least $10^{-3}$ — the
   probe must demonstrably be able to see the block. If it cannot, the inputs are scaled up
   (sharper attention) and the probe is repeated; a block that still cannot be excited is
   rejected.

Nothing here touches the user's model: every probe runs on the float64 copy, through
`torch.func.functional_call`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from ..errors import ExampleInputError
from ..manifolds import Subalgebra, group_action
from .blocks import BlockSpec, gather_block, scatter_block
from .records import PROBE_EXCITATION, PROBE_RTOL, ProbeRecord

__all__ = [
    "PROBE_RTOL",
    "PROBE_EXCITATION",
    "ProbeRecord",
    "example_inputs",
    "capture_module_calls",
    "output_change",
    "preserves_function",
    "random_group_element",
    "probe_blocks",
    "tolerance",
    "float64_internals",
    "float64_copy",
    "normalize_inputs",
]

_SCALES = (1.0, 8.0, 64.0, 1 / 8, 1 / 64)
_RATIO = 1e-4  # a symmetric change must move the output 10⁴ times less than the control
_HIDDEN_NAMES = frozenset({
    "hidden_states", "hidden_state", "encoder_hidden_states", "key_value_states", "x",
    "query", "key", "value", "input", "inputs", "src", "tgt", "memory",
})


# -- example inputs ------------------------------------------------------------------------


def _float_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.get_default_device()


def _signature(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _size(v) -> int:
    if isinstance(v, (tuple, list)):
        return int(v[0])
    return int(v)


def _hf_inputs(model, gen, device, dtype) -> tuple[tuple, dict]:
    cfg = model.config
    sig = _signature(model.forward)
    text = getattr(cfg, "text_config", None) or cfg
    vision = getattr(cfg, "vision_config", None) or cfg
    B = 2
    kw: dict[str, Any] = {}

    def seq_len(c, default):
        cap = (getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)
               or getattr(c, "max_target_positions", None))
        return max(1, min(default, int(cap))) if cap else default

    vocab = getattr(text, "vocab_size", None)
    if "input_ids" in sig and vocab:
        L = seq_len(text, 7)
        kw["input_ids"] = torch.randint(0, int(vocab), (B, L), generator=gen).to(device)
        if "attention_mask" in sig:
            kw["attention_mask"] = torch.ones(B, L, dtype=torch.long, device=device)
    if "pixel_values" in sig and getattr(vision, "image_size", None):
        S = _size(vision.image_size)
        C = int(getattr(vision, "num_channels", 3))
        kw["pixel_values"] = torch.randn(B, C, S, S, generator=gen, dtype=dtype).to(device)
    if "input_features" in sig and getattr(cfg, "num_mel_bins", None):
        T = 2 * int(cfg.max_source_positions)
        kw["input_features"] = torch.randn(B, int(cfg.num_mel_bins), T, generator=gen,
                                           dtype=dtype).to(device)
    if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in sig:
        dec = getattr(cfg, "decoder", None) or cfg
        dvocab = getattr(cfg, "decoder_vocab_size", None) or getattr(dec, "vocab_size", None)
        if dvocab:
            Ld = 5
            cap = getattr(cfg, "max_target_positions", None)
            Ld = min(Ld, int(cap)) if cap else Ld
            kw["decoder_input_ids"] = torch.randint(0, int(dvocab), (B, Ld),
                                                    generator=gen).to(device)
    if getattr(cfg, "add_cross_attention", False) and "encoder_hidden_states" in sig:
        width = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
        if width:
            kw["encoder_hidden_states"] = torch.randn(B, 6, int(width), generator=gen,
                                                      dtype=dtype).to(device)
    if "use_cache" in sig:
        kw["use_cache"] = False
    main = getattr(model, "main_input_name", None)
    if not kw or (main and main not in kw and main in sig):
        raise ExampleInputError(
            f"cannot build an example input for {type(model).__name__} from its config "
            f"(main input {main!r}); pass example_inputs= (a dict of forward keyword arguments)"
        )
    return (), kw


def _seq_tensor(gen, B, L, E, batch_first, device, dtype):
    shape = (B, L, E) if batch_first else (L, B, E)
    return torch.randn(*shape, generator=gen, dtype=dtype).to(device)


def _torch_inputs(model, gen, device, dtype) -> tuple[tuple, dict] | None:
    if isinstance(model, nn.MultiheadAttention):
        bf = model.batch_first
        q = _seq_tensor(gen, 2, 5, model.embed_dim, bf, device, dtype)
        k = _seq_tensor(gen, 2, 6, model.kdim, bf, device, dtype)
        v = _seq_tensor(gen, 2, 6, model.vdim, bf, device, dtype)
        return (q, k, v), {}
    if isinstance(model, nn.Transformer):
        layer = model.encoder.layers[0]
        E, bf = layer.self_attn.embed_dim, layer.self_attn.batch_first
        return (_seq_tensor(gen, 2, 6, E, bf, device, dtype),
                _seq_tensor(gen, 2, 5, E, bf, device, dtype)), {}
    if isinstance(model, (nn.TransformerEncoder, nn.TransformerEncoderLayer)):
        layer = model.layers[0] if isinstance(model, nn.TransformerEncoder) else model
        E, bf = layer.self_attn.embed_dim, layer.self_attn.batch_first
        return (_seq_tensor(gen, 2, 6, E, bf, device, dtype),), {}
    if isinstance(model, (nn.TransformerDecoder, nn.TransformerDecoderLayer)):
        layer = model.layers[0] if isinstance(model, nn.TransformerDecoder) else model
        E, bf = layer.self_attn.embed_dim, layer.self_attn.batch_first
        return (_seq_tensor(gen, 2, 5, E, bf, device, dtype),
                _seq_tensor(gen, 2, 6, E, bf, device, dtype)), {}
    return None


def _timm_inputs(model, gen, device, dtype) -> tuple[tuple, dict] | None:
    pe = getattr(model, "patch_embed", None)
    size = getattr(pe, "img_size", None)
    chans = None
    proj = getattr(pe, "proj", None)
    if isinstance(proj, nn.Conv2d):
        chans = proj.in_channels
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    if size is None and "input_size" in cfg:
        size = cfg["input_size"][1:]
    if chans is None:
        chans = cfg.get("input_size", (3,))[0] if cfg else 3
    if size is None:
        return None
    if isinstance(size, int):
        size = (size, size)
    x = torch.randn(2, int(chans), int(size[0]), int(size[1]), generator=gen, dtype=dtype)
    return (x.to(device),), {}


def _generic_inputs(model, gen, device, dtype) -> tuple[tuple, dict] | None:
    for m in model.modules():
        if not any(True for _ in m.parameters(recurse=False)):
            continue
        if isinstance(m, nn.Linear):
            return (torch.randn(2, 5, m.in_features, generator=gen, dtype=dtype).to(device),), {}
        if isinstance(m, nn.Embedding):
            return (torch.randint(0, m.num_embeddings, (2, 5), generator=gen).to(device),), {}
        if isinstance(m, nn.Conv2d):
            x = torch.randn(2, m.in_channels, 16, 16, generator=gen, dtype=dtype)
            return (x.to(device),), {}
        if isinstance(m, nn.MultiheadAttention):  # a model around self-attention: one sequence
            return (_seq_tensor(gen, 2, 5, m.embed_dim, m.batch_first, device, dtype),), {}
        return None
    return None


def example_inputs(model: nn.Module, generator: torch.Generator | None = None
                   ) -> tuple[tuple, dict]:
    """A small random input `(args, kwargs)` that `model(*args, **kwargs)` accepts.

    Hugging Face models: from the config and the forward signature (`input_ids` and
    `attention_mask`, `pixel_values`, `input_features`, `decoder_input_ids`; text and images
    together for CLIP-like models; `use_cache=False`). timm models: images of the patch
    embedding's size. `nn.MultiheadAttention`, `nn.Transformer`, `nn.TransformerEncoder`/
    `Decoder` (and their layers): random sequences. peft models: the base model's input.
    Anything else: a guess from the first parameterised leaf module (`nn.Linear`:
    `(2, 5, in_features)`; `nn.Embedding`: token ids; `nn.Conv2d`: images;
    `nn.MultiheadAttention`: one sequence of its width, for a model that applies it to its input).

    Parameters
    ----------
    model : nn.Module
        Only read.
    generator : torch.Generator, optional
        Source of randomness (CPU).

    Returns
    -------
    tuple of (tuple, dict)
        Positional and keyword arguments, on the model's device, floating tensors in the
        model's floating dtype.

    Raises
    ------
    ExampleInputError
        If no input can be built; pass one to `discover(..., example_inputs=...)`.
    """
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    device, dtype = _device(model), _float_dtype(model)
    # a PEFT wrapper (nn.Module types its unknown attributes as Tensor | Module)
    base = cast("Callable[[], nn.Module]", model.get_base_model)() if hasattr(
        model, "get_base_model") and hasattr(model, "peft_config") else model
    if hasattr(base, "config") and hasattr(base.config, "model_type"):
        return _hf_inputs(base, gen, device, dtype)
    out = _torch_inputs(base, gen, device, dtype)
    if out is None and type(base).__module__.startswith("timm."):
        out = _timm_inputs(base, gen, device, dtype)
    if out is None:
        out = _generic_inputs(base, gen, device, dtype)
    if out is None:
        raise ExampleInputError(
            f"cannot build an example input for {type(model).__name__}; pass example_inputs= "
            "(args, kwargs), a dict of keyword arguments, or a tensor"
        )
    return out


def normalize_inputs(inputs: Any) -> tuple[tuple, dict]:
    """`(args, kwargs)` from a tensor, a tuple of positional arguments, a dict of keyword
    arguments, or an `(args, kwargs)` pair."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if (isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[0], (tuple, list))
            and isinstance(inputs[1], Mapping)):
        return tuple(inputs[0]), dict(inputs[1])
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    raise ExampleInputError(
        f"example_inputs must be a tensor, a tuple of positional arguments, a dict of keyword "
        f"arguments or an (args, kwargs) pair, got {type(inputs).__name__}"
    )


# -- capture and compare --------------------------------------------------------------------


@contextlib.contextmanager
def _no_fastpath():
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


def capture_module_calls(
    model: nn.Module, inputs: tuple[tuple, dict], modules: Iterable[str]
) -> dict[str, tuple[tuple, dict, Any]]:
    """Run `model(*args, **kwargs)` once and record each named module's first call.

    Forward hooks (`with_kwargs=True`) record `(args, kwargs, output)`; they are removed
    afterwards. The forward runs under `torch.no_grad()` with torch's fused Transformer fast
    path disabled (it would bypass `nn.MultiheadAttention`). Pass a copy if the model must
    not run (e.g. in training mode, where dropout and batch-norm statistics change).

    Parameters
    ----------
    model : nn.Module
        The model to run.
    inputs : (tuple, dict)
        Positional and keyword arguments.
    modules : iterable of str
        Module paths as in `model.named_modules()` (`""` is the model itself).

    Returns
    -------
    dict
        `{path: (args, kwargs, output)}` for every module that was called.
    """
    args, kwargs = inputs
    lookup = dict(model.named_modules())
    store: dict[str, tuple[tuple, dict, Any]] = {}
    handles = []
    for name in dict.fromkeys(modules):
        if name not in lookup:
            continue

        def hook(mod, a, kw, out, name=name):
            if name not in store:
                store[name] = (tuple(a), dict(kw), out)

        handles.append(lookup[name].register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad(), _no_fastpath():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return store


def _first_float(out) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, Mapping):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for o in out:
            t = _first_float(o)
            if t is not None:
                return t
    return None


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


def _run(module, params, args, kwargs) -> torch.Tensor:
    with torch.no_grad(), _no_fastpath(), float64_internals():
        out = functional_call(module, params, tuple(args), dict(kwargs), strict=False)
    t = _first_float(out)
    if t is None:
        raise TypeError(f"{type(module).__name__} returned no floating-point tensor")
    return t


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(torch.linalg.vector_norm(a))
    num = float(torch.linalg.vector_norm(a - b))
    if not math.isfinite(num) or not math.isfinite(den):
        return math.inf
    return num / den if den > 0 else num


def output_change(
    module: nn.Module,
    params_a: Mapping[str, torch.Tensor],
    params_b: Mapping[str, torch.Tensor],
    args: Sequence = (),
    kwargs: Mapping | None = None,
) -> float:
    """Relative change $\\|y_b - y_a\\| / \\|y_a\\|$ of the module's output.

    `y` is the first floating-point tensor the module returns (the attention output for
    every attention module we know); the parameters given override the module's own (names
    relative to `module`), through `functional_call`.
    """
    kwargs = {} if kwargs is None else kwargs
    return _relative(_run(module, params_a, args, kwargs), _run(module, params_b, args, kwargs))


def preserves_function(
    model_or_module: nn.Module,
    params_a: Mapping[str, torch.Tensor],
    params_b: Mapping[str, torch.Tensor],
    args: Sequence = (),
    kwargs: Mapping | None = None,
    *,
    rtol: float = PROBE_RTOL,
) -> bool:
    """Whether the two parameter sets give the same output, to relative error `rtol`."""
    return output_change(model_or_module, params_a, params_b, args, kwargs) <= rtol


# -- group elements -------------------------------------------------------------------------


def random_group_element(
    group: Subalgebra | None,
    heads: int,
    h: int,
    generator: torch.Generator | None = None,
    *,
    scale: float = 0.7,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    r"""Random elements $A = \exp(X)$ of the connected group of `group`, `(heads, h, h)`.

    $X$ has i.i.d. $\mathcal N(0, \mathrm{scale}^2/h)$ entries, projected onto the subalgebra
    when `group` is given (`None`: all of $\mathfrak{gl}(h)$), so $A$ is invertible and
    well conditioned. A subalgebra with its own `random_element(generator, scale=, dtype=,
    batch=)` sampler is asked for the elements instead.
    """
    if group is not None and hasattr(group, "random_element"):
        try:  # the subalgebra's own sampler, where it has one
            return group.random_element(generator, scale=scale, dtype=dtype, batch=(heads,))
        except (NotImplementedError, TypeError):
            pass
    X = torch.randn(heads, h, h, generator=generator, dtype=dtype) * (scale / math.sqrt(h))
    if group is not None:
        X = group.project(X)
    return torch.linalg.matrix_exp(X)


def _act(block: BlockSpec, params: Mapping[str, torch.Tensor], A: torch.Tensor,
         one_sided: bool) -> dict[str, torch.Tensor]:
    x = gather_block(block, params)
    out = dict(params)
    scatter_block(block, group_action(x, A.to(x), block.n, one_sided=one_sided), out)
    return out


# -- the probe --------------------------------------------------------------------------------


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")


def _weight_hook(fn) -> bool:
    """Hooks that compute weights (old-style weight/spectral norm) are part of the function."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return isinstance(fn, (WeightNorm, SpectralNorm))


def float64_copy(model: nn.Module) -> nn.Module:
    """A float64 deep copy of `model` in eval mode, without the user's hooks.

    The user's model is not touched, and the user's forward/backward hooks do not see the
    probe's calls (hooks that compute weights, such as the old-style weight norm, are kept).
    """
    new = copy.deepcopy(model)
    for m in new.modules():
        for attr in _HOOK_DICTS:
            hooks = getattr(m, attr, None)
            if isinstance(hooks, dict):
                for key in [k for k, fn in hooks.items() if not _weight_hook(fn)]:
                    del hooks[key]
    new.eval()
    return new.to(torch.float64)


def _common_module(names: Iterable[str]) -> str:
    paths = [n.split(".")[:-1] for n in names]
    out = []
    for parts in zip(*paths):
        if all(p == parts[0] for p in parts):
            out.append(parts[0])
        else:
            break
    return ".".join(out)


def _probe_module(block: BlockSpec, lookup: Mapping[str, nn.Module]) -> str:
    """The smallest module that holds every parameter of the block (and its `module`), one
    level up if that module owns them all directly (a fused projection alone cannot show a
    symmetry between its rows)."""
    names = list(block.params)
    if block.module in lookup and block.module:
        names.append(block.module + ".*")
    prefix = _common_module(names)
    mod = lookup.get(prefix)
    own = {n for n, _ in mod.named_parameters(recurse=False)} if mod is not None else set()
    cut = len(prefix) + 1 if prefix else 0
    if prefix and all(p[cut:] in own for p in block.params):
        prefix = prefix.rsplit(".", 1)[0] if "." in prefix else ""
    return prefix


def _is_mask_like(t: torch.Tensor) -> bool:
    return bool((~torch.isfinite(t)).any()) or float(t.min()) < -1e4


def _randomise(args, kwargs, scale, gen):
    def draw(t):
        rms = float(t.pow(2).mean().sqrt()) if t.numel() else 1.0
        rms = rms if rms > 0 and math.isfinite(rms) else 1.0
        r = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t)
        return r * (rms * scale)

    new_args = []
    for i, a in enumerate(args):
        if (i < 3 and isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() >= 2
                and not _is_mask_like(a)):
            new_args.append(draw(a))
        else:
            new_args.append(a)
    new_kwargs = {}
    for k, v in kwargs.items():
        if k in _HIDDEN_NAMES and isinstance(v, torch.Tensor) and v.is_floating_point():
            new_kwargs[k] = draw(v)
        elif type(v).__name__.endswith("Cache"):
            new_kwargs[k] = None  # never update a key/value cache while probing
        else:
            new_kwargs[k] = v
    return tuple(new_args), new_kwargs


def _redraw(params: Mapping[str, torch.Tensor], names: Iterable[str], gen) -> dict:
    out = dict(params)
    for n in names:
        t = params[n]
        sigma = 1.0 / math.sqrt(min(t.shape)) if t.dim() >= 2 else 1.0
        out[n] = (torch.randn(t.shape, generator=gen, dtype=torch.float64) * sigma).to(t)
    return out


def _synthesise(module: nn.Module, d_in: int | None, gen) -> tuple[tuple, dict] | None:
    dtype, device = _float_dtype(module), _device(module)
    out = _torch_inputs(module, gen, device, dtype)
    if out is not None:
        return out
    d = d_in or getattr(module, "in_features", None)
    if d is None:
        return None
    return (torch.randn(2, 7, int(d), generator=gen, dtype=dtype).to(device),), {}


def _local(prefix: str, params: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict:
    cut = len(prefix) + 1 if prefix else 0
    return {n[cut:]: params[n] for n in names}


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


def tolerance(module: nn.Module, params: Mapping[str, torch.Tensor], args: Sequence,
              kwargs: Mapping) -> float:
    r"""The probe's tolerance for `module`: `PROBE_RTOL` if it computes in float64 throughout,
    else $100\,\epsilon$ of the lowest precision it uses (some models run their rotary
    embedding in float32 even in a float64 model)."""
    mode = _Precision()
    with mode:
        _run(module, params, args, kwargs)
    if mode.eps <= float(torch.finfo(torch.float64).eps):
        return PROBE_RTOL
    return max(PROBE_RTOL, 100.0 * mode.eps)


def _probe_one(block, module, prefix, call, params, gen) -> ProbeRecord:
    names = block.params
    # every other weight the probed module reads is redrawn too: whether the probe can excite
    # the block must not depend on where the model sits on its orbit (a value bias translated
    # far by a fold, norm gains scaled by 100, would otherwise hide the Q/K block)
    inside = prefix + "." if prefix else ""
    others = [n for n in params if n.startswith(inside) and n not in names
              and params[n].is_floating_point()]
    base = _redraw(params, [*names, *others], gen)
    A = random_group_element(block.group, block.heads, block.h, gen)
    sym = _act(block, base, A, one_sided=False)
    ctrl = _act(block, base, A, one_sided=True)
    pa, ps, pc = (_local(prefix, d, [*names, *others]) for d in (base, sym, ctrl))
    args, kwargs = call
    err = ref = math.nan
    scale = _SCALES[0]
    for scale in _SCALES:
        a, kw = _randomise(args, kwargs, scale, gen)
        y0 = _run(module, pa, a, kw)
        err = _relative(y0, _run(module, ps, a, kw))
        ref = _relative(y0, _run(module, pc, a, kw))
        if ref >= PROBE_EXCITATION:
            break
    tol = PROBE_RTOL if err <= PROBE_RTOL else tolerance(module, pa, a, kw)
    where = prefix or "<root>"
    if not math.isfinite(err) or err > tol:
        reason = (f"a random element of the claimed group changes the output of {where} by "
                  f"{err:.2e} (relative; allowed {tol:.0e}; a non-symmetric change: {ref:.2e})")
        passed = False
    elif ref < PROBE_EXCITATION or err > _RATIO * ref:
        reason = (f"the probe cannot excite the block: a non-symmetric change moves the output "
                  f"of {where} by only {ref:.2e} (the claimed symmetry: {err:.2e})")
        passed = False
    else:
        reason, passed = "", True
    return ProbeRecord(block.module, block.kind, prefix, err, ref, scale, passed, reason, tol)


def probe_blocks(
    model: nn.Module,
    blocks: Sequence[BlockSpec],
    inputs: tuple[tuple, dict] | None = None,
    *,
    input_dims: Mapping[str, int] | None = None,
    generator: torch.Generator | None = None,
    copy_model: bool = True,
) -> list[ProbeRecord | None]:
    """Check every block with the function-preservation probe (see the module docstring).

    Parameters
    ----------
    model : nn.Module
        The model (a float64 copy is probed unless `copy_model=False`).
    blocks : sequence of BlockSpec
        Resolved blocks.
    inputs : (tuple, dict), optional
        Example inputs of the whole model; `None` builds them with
        [example_inputs][quotient_manifolds.models.probe.example_inputs] (if that fails,
        only modules whose input can be synthesised are probed).
    input_dims : mapping, optional
        `{module path: hidden size}`: lets the probe call an attention module on its own with
        a random `(2, 7, d)` input when the model-level forward did not reach it.
    generator : torch.Generator, optional
        Randomness of the redrawn weights, inputs and group elements.
    copy_model : bool
        Probe a float64 deep copy (default). `False` probes `model` itself, which must then
        already be a float64 model in eval mode that may be run.

    Returns
    -------
    list of ProbeRecord or None
        One entry per block, `None` where the block's module could not be run at all.
    """
    gen = generator if generator is not None else torch.Generator().manual_seed(1234)
    work = float64_copy(model) if copy_model else model
    params = {n: p.detach() for n, p in work.named_parameters()}
    lookup = dict(work.named_modules())
    prefixes = [_probe_module(b, lookup) for b in blocks]
    calls: dict[str, tuple[tuple, dict, Any]] = {}
    if inputs is None:
        try:
            inputs = example_inputs(work, torch.Generator().manual_seed(0))
        except ExampleInputError:
            inputs = None
    else:
        inputs = _cast_inputs(inputs, work)
    if inputs is not None:
        try:
            calls = capture_module_calls(work, inputs, prefixes)
        except Exception:  # noqa: BLE001 — a model that rejects the guessed input
            calls = _capture_float32(model, inputs, prefixes) if copy_model else {}
    dims = dict(input_dims or {})
    out: list[ProbeRecord | None] = []
    for b, prefix in zip(blocks, prefixes):
        module = lookup[prefix]
        captured = calls.get(prefix)
        call = (captured[0], captured[1]) if captured is not None else None
        if call is None:
            call = _synthesise(module, dims.get(b.module) or dims.get(prefix), gen)
        if call is None:
            out.append(None)
            continue
        try:
            out.append(_probe_one(b, module, prefix, call, params, gen))
        except Exception as e:  # noqa: BLE001 — the module rejects the synthesised input
            if prefix in calls:
                out.append(ProbeRecord(b.module, b.kind, prefix, math.nan, math.nan, 1.0, False,
                                       f"re-running {prefix or '<root>'} failed: {e!r}"))
            else:
                out.append(None)
    return out


def _cast_tree(v, dtype, device):
    if isinstance(v, torch.Tensor):
        v = v if device is None else v.to(device)
        return v.to(dtype) if v.is_floating_point() else v
    if isinstance(v, (tuple, list)):
        return type(v)(_cast_tree(x, dtype, device) for x in v)
    if isinstance(v, dict):
        return {k: _cast_tree(x, dtype, device) for k, x in v.items()}
    return v


def _cast_inputs(inputs, model) -> tuple[tuple, dict]:
    args, kwargs = normalize_inputs(inputs)
    dtype, device = _float_dtype(model), _device(model)
    return _cast_tree(tuple(args), dtype, device), _cast_tree(dict(kwargs), dtype, device)


def _capture_float32(model, inputs, prefixes) -> dict:
    """Capture in float32 when the model cannot run in float64 as a whole (e.g. grouped
    expert matmuls); the captured inputs are cast to float64 for the module-level probes."""
    try:
        cap = float64_copy(model).to(torch.float32)
        calls = capture_module_calls(cap, _cast_inputs(inputs, cap), prefixes)
    except Exception:  # noqa: BLE001 — the model does not run on this input at all
        return {}
    return {k: (_cast_tree(a, torch.float64, None), _cast_tree(kw, torch.float64, None), None)
            for k, (a, kw, _) in calls.items()}
