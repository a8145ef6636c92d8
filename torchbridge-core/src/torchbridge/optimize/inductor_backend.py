"""Inductor as the compile pass's backend, with FX graph cache keys that do not depend on
Python's string hashing and that hold the values of frozen weights (prepacked ones too).

Inductor keys its FX graph cache on a pickle of the graph module, and that pickle holds the
module's `_non_persistent_buffers_set`: a set of strings, whose order follows each
process's string hashes (PYTHONHASHSEED). Under inductor freezing a model's non-persistent
buffers become frozen constants listed in that set (BERT's position_ids and token_type_ids:
{'_frozen_param41', '_frozen_param42'}), so with two or more of them a second process
computed another key about every other time and compiled again (torch 2.13, the
benchmark's BERT at O3: the second process missed the cache in 4 of 4 process pairs, and hit
in 3 of 3 with this backend; tests/test_compile_cache.py sets the hash seeds). The backend
here is `backend="inductor"` with that one set pickling in sorted order.

Frozen weights are keyed by their values. Inductor keys a frozen constant (a weight
under freezing) by its metadata only, and a cache hit takes its values from the model
being prepared; but a compiled graph can hold what it read of those values when it was
compiled: a 0-d weight's value written into the code (CLIP's logit_scale), constants
its lowerings derive from a weight (max_autotune's re-blocked GEMM weights, int8
compensation terms), stored in the cache entry by value. A second model of the same shapes
then got the first one's (a review found 2-3% off, under prepare_model's drift check, and
the first model's weights mixed with the second's biases). And for weights prepacked for
oneDNN (inductor's cpp.weight_prepack under freezing), inductor bypasses its cache
altogether ("mkldnn tensors unpickleable"), so every float graph O3 compiled on a CPU was
compiled again by each new process. While this backend compiles, every frozen constant,
oneDNN or not, is keyed by its metadata and a digest of its values: the same model hits
the cache in any process, with prepacked weights too, and a model with other weights
compiles its own graph. What that costs is kept small: each constant's digest is computed
once a compile, though inductor pickles a graph's constants twice as it keys the graph (for
the key, and for the key's debug lines); the constants the graph no longer reads (the float
weights prepacking replaced, still the graph module's buffers) are keyed by their metadata
only; and the digest is SHA-256 (1.2 GB/s on a core of the 2-core Xeon with AMX, with SHA
extensions, against 1.0 GB/s for BLAKE2b). The reference MLP at O3 (48 MB of bfloat16
weights, prepacked) hashed 0.32 s in its first call before, 0.06 s after.
Torch versions whose cache is laid out otherwise keep their own behaviour
(`prepacked_graphs_cacheable()` says which).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import operator
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


def _frozen(t: torch.Tensor) -> bool:
    return bool(getattr(t, "_is_frozen_param", False))


def _digest(t: torch.Tensor) -> str:
    """A digest of the tensor's values (a oneDNN tensor's in plain layout), read in place
    where it is a contiguous CPU tensor already."""
    dense = t.to_dense() if t.is_mkldnn else t
    dense = dense.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    digest = hashlib.sha256()
    nbytes = dense.numel() * dense.element_size()
    if nbytes:
        digest.update((ctypes.c_char * nbytes).from_address(dense.data_ptr()))
    return digest.hexdigest()


# What one compile on this thread keys (set by _compile_inner, None outside a compile):
# `digests`, id -> (tensor, digest), the tensor held so that its id is not reused; `unread`,
# id -> tensor, the frozen constants the graph holds but never reads.
_compiling = threading.local()


def _digest_once(t: torch.Tensor) -> str:
    """_digest(t), computed once per compile: inductor pickles the graph's constants for its
    cache key and again for the key's debug lines."""
    digests: dict[int, tuple[torch.Tensor, str]] | None = getattr(_compiling, "digests", None)
    if digests is None:
        return _digest(t)
    seen = digests.get(id(t))
    if seen is None or seen[0] is not t:
        seen = digests[id(t)] = (t, _digest(t))
    return seen[1]


def _unread(t: torch.Tensor) -> bool:
    unread: dict[int, torch.Tensor] | None = getattr(_compiling, "unread", None)
    return unread is not None and unread.get(id(t)) is t


def unread_constants(gm: torch.fx.GraphModule) -> dict[int, torch.Tensor]:
    """The frozen constants `gm` holds that its graph reads nowhere, by id: the float
    weights that weight prepacking replaced by their oneDNN copies (the graph reads those),
    still the module's buffers. Their values cannot reach the compiled code, so they are
    keyed by their metadata only (the reference MLP's 48 MB of them were hashed in each of
    its compiles). Empty where the graph might read a tensor other than through a
    get_attr node of its own that names a tensor (a submodule it calls, a subgraph): every
    frozen constant is then hashed."""
    read: set[int] = set()
    for node in gm.graph.nodes:
        if node.op == "call_module":
            return {}
        if node.op == "get_attr":
            try:
                value = operator.attrgetter(str(node.target))(gm)
            except AttributeError:
                return {}
            if not isinstance(value, torch.Tensor):
                return {}
            read.add(id(value))
    held = [*gm.parameters(), *gm.buffers(),
            *(v for v in vars(gm).values() if isinstance(v, torch.Tensor))]
    return {id(t): t for t in held if _frozen(t) and id(t) not in read}


def _metadata(t: torch.Tensor) -> tuple[Any, ...]:
    # A oneDNN tensor has no strides or storage (inductor's metadata extraction fails on
    # it); a strided one's layout is in its strides, which the value digest leaves out.
    strides = () if t.is_mkldnn else tuple(t.stride())
    return (str(t.layout), str(t.dtype), tuple(t.shape), strides, str(t.device))


def _patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for this torch's FX graph cache, or [] where it is
    laid out otherwise than torch 2.9-2.13's."""
    try:
        from torch._inductor import codecache
    except Exception:  # no inductor: nothing to patch
        return []
    pickler = getattr(codecache, "FxGraphCachePickler", None)
    reduce_tensor = vars(pickler).get("_reduce_tensor") if pickler is not None else None
    bypass = getattr(codecache, "BypassFxGraphCache", None)
    if not callable(reduce_tensor) or not isinstance(bypass, type):
        return []

    def keyed_reduce(self: Any, t: torch.Tensor) -> Any:
        if not _frozen(t):
            return reduce_tensor(self, t)
        if _unread(t):
            return _ident, (("frozen constant the graph does not read", _metadata(t)),)
        try:
            key = ("frozen constant", _metadata(t), _digest_once(t))
        except Exception as exc:  # a tensor that cannot be read so: not cached, as before
            raise bypass(f"frozen constant not hashable ({type(exc).__name__})") from exc
        return _ident, (key,)

    patches: list[tuple[Any, str, Any]] = [(pickler, "_reduce_tensor", keyed_reduce)]
    # torch 2.13 also checks a graph's constants before keying it (torch 2.9 does not).
    validator = getattr(codecache, "CacheabilityValidator", None)
    check = vars(validator).get("check_tensor") if validator is not None else None
    check_tensor = check.__func__ if isinstance(check, staticmethod) else None
    if check_tensor is not None:
        def keyed_check(t: torch.Tensor) -> None:
            if not (t.is_mkldnn and _frozen(t)):
                check_tensor(t)
        patches.append((validator, "check_tensor", staticmethod(keyed_check)))
    return patches


_lock = threading.Lock()
_depth = 0
_saved: list[tuple[Any, str, Any]] = []


@contextlib.contextmanager
def _frozen_weights_keyed_by_value() -> Iterator[None]:
    """While inside (nested and across threads: the outermost entry patches, the last
    exit restores), inductor keys frozen weights by their values, prepacked ones too."""
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
    """Whether this torch's FX graph cache keeps graphs with prepacked weights, keyed by
    their values, when this backend compiles them."""
    return bool(_patches())


def _compile_inner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                   **kwargs: Any) -> Any:
    from torch._inductor.compile_fx import compile_fx_inner

    names = gm.__dict__.get("_non_persistent_buffers_set")
    if type(names) is set and len(names) > 1:
        gm.__dict__["_non_persistent_buffers_set"] = _SortedWhenPickled(names)
    outer = getattr(_compiling, "digests", None), getattr(_compiling, "unread", None)
    _compiling.digests, _compiling.unread = {}, unread_constants(gm)
    try:
        with _frozen_weights_keyed_by_value():
            return compile_fx_inner(gm, example_inputs, **kwargs)
    finally:
        _compiling.digests, _compiling.unread = outer


def inductor(options: dict[str, Any] | None) -> Callable[..., Any]:
    """A torch.compile backend: inductor with `options` (what torch.compile(options=...)
    would pass it), its cache keys stable across processes."""
    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, inner_compile=_compile_inner,
                          config_patches=dict(options or {}))
    return backend
