"""Device memory management shared by every backend: OOM-protected allocation, a bounded
tensor pool, and the per-process memory cap.

Free and total memory come from the backend's memory-stats hook, so a vendor plugin's probe
seam (and the recorded devices in tests) decide what "free" is. Vendor plugins subclass
MemoryManager only to name it and to raise their own OutOfMemoryError subclass.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchbridge.devices import device_module
from torchbridge.errors import (
    ConfigurationError,
    DeviceError,
    OutOfMemoryError,
    TorchBridgeError,
)
from torchbridge.types import MIB, MemoryStats

if TYPE_CHECKING:
    from torchbridge.backend import Backend

logger = logging.getLogger(__name__)


def mib(value: int | None) -> str:
    """Bytes for a message: "90.0 MiB" (2**20 bytes), "unknown" for None."""
    return "unknown" if value is None else f"{value / MIB:.1f} MiB"


def memory_setting(backend: Backend, name: str) -> Any:
    """`name` ("max_memory_fraction", "enable_oom_protection", "oom_safety_margin") for this
    backend: its plugin's config section overrides `config.memory` when it sets the field
    (a section value of None means "use config.memory")."""
    section = backend.hardware_config
    value = getattr(section, name, None) if section is not None else None
    return getattr(backend.config.memory, name) if value is None else value


def apply_memory_fraction(backend: Backend) -> float | None:
    """Cap this process's share of device memory through the device module's
    set_per_process_memory_fraction (CUDA, ROCm, XPU). Returns the fraction applied."""
    fraction = memory_setting(backend, "max_memory_fraction")
    if fraction is None:
        return None
    module = device_module(backend.device)
    setter = getattr(module, "set_per_process_memory_fraction", None)
    if setter is None:
        # allocate_with_oom_protection plans within the fraction only where the backend
        # reports total memory (XLA on CPU reports none).
        try:
            total = backend.get_memory_stats().total_bytes
        except TorchBridgeError:
            total = None
        keeps = "only allocate_with_oom_protection keeps within it" if total is not None \
            else "nothing keeps within it: the backend reports no total memory"
        logger.warning("max_memory_fraction=%s is not enforced by the %s runtime; %s",
                       fraction, backend.name, keeps)
        return None
    for device in backend.devices:
        setter(fraction, device)
    logger.info("memory of %s capped at %.0f%% per device", backend.name, fraction * 100)
    return float(fraction)


def _cached_unused(stats: MemoryStats) -> int:
    """Bytes this process's caching allocator has reserved and not handed out (0 where the
    backend does not count both)."""
    reserved, allocated = stats.reserved_bytes, stats.allocated_bytes
    if reserved is None or allocated is None:
        return 0
    return max(0, reserved - allocated)


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Module-level so tests can make the device run out of memory.
    return torch.empty(shape, dtype=dtype, device=device)


def _addressable(tensor: torch.Tensor) -> bool:
    """Whether the tensor's storage has an address in this process. An XLA tensor's has
    none ("Attempted to access the data pointer on an invalid python storage"): it is a
    handle on a buffer the runtime owns, allocated when its graph runs."""
    try:
        tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return False
    return True


# How runtimes word running out of device memory where they raise no torch.OutOfMemoryError:
# XLA's "RESOURCE_EXHAUSTED: Out of memory allocating 4398046511104 bytes", surfacing at the
# sync that runs the graph (as the DeviceError of the synchronize hook).
_OUT_OF_MEMORY_WORDS = ("out of memory", "resource_exhausted")


def _out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, (RuntimeError, DeviceError)) and \
        any(word in str(exc).lower() for word in _OUT_OF_MEMORY_WORDS)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _shape(shape: Sequence[int] | torch.Size | int) -> tuple[int, ...]:
    try:
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
    except TypeError:  # 2.5: no int and nothing to iterate
        dims = (shape,)  # type: ignore[assignment]
    # A bool is an int to isinstance, but torch.empty refuses it: (True, 3) is no shape.
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ConfigurationError(f"shape must be non-negative integers, got {shape!r}",
                                 field="shape", value=shape)
    return dims


# What torch makes of Python's scalar types where it takes them for a dtype.
_PYTHON_TYPES = {bool: "torch.bool", int: "torch.int64", float: "torch.float64",
                 complex: "torch.complex128"}


def _dtype(dtype: object) -> torch.dtype:
    """`dtype` if it is a torch.dtype; else a ConfigurationError naming it (a name such as
    "float32" or Python's float is not one)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, type):
        shown = f"the Python type {dtype.__name__}"
        meant = _PYTHON_TYPES.get(dtype)
    else:
        shown = f"{dtype!r} of type {type(dtype).__name__}"
        meant = f"torch.{dtype}" if isinstance(dtype, str) and \
            isinstance(getattr(torch, dtype, None), torch.dtype) else None
    hint = f"; did you mean {meant}?" if meant else ""
    raise ConfigurationError(f"dtype must be a torch.dtype such as torch.float32, got "
                             f"{shown}{hint}", field="dtype", value=dtype)


@dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    dropped: int = 0  # returned while the pool was full, left to the allocator
    refused: int = 0  # a view, an empty or non-contiguous tensor, a buffer already pooled
    tensors: int = 0
    bytes: int = 0  # of the pooled tensors' storages


def _storage_bytes(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().nbytes())


def _refusal(tensor: torch.Tensor) -> str | None:
    """Why `tensor` cannot be pooled: the pool hands out whole buffers of a shape as they
    are, so a tensor must be its storage, all of it, in the contiguous layout a caller of
    allocate_tensor gets from torch.empty. A one-element view of a 200 MiB tensor would
    keep the 200 MiB alive while counting 4 bytes."""
    if not _addressable(tensor):
        # Nothing to keep or hand out again: the runtime owns the buffer.
        return f"its storage has no address this process can reuse ({tensor.device.type} " \
               "tensors are buffers its runtime owns)"
    storage = _storage_bytes(tensor)
    if storage == 0:
        return "it holds no memory"
    if tensor.storage_offset() != 0 or tensor.nbytes != storage:
        return (f"it is a view ({tensor.nbytes} bytes of a {storage}-byte storage); return "
                "the tensor that owns the storage")
    if not tensor.is_contiguous():
        # It is all of its storage, but allocate_tensor hands pooled tensors out as they
        # are, and a caller asking for a shape gets torch.empty's contiguous layout.
        return (f"it is not contiguous (stride {tuple(tensor.stride())} for shape "
                f"{tuple(tensor.shape)}): the pool keeps contiguous tensors only, the layout "
                "allocate_tensor hands out")
    return None


class MemoryManager:
    """Allocation helpers for one backend's device.

    `allocate_with_oom_protection` checks free memory against the request times a safety
    margin before allocating; if the allocator still runs out it empties the cache and
    retries once, then raises OutOfMemoryError with requested, free and total (in MiB).

    The pool keeps returned tensors per `pool_id` and hands them out again for the same
    shape and dtype (contents are not cleared, as with torch.empty). It is bounded: at most
    `pool_max_tensors` tensors and `pool_max_bytes` bytes per pool, counted by storage; a
    tensor returned to a full pool is dropped and freed normally. A buffer is in the pools
    at most once (a second return of it is refused), and only a contiguous tensor that is
    its whole storage is kept (a view or a transposed tensor is refused). The pool is safe
    to use from several threads.
    """

    oom_error: type[OutOfMemoryError] = OutOfMemoryError

    def __init__(self, backend: Backend, *, pool_max_tensors: int = 64,
                 pool_max_bytes: int | None = None) -> None:
        def bad(limit: object) -> bool:
            return isinstance(limit, bool) or not isinstance(limit, int) or limit < 0

        if bad(pool_max_tensors) or (pool_max_bytes is not None and bad(pool_max_bytes)):
            raise ConfigurationError("pool limits must be integers >= 0, got "
                                     f"pool_max_tensors={pool_max_tensors}, "
                                     f"pool_max_bytes={pool_max_bytes}")
        self.backend = backend
        self.device = backend.device
        self.pool_max_tensors = pool_max_tensors
        self.pool_max_bytes = pool_max_bytes
        self._pools: dict[str, dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]]] = {}
        self._stats: dict[str, PoolStats] = {}
        self._pooled: dict[int, str] = {}  # storage address -> pool holding it
        self._lock = threading.Lock()

    def get_memory_stats(self) -> Any:
        return self.backend.get_memory_stats()

    # -- OOM protection -------------------------------------------------------------------
    def _oom(self, requested: int, margin: float, why: str) -> OutOfMemoryError:
        stats = self.backend.get_memory_stats()
        cached = _cached_unused(stats)
        also = f" + {mib(cached)} reserved by this process's allocator and unused" \
            if cached else ""
        return self.oom_error(
            f"cannot allocate {mib(requested)} on {self.device} ({why}): requested "
            f"{mib(requested)} x safety margin {margin:g} = {mib(int(requested * margin))}, "
            f"free {mib(stats.free_bytes)}{also}, total {mib(stats.total_bytes)}")

    def check_allocation(self, nbytes: int, safety_margin: float | None = None) -> None:
        """Raise OutOfMemoryError if `nbytes` x margin exceeds free memory: the device's,
        plus what this process's allocator has reserved and does not use. Where the backend
        cannot tell free memory the check passes and the allocator decides. A byte count
        that is negative, not whole, not finite or not a number is a ConfigurationError."""
        try:  # NumPy's and torch's numbers too (np.prod(shape) * 4, a 0-d tensor)
            count = float(nbytes) if not isinstance(nbytes, (bool, str, bytes)) else None
        except (TypeError, ValueError, RuntimeError):
            count = None
        if count is None or not 0 <= count < math.inf or not count.is_integer():
            raise ConfigurationError(f"nbytes must be a byte count >= 0, got {nbytes!r}",
                                     field="nbytes", value=nbytes)
        margin = self._margin(safety_margin)
        stats = self.backend.get_memory_stats()
        free, why = stats.free_bytes, "not enough free memory"
        if free is not None:
            # The device's free memory (cudaMemGetInfo) leaves out the blocks this process's
            # caching allocator holds unused; it serves a request from them, or releases
            # them and retries, before it fails.
            free += _cached_unused(stats)
        fraction = memory_setting(self.backend, "max_memory_fraction")
        total, allocated = stats.total_bytes, stats.allocated_bytes
        if fraction is not None and total is not None and allocated is not None:
            # Also where the runtime enforces no cap (XLA), plan within the configured share.
            budget = int(fraction * total) - allocated
            if free is None or budget < free:
                free, why = budget, f"over max_memory_fraction {fraction:g}"
        if free is not None and count * margin > free:
            raise self._oom(int(count), margin, why)

    def _margin(self, safety_margin: float | None) -> float:
        margin = memory_setting(self.backend, "oom_safety_margin") \
            if safety_margin is None else safety_margin
        if not (isinstance(margin, (int, float)) and 1.0 <= margin < math.inf):
            raise ConfigurationError(f"safety_margin must be >= 1.0 and finite, got "
                                     f"{margin!r}", field="safety_margin", value=margin)
        return float(margin)

    def allocate_with_oom_protection(self, shape: Sequence[int] | torch.Size | int,
                                     dtype: torch.dtype = torch.float32,
                                     safety_margin: float | None = None) -> torch.Tensor:
        dims, dtype = _shape(shape), _dtype(dtype)
        if not memory_setting(self.backend, "enable_oom_protection"):
            return _allocate(dims, dtype, self.device)
        nbytes = _nbytes(dims, dtype)
        margin = self._margin(safety_margin)
        self.check_allocation(nbytes, margin)
        try:
            return self._allocated(dims, dtype)
        except (RuntimeError, DeviceError) as exc:
            if not _out_of_memory(exc):
                raise
            logger.info("allocation of %s on %s failed; emptying the cache and retrying "
                        "once", mib(nbytes), self.device)
        self.backend.empty_cache()
        try:
            return self._allocated(dims, dtype)
        except (RuntimeError, DeviceError) as exc:
            if not _out_of_memory(exc):
                raise
            raise self._oom(nbytes, margin, "the allocator failed again after emptying "
                                            "the cache") from exc

    def _allocated(self, dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new tensor whose memory the device has given: on a lazy device (XLA) torch.empty
        only records it, and running out of memory would surface at some later sync, far
        from here (4 TiB "allocated" without an error); the sync runs it now."""
        tensor = _allocate(dims, dtype, self.device)
        if not _addressable(tensor):
            self.backend.synchronize()
        return tensor

    # -- pool -----------------------------------------------------------------------------
    def allocate_tensor(self, shape: Sequence[int] | torch.Size | int,
                        dtype: torch.dtype = torch.float32, pool_id: str = "default"
                        ) -> torch.Tensor:
        """A tensor from pool `pool_id` if one of this shape and dtype is there (a hit),
        else a new OOM-protected allocation (a miss). Contents are uninitialized."""
        dims, dtype = _shape(shape), _dtype(dtype)
        with self._lock:
            stats = self._stats.setdefault(pool_id, PoolStats())
            bucket = self._pools.get(pool_id, {}).get((dims, dtype))
            if bucket:
                tensor = bucket.pop()
                del self._pooled[tensor.untyped_storage().data_ptr()]
                stats.hits += 1
                stats.tensors -= 1
                stats.bytes -= _storage_bytes(tensor)
                return tensor
            stats.misses += 1
        return self.allocate_with_oom_protection(dims, dtype)

    def return_to_pool(self, tensor: torch.Tensor, pool_id: str = "default") -> bool:
        """Keep `tensor` for reuse. False when it was not kept: the pool is full (dropped),
        or it is a view, empty, not contiguous, a buffer its runtime owns (XLA), or already
        in a pool (refused)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"return_to_pool takes a tensor, got {type(tensor).__name__}")
        if tensor.device != self.device:
            raise ValueError(f"tensor is on {tensor.device}; this pool holds {self.device}")
        refusal = _refusal(tensor)
        nbytes = 0 if refusal else _storage_bytes(tensor)
        address = None if refusal else tensor.untyped_storage().data_ptr()
        with self._lock:
            stats = self._stats.setdefault(pool_id, PoolStats())
            if refusal is None and address in self._pooled:
                # Pooled twice, the buffer would go to two callers at once.
                logger.warning("return_to_pool refused a tensor: its buffer is already in "
                               "pool %r (returned twice?)", self._pooled[address])
                stats.refused += 1
                return False
            if refusal is not None:
                logger.debug("return_to_pool refused a tensor: %s", refusal)
                stats.refused += 1
                return False
            too_many = stats.tensors + 1 > self.pool_max_tensors
            too_big = self.pool_max_bytes is not None and \
                stats.bytes + nbytes > self.pool_max_bytes
            if too_many or too_big:
                stats.dropped += 1
                return False
            key = (tuple(tensor.shape), tensor.dtype)
            # A pooled buffer handed out again must not carry autograd history.
            kept = tensor.detach() if tensor.requires_grad else tensor
            self._pools.setdefault(pool_id, {}).setdefault(key, []).append(kept)
            assert address is not None  # refused above otherwise
            self._pooled[address] = pool_id
            stats.tensors += 1
            stats.bytes += nbytes
            return True

    def clear_pool(self, pool_id: str | None = None) -> int:
        """Drop the pooled tensors of `pool_id` (all pools if None) and empty the device
        cache. Returns the bytes released from the pools."""
        released = 0
        with self._lock:
            ids = list(self._pools) if pool_id is None else [pool_id]
            for pid in ids:
                for bucket in self._pools.pop(pid, {}).values():
                    for tensor in bucket:
                        self._pooled.pop(tensor.untyped_storage().data_ptr(), None)
                stats = self._stats.get(pid)
                if stats is not None:
                    released += stats.bytes
                    stats.tensors, stats.bytes = 0, 0
        self.backend.empty_cache()
        return released

    def pool_stats(self, pool_id: str | None = None) -> dict[str, dict[str, int]]:
        """{pool_id: {"hits", "misses", "dropped", "refused", "tensors", "bytes"}}."""
        with self._lock:
            ids = list(self._stats) if pool_id is None else [pool_id]
            return {pid: vars(self._stats.get(pid, PoolStats())).copy() for pid in ids}
