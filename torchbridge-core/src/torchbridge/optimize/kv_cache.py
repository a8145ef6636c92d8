"""Transformers' fixed-size KV caches in a model that runs under autocast.

Under autocast a decoder's keys and values leave an attention layer in different dtypes:
the value projection gives bfloat16, while the rotary embedding multiplies the key
projection's bfloat16 by cos and sin in the residual stream's float32, which promotes the
keys to float32. A cache that grows by concatenation (transformers' DynamicCache, what
generate() uses by default) stores each as it comes. A cache of fixed size (StaticCache,
what `generate(cache_implementation="static")` and "sliding_window" build, and what
compiled decoding uses) allocates both its tensors in the dtype of the first keys it sees
and writes into them with `index_copy_`, which does not convert: the first values failed
("index_copy_(): self and source expected to have the same dtype, but got (self) Float and
(source) BFloat16"; a Llama at O3, and as well under a plain `torch.autocast`).

So the prepared model's forward gives each such cache layer keys and values in one dtype
before it stores them: the dtype of its storage once allocated, before that the wider of
the two (bfloat16 to float32 is exact). The attention that reads them casts both to the
autocast dtype, as it cast the float32 keys of a DynamicCache: the outputs are those of the
dynamic cache. Caches are recognised by structure (a `layers` list whose layers have a
`max_cache_len` and an `update`, and caches held in a cache's attributes, as an
encoder-decoder's), so transformers is never imported here.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

_SAME_DTYPE = "_torchbridge_same_dtype_update"  # set on a layer whose update is wrapped
# What the wrapping puts in a layer's __dict__: a copy or a pickle of the layer leaves them
# out (its own reduction), and the copy is wrapped anew at its first call. Copied as they
# are, the copy's update was bound to the original layer and wrote into its tensors
# (transformers' prefix-cache reuse deep-copies a cache).
_OURS = frozenset({"update", _SAME_DTYPE, "__reduce_ex__"})


def same_dtype_updates(cache: Any) -> None:
    """Wrap the `update` of every fixed-size layer of `cache` (once each; the cache itself
    is otherwise left alone) so that keys and values reach it in one dtype. Under autocast
    a decoder's keys and values come in different dtypes, which such a layer cannot store.
    Anything else (a legacy tuple of tensors) holds no such layer and is left as it is."""
    for held in _caches(cache):
        for layer in held.layers:
            if hasattr(layer, "max_cache_len") and callable(getattr(layer, "update", None)) \
                    and not layer.__dict__.get(_SAME_DTYPE, False):
                layer.__dict__["update"] = _same_dtype_update(layer, layer.update)
                layer.__dict__[_SAME_DTYPE] = True
                layer.__dict__["__reduce_ex__"] = types.MethodType(_reduce_unwrapped, layer)


def _caches(cache: Any) -> Iterator[Any]:
    """The cache and the caches its attributes hold (an EncoderDecoderCache's two)."""
    if isinstance(getattr(cache, "layers", None), list):
        yield cache
    for value in getattr(cache, "__dict__", {}).values():
        if value is not cache and isinstance(getattr(value, "layers", None), list):
            yield value


def _same_dtype_update(layer: Any, update: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(update)
    def same_dtype(key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> Any:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if getattr(layer, "is_initialized", False) and isinstance(keys, torch.Tensor) \
                and isinstance(values, torch.Tensor):
            key_dtype, value_dtype = keys.dtype, values.dtype
        else:
            key_dtype = value_dtype = torch.promote_types(key_states.dtype, value_states.dtype)
        return update(key_states.to(key_dtype), value_states.to(value_dtype), *args, **kwargs)
    return same_dtype


def _reduce_unwrapped(layer: Any, protocol: int) -> tuple[Any, ...]:
    """copy.deepcopy and pickle of a wrapped layer: the layer as its class makes it, with
    its state but not the wrapping."""
    state = {k: v for k, v in layer.__dict__.items() if k not in _OURS}
    return _rebuilt, (type(layer), state)


def _rebuilt(cls: Any, state: dict[str, Any]) -> Any:
    layer = cls.__new__(cls)
    layer.__dict__.update(state)
    return layer
