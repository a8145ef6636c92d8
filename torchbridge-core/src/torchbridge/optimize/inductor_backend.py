"""Inductor as the compile pass's backend, with FX graph cache keys that do not depend on
Python's string hashing.

Inductor keys its FX graph cache on a pickle of the graph module, and that pickle holds the
module's `_non_persistent_buffers_set`: a set of strings, whose order follows each
process's string hashes (PYTHONHASHSEED). Under inductor freezing a model's non-persistent
buffers become frozen constants listed in that set (BERT's position_ids and token_type_ids:
{'_frozen_param41', '_frozen_param42'}), so with two or more of them a second process
computed another key about every other time and compiled again (torch 2.13, the
benchmark's BERT at O3: the second process missed the cache in 4 of 4 process pairs, and hit
in 3 of 3 with this backend; tests/test_compile_cache.py sets the hash seeds). The backend
here is `backend="inductor"` with that one set pickling in sorted order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class _SortedWhenPickled(set):  # type: ignore[type-arg]
    """A set whose pickle lists its items sorted: the same bytes in every process."""

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (sorted(self, key=repr),)


def _compile_inner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                   **kwargs: Any) -> Any:
    from torch._inductor.compile_fx import compile_fx_inner

    names = gm.__dict__.get("_non_persistent_buffers_set")
    if type(names) is set and len(names) > 1:
        gm.__dict__["_non_persistent_buffers_set"] = _SortedWhenPickled(names)
    return compile_fx_inner(gm, example_inputs, **kwargs)


def inductor(options: dict[str, Any] | None) -> Callable[..., Any]:
    """A torch.compile backend: inductor with `options` (what torch.compile(options=...)
    would pass it), its cache keys stable across processes."""
    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, inner_compile=_compile_inner,
                          config_patches=dict(options or {}))
    return backend
