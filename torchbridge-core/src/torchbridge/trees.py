"""The one tensor-tree walker: torch.utils._pytree, taught the output types models return.

pytree knows tuples, lists, dicts, namedtuples and (from transformers 4.3x on) Hugging Face
ModelOutputs. Other dict subclasses and dataclasses would be leaves, so the tensors inside
them would be invisible to drift checks and dtype casts. The first time a walk here meets
such a type, it is registered as a pytree node (keys or init fields as children), so that
every walk after sees inside it and rebuilds it as the same type.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

_lock = threading.Lock()


def _dict_flatten(obj: dict[Any, Any]) -> tuple[list[Any], Any]:
    return list(obj.values()), (type(obj), list(obj.keys()))


def _dict_unflatten(values: Any, context: Any) -> Any:
    cls, keys = context
    try:
        return cls(zip(keys, values, strict=True))
    except TypeError:  # a constructor with other arguments: fill a bare instance
        obj = cls.__new__(cls)
        dict.update(obj, zip(keys, values, strict=True))
        return obj


def _dataclass_flatten(obj: Any) -> tuple[list[Any], Any]:
    # fields() of the instance, not of its class: dynamo traces only the former, and
    # model outputs are flattened inside compiled forwards (forward.autocast_forward).
    names = [f.name for f in dataclasses.fields(obj) if f.init]
    return [getattr(obj, n) for n in names], (type(obj), names)


def _dataclass_unflatten(values: Any, context: Any) -> Any:
    cls, names = context
    return cls(**dict(zip(names, values, strict=True)))


def _unregistered_container(node: Any) -> bool:
    """A dict subclass or dataclass instance whose type pytree does not walk into yet."""
    if type(node) in pytree.SUPPORTED_NODES or isinstance(node, (torch.Tensor, type)):
        return False
    return isinstance(node, dict) or dataclasses.is_dataclass(node)


def _register_if_needed(node: Any) -> bool:
    """pytree's is_leaf callback: registers an unknown dict subclass or dataclass type the
    first time it is seen, then lets pytree look into it. Never reports a leaf itself."""
    if _unregistered_container(node):
        cls = type(node)
        with _lock:
            if cls not in pytree.SUPPORTED_NODES:
                if isinstance(node, dict):
                    pytree.register_pytree_node(cls, _dict_flatten, _dict_unflatten)
                else:
                    pytree.register_pytree_node(cls, _dataclass_flatten,
                                                _dataclass_unflatten)
    return False


def known_types(obj: Any) -> bool:
    """Whether every container in `obj` is a type pytree already walks into: then a walk
    here registers nothing (and can run inside a compiled region)."""
    return not any(_unregistered_container(leaf) for leaf in pytree.tree_leaves(obj))


def flatten(obj: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """(leaves, structure) of a model output or input."""
    return pytree.tree_flatten(obj, is_leaf=_register_if_needed)


def leaves(obj: Any) -> list[Any]:
    return flatten(obj)[0]


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in `obj`, in pytree order."""
    return [leaf for leaf in leaves(obj) if isinstance(leaf, torch.Tensor)]


def tree_map(fn: Callable[[Any], Any], obj: Any) -> Any:
    """`obj` rebuilt with fn applied to every leaf: same types (ModelOutput, namedtuple,
    dataclass, dict subclass) as it came in."""
    values, spec = flatten(obj)
    return pytree.tree_unflatten([fn(v) for v in values], spec)


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    return tree_map(lambda leaf: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf, obj)


def structure_difference(reference: Any, candidate: Any) -> str | None:
    """Why `candidate` is not a drop-in for `reference` (container types and keys, leaf
    types, tensor shapes and dtypes, a contiguous tensor become strided), or None when it
    is."""
    ref_leaves, ref_spec = flatten(reference)
    cand_leaves, cand_spec = flatten(candidate)
    if ref_spec != cand_spec:
        return f"output structure changed: {_describe(ref_spec)} became {_describe(cand_spec)}"
    for i, (ref, cand) in enumerate(zip(ref_leaves, cand_leaves, strict=True)):
        if isinstance(ref, torch.Tensor) and isinstance(cand, torch.Tensor):
            if ref.dtype != cand.dtype:
                return f"output {i} changed dtype: {ref.dtype} became {cand.dtype}"
            if ref.shape != cand.shape:
                return f"output {i} changed shape: {tuple(ref.shape)} became " \
                       f"{tuple(cand.shape)}"
            if ref.is_contiguous() and not cand.is_contiguous():
                # Same values, but user code that views the output (out.view(n, -1))
                # raises where it ran on the model as given.
                return f"output {i} is no longer contiguous (strides {tuple(ref.stride())} " \
                       f"became {tuple(cand.stride())})"
        elif type(ref) is not type(cand):
            return f"output {i} changed type: {type(ref).__name__} became " \
                   f"{type(cand).__name__}"
    return None


def _describe(spec: pytree.TreeSpec) -> str:
    text = str(spec)
    return text if len(text) <= 200 else text[:197] + "..."
