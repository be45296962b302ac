r"""The one walker over nested batches and model outputs: tensors inside tuples, lists and dicts.

A batch (`(x, y)`, a Hugging Face `{"input_ids": …}` or `BatchEncoding`), a forward's inputs
`(args, kwargs)` and a model's output (a tuple, a `ModelOutput`) are trees whose leaves are
tensors. Every layer of the library walks them the same way, through these functions.

torch's own pytree (`torch.utils._pytree`) is private API, and it treats a `Mapping` that is not
a registered type (a `BatchEncoding`, a `UserDict`) as one leaf, which would hide the tensors of
a Hugging Face batch; so the library walks `Mapping`, `tuple` (named tuples included) and `list`
itself, rebuilding each container with its own type where the type allows it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["tree_map", "tree_leaves", "first_tensor", "leading_size"]


def _rebuild_mapping(x: Mapping, d: dict) -> Any:
    try:  # a concrete mapping class (dict, OrderedDict, BatchEncoding, ModelOutput, ...)
        return type(x)(d)  # type: ignore[call-arg]
    except TypeError:
        return d


def tree_map(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """`tree` with every tensor `t` replaced by `fn(t)`; containers are rebuilt, everything else
    is passed through unchanged."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        return _rebuild_mapping(tree, {k: tree_map(fn, v) for k, v in tree.items()})
    if isinstance(tree, tuple):
        items = [tree_map(fn, v) for v in tree]
        if hasattr(tree, "_fields"):  # a named tuple
            return type(tree)(*items)
        return type(tree)(items)
    if isinstance(tree, list):
        return [tree_map(fn, v) for v in tree]
    return tree


def _walk(tree: Any, skip: Callable[[Any], bool] | None) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            if skip is None or not skip(k):
                yield from _walk(v, skip)
    elif isinstance(tree, (tuple, list)):
        for v in tree:
            yield from _walk(v, skip)


def tree_leaves(tree: Any, *, skip_key: Callable[[Any], bool] | None = None
                ) -> list[torch.Tensor]:
    """Every tensor of `tree`, depth first, in order; `skip_key(key)` drops a mapping entry
    with all it holds (e.g. a key/value cache)."""
    return list(_walk(tree, skip_key))


def first_tensor(tree: Any, predicate: Callable[[torch.Tensor], bool] | None = None
                 ) -> torch.Tensor | None:
    """The first tensor of `tree` (depth first) for which `predicate` holds, or `None`."""
    for t in _walk(tree, None):
        if predicate is None or predicate(t):
            return t
    return None


def leading_size(tree: Any) -> int | None:
    """Dim-0 size of the first tensor of dimension ≥ 1 in `tree` (the batch size), or `None`."""
    t = first_tensor(tree, lambda t: t.dim() > 0)
    return None if t is None else int(t.shape[0])
