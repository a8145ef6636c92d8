"""Inductor as the compile pass's backend, with FX graph cache keys that do not depend on
Python's string hashing, and graphs with prepacked weights kept in the cache.

Inductor keys its FX graph cache on a pickle of the graph module, and that pickle holds the
module's `_non_persistent_buffers_set`: a set of strings, whose order follows each
process's string hashes (PYTHONHASHSEED). Under inductor freezing a model's non-persistent
buffers become frozen constants listed in that set (BERT's position_ids and token_type_ids:
{'_frozen_param41', '_frozen_param42'}), so with two or more of them a second process
computed another key about every other time and compiled again (torch 2.13, the
benchmark's BERT at O3: the second process missed the cache in 4 of 4 process pairs, and hit
in 3 of 3 with this backend; tests/test_compile_cache.py sets the hash seeds). The backend
here is `backend="inductor"` with that one set pickling in sorted order.

Weights prepacked for oneDNN (inductor's cpp.weight_prepack under freezing) are oneDNN
tensors, and inductor bypasses its FX graph cache for any graph holding one ("mkldnn
tensors unpickleable"), so every float graph O3 compiled on a CPU was compiled again by
each new process. Yet such a weight is a frozen constant, which the cache never stores:
for frozen constants inductor keys on the metadata only, and a cache hit takes their
values from the graph module of the process that loads it (CompiledFxGraphConstantsWithGm;
freezing, and so the prepacking, runs before the lookup). So while this backend compiles,
a oneDNN tensor that freezing made (marked a frozen parameter) is keyed by its dtype,
shape and device, as inductor keys other frozen constants, instead of making the graph
uncacheable. Any other oneDNN tensor still bypasses the cache. Torch versions whose cache
is laid out otherwise keep their own behaviour (`prepacked_graphs_cacheable()` says which).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch


class _SortedWhenPickled(set):  # type: ignore[type-arg]
    """A set whose pickle lists its items sorted: the same bytes in every process."""

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (sorted(self, key=repr),)


def _ident(value: Any) -> Any:
    return value


def _inlined(t: torch.Tensor) -> bool:
    """Whether inductor writes this constant's values into the generated code (then they
    must stay in the key): small 1-d tensors. Any 1-d tensor where that rule cannot be read."""
    try:
        from torch._inductor.graph import GraphLowering

        return bool(GraphLowering.can_inline_constant(t))
    except Exception:  # another torch's layout: the safe side
        return t.dim() == 1


def _is_prepacked_constant(t: torch.Tensor) -> bool:
    return bool(t.is_mkldnn and getattr(t, "_is_frozen_param", False)) and not _inlined(t)


def _prepacked_key(t: torch.Tensor) -> tuple[Any, ...]:
    # What inductor's own key holds for a frozen constant, as far as a oneDNN tensor has it
    # (no strides, no storage: extract_tensor_metadata fails on it).
    return ("oneDNN frozen constant", str(t.dtype), tuple(t.shape), str(t.device))


def _patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for this torch's FX graph cache, or [] where it is
    laid out otherwise than torch 2.9-2.13's."""
    try:
        from torch._inductor import codecache
    except Exception:  # no inductor: nothing to patch
        return []
    pickler = getattr(codecache, "FxGraphCachePickler", None)
    reduce_tensor = vars(pickler).get("_reduce_tensor") if pickler is not None else None
    if not callable(reduce_tensor):
        return []

    def keyed_reduce(self: Any, t: torch.Tensor) -> Any:
        if _is_prepacked_constant(t):
            return _ident, (_prepacked_key(t),)
        return reduce_tensor(self, t)

    patches: list[tuple[Any, str, Any]] = [(pickler, "_reduce_tensor", keyed_reduce)]
    # torch 2.13 also checks a graph's constants before keying it (torch 2.9 does not).
    validator = getattr(codecache, "CacheabilityValidator", None)
    check = vars(validator).get("check_tensor") if validator is not None else None
    check_tensor = check.__func__ if isinstance(check, staticmethod) else None
    if check_tensor is not None:
        def keyed_check(t: torch.Tensor) -> None:
            if not _is_prepacked_constant(t):
                check_tensor(t)
        patches.append((validator, "check_tensor", staticmethod(keyed_check)))
    return patches


_lock = threading.Lock()
_depth = 0
_saved: list[tuple[Any, str, Any]] = []


@contextlib.contextmanager
def _prepacked_weights_keyed() -> Iterator[None]:
    """While inside (nested and across threads: the outermost entry patches, the last
    exit restores), inductor keys prepacked frozen weights instead of bypassing its cache."""
    global _depth
    with _lock:
        if _depth == 0:
            for owner, name, replacement in _patches():
                _saved.append((owner, name, vars(owner)[name]))
                setattr(owner, name, replacement)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                while _saved:
                    owner, name, original = _saved.pop()
                    setattr(owner, name, original)


def prepacked_graphs_cacheable() -> bool:
    """Whether this torch's FX graph cache keeps graphs with prepacked weights when this
    backend compiles them."""
    return bool(_patches())


def _compile_inner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                   **kwargs: Any) -> Any:
    from torch._inductor.compile_fx import compile_fx_inner

    names = gm.__dict__.get("_non_persistent_buffers_set")
    if type(names) is set and len(names) > 1:
        gm.__dict__["_non_persistent_buffers_set"] = _SortedWhenPickled(names)
    with _prepacked_weights_keyed():
        return compile_fx_inner(gm, example_inputs, **kwargs)


def inductor(options: dict[str, Any] | None) -> Callable[..., Any]:
    """A torch.compile backend: inductor with `options` (what torch.compile(options=...)
    would pass it), its cache keys stable across processes."""
    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, inner_compile=_compile_inner,
                          config_patches=dict(options or {}))
    return backend
