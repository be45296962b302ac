r"""Example inputs: a small random input that a model accepts, for the probes of discovery.

The builders of [`INPUT_BUILDERS`][quotient_manifolds.models.inputs.INPUT_BUILDERS] are asked in
order, each `builder(model, generator, device, dtype) -> (args, kwargs) or None`; the first
that knows the model answers. A new architecture family whose inputs no builder knows adds one
with [`register_input_builder`][quotient_manifolds.models.inputs.register_input_builder] (or the
user passes `example_inputs=` to [`discover`][quotient_manifolds.models.discover]).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn

from ..errors import ExampleInputError
from ..tree import tree_map

__all__ = [
    "INPUT_BUILDERS",
    "InputBuilder",
    "capture_inputs",
    "cast_inputs",
    "example_inputs",
    "float_dtype",
    "generic_inputs",
    "hf_inputs",
    "model_device",
    "normalize_inputs",
    "register_input_builder",
    "signature_names",
    "timm_inputs",
    "torch_inputs",
]

InputBuilder = Callable[[nn.Module, torch.Generator, torch.device, torch.dtype],
                        "tuple[tuple, dict] | None"]
"""`builder(model, generator, device, dtype) -> (args, kwargs)`, or `None` for a model it does
not know."""


def float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (the default dtype if none)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (the default device if none)."""
    for p in model.parameters():
        return p.device
    return torch.get_default_device()


def signature_names(fn: Callable) -> set[str]:
    """The parameter names of `fn` (empty if it has no inspectable signature)."""
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _size(v) -> int:
    if isinstance(v, (tuple, list)):
        return int(v[0])
    return int(v)


def hf_inputs(model: nn.Module, gen: torch.Generator, device: torch.device,
              dtype: torch.dtype) -> tuple[tuple, dict] | None:
    """Hugging Face models: from the config and the forward signature (`None` for others)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "model_type"):
        return None
    sig = signature_names(model.forward)
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


def torch_inputs(model: nn.Module, gen: torch.Generator, device: torch.device,
                 dtype: torch.dtype) -> tuple[tuple, dict] | None:
    """torch's attention and Transformer modules: random sequences of their width."""
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


def timm_inputs(model: nn.Module, gen: torch.Generator, device: torch.device,
                dtype: torch.dtype) -> tuple[tuple, dict] | None:
    """timm models: images of the patch embedding's size (`None` for others)."""
    if not type(model).__module__.startswith("timm."):
        return None
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


def generic_inputs(model: nn.Module, gen: torch.Generator, device: torch.device,
                   dtype: torch.dtype) -> tuple[tuple, dict] | None:
    """A guess from the first parameterised leaf module."""
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


INPUT_BUILDERS: list[InputBuilder] = [hf_inputs, torch_inputs, timm_inputs, generic_inputs]
"""The input builders, asked in order (the generic guess last)."""


def register_input_builder(builder: InputBuilder, *, index: int = 0) -> None:
    """Ask `builder` before the builders after `index` (default: before every other one)."""
    if not callable(builder):
        raise TypeError(f"an input builder must be callable, got {builder!r}")
    INPUT_BUILDERS.insert(index, builder)


def example_inputs(model: nn.Module, generator: torch.Generator | None = None
                   ) -> tuple[tuple, dict]:
    """A small random input `(args, kwargs)` that `model(*args, **kwargs)` accepts.

    The builders of `INPUT_BUILDERS` are asked in order; the first that knows the model
    answers. Built in:

    * Hugging Face models: from the config and the forward signature (`input_ids` and
      `attention_mask`, `pixel_values`, `input_features`, `decoder_input_ids`; text and images
      together for CLIP-like models; `use_cache=False`);
    * timm models: images of the patch embedding's size;
    * `nn.MultiheadAttention`, `nn.Transformer`, `nn.TransformerEncoder`/`Decoder` (and their
      layers): random sequences;
    * anything else: a guess from the first parameterised leaf module (`nn.Linear`:
      `(2, 5, in_features)`; `nn.Embedding`: token ids; `nn.Conv2d`: images;
      `nn.MultiheadAttention`: one sequence of its width, for a model that applies it to its
      input).

    A peft model gets its base model's input.

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
    device, dtype = model_device(model), float_dtype(model)
    # a PEFT wrapper (nn.Module types its unknown attributes as Tensor | Module)
    base = cast("Callable[[], nn.Module]", model.get_base_model)() if hasattr(
        model, "get_base_model") and hasattr(model, "peft_config") else model
    for build in INPUT_BUILDERS:
        out = build(base, gen, device, dtype)
        if out is not None:
            return out
    raise ExampleInputError(
        f"cannot build an example input for {type(model).__name__}; pass example_inputs= "
        "(args, kwargs), a dict of keyword arguments, or a tensor"
    )


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


class _Captured(Exception):
    pass


def capture_inputs(model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any], batch: Any
                   ) -> tuple[tuple, dict] | None:
    """The inputs `(args, kwargs)` with which `loss_fn(model, batch)` calls `model`: a forward
    pre-hook records them and stops the forward, so the model does not run. `None` if the loss
    does not call `model` itself, or fails before it does."""
    call: list[tuple[tuple, dict]] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        call.append((args, kwargs))
        raise _Captured

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            loss_fn(model, batch)
    except _Captured:
        pass
    except Exception:  # noqa: BLE001 -- the loss fails later with its own, clearer error
        return None
    finally:
        handle.remove()
    return call[0] if call else None


def cast_inputs(inputs: Any, dtype: torch.dtype, device: torch.device | None = None
                ) -> tuple[tuple, dict]:
    """`normalize_inputs(inputs)` with floating tensors in `dtype` (and every tensor on
    `device`)."""
    args, kwargs = normalize_inputs(inputs)

    def cast(t: torch.Tensor) -> torch.Tensor:
        t = t if device is None else t.to(device)
        return t.to(dtype) if t.is_floating_point() else t

    return tree_map(cast, tuple(args)), tree_map(cast, dict(kwargs))
