"""Plain records shared by every backend: what was detected, a device's description, memory.

Dataclasses rather than pydantic models: they are built on hot paths (detection, memory
polling) and must not pull pydantic (or torch) into `import torchbridge`.

Units: memory is counted in bytes (`MemoryStats`); every figure for people is binary, MiB
(2**20 bytes) or GiB (2**30 bytes), named so. The names the seeds used say MB and GB but
hold binary units: `DeviceInfo.memory_total_gb` is GiB, `stats["allocated"]` MiB.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MIB = 1024 * 1024
GIB = 1024 * 1024 * 1024
_MB = MIB  # the seeds' names for these binary units
_GB = GIB


@dataclass(frozen=True)
class Detection:
    """What a plugin found for one backend. Returned by the `torchbridge_detect` hook.

    `reason` says why the backend is unavailable; when available it may describe what
    was found (e.g. "XLA on CPU"). Higher `priority` wins selection. `device_type` is a
    torch device type ("cuda", "xpu", "cpu", ...) or one your plugin declared through
    `torchbridge.devices.declare_device_type` before returning the Detection.

    `fallbacks` names the core's answers this backend opts into for device-level hooks
    its own plugin leaves unanswered: "generic" (any torch accelerator through
    `torch.get_device_module`) and "cpu" (the host CPU's description and memory, for a
    backend whose device type is "cpu"). `()` opts into none. `None`, the default of
    plugins written before fallbacks existed, keeps their old behaviour (the fallback for
    the device type answers) with a DeprecationWarning; the contract suite fails it.
    """

    name: str
    available: bool
    priority: int
    device_type: str = "cpu"
    device_count: int = 0
    vendor: str | None = None
    reason: str | None = None
    fallbacks: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ProbeResult:
    """What a plugin's probe seam found: whether its devices are usable, how many, and if
    not, why. Tests replace a probe with recorded results of real machines."""

    available: bool
    device_count: int
    reason: str | None


@dataclass(frozen=True)
class BackendStatus:
    """One row of `list_backends()`: a detection plus where it came from."""

    name: str
    available: bool
    priority: int
    device_type: str
    device_count: int
    vendor: str | None
    reason: str | None
    plugin: str | None
    install_hint: str | None = None
    fallbacks: tuple[str, ...] | None = None  # as the Detection declared them
    detect_seconds: float | None = None  # the plugin's whole torchbridge_detect call
    # Whether auto-selection found it answering its device hooks (device_info and
    # memory_stats of device 0): None not asked (yet), "ok", else why it was passed over.
    health: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DeviceInfo:
    """Description of one device. The first six fields are the seeds' DeviceInfo.

    `memory_total_gb` and `memory_available_gb` are in GiB (2**30 bytes; the seeds' names
    say GB), None where the backend cannot tell.
    """

    name: str
    backend: str
    memory_total_gb: float | None
    memory_available_gb: float | None
    compute_capability: str | None
    supported_dtypes: list[str]
    vendor: str | None = None
    architecture: str | None = None
    preferred_low_precision_dtype: str | None = None
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)
    notes: str | None = None

    @property
    def low_precision_dtype(self) -> torch.dtype | None:
        """The preferred low-precision dtype as a torch.dtype (None: stay in float32)."""
        if self.preferred_low_precision_dtype is None:
            return None
        import torch

        dtype: torch.dtype = getattr(torch, self.preferred_low_precision_dtype)
        return dtype

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Suffix of a `stats[...]` key -> bytes per unit. All binary: the seeds' bare names answer
# in MiB and their "_gb" in GiB; "_mib" and "_gib" say so.
_UNITS = {"": MIB, "_mb": MIB, "_mib": MIB, "_gb": GIB, "_gib": GIB, "_bytes": 1}
_SEED_UNITS = _UNITS  # the name code written against earlier versions may import
_FIELDS = ("allocated", "reserved", "peak_allocated", "free", "total")


@dataclass(frozen=True)
class MemoryStats:
    """Memory of one device in bytes, the same fields on every backend.

    A figure the backend cannot know is None, never 0; `notes` says why. For code written
    against the seeds, `stats["allocated"]` answers in MiB (2**20 bytes; the seeds called
    it MB, and `stats["allocated_mb"]` is the same number), `stats["allocated_gb"]` in GiB
    (2**30 bytes); `stats["allocated_mib"]`, `stats["allocated_gib"]` name the units
    exactly and `stats["allocated_bytes"]` is the field itself (None stays None). The
    same suffixes work for reserved, peak_allocated, free and total.
    """

    device: str
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    free_bytes: int | None = None
    total_bytes: int | None = None
    notes: str | None = None

    def __getitem__(self, key: str) -> float | int | None:
        for suffix, unit in sorted(_UNITS.items(), key=lambda kv: -len(kv[0])):
            base = key[: len(key) - len(suffix)] if suffix else key
            if key.endswith(suffix) and base in _FIELDS:
                value: int | None = getattr(self, f"{base}_bytes")
                if value is None or unit == 1:
                    return value
                return value / unit
        raise KeyError(f"{key!r}: memory stats have {', '.join(_FIELDS)} "
                       "(in MiB), with _mib, _gib or _bytes suffixes for other units")

    def keys(self) -> list[str]:
        return list(_FIELDS)

    @classmethod
    def from_caching_allocator(cls, device: torch.device | str,
                               counters: tuple[int | None, int | None, int | None],
                               free: int | None,
                               total: int | None, free_total_source: str) -> MemoryStats:
        """The stats of a GPU backend built on torch's caching allocator: `counters` are
        its (allocated, reserved, peak allocated) bytes in this process, `free` and `total`
        the device's as the runtime reports them (None where it cannot), and
        `free_total_source` says where those came from (it opens the notes)."""
        allocated, reserved, peak = counters
        return cls(device=str(device), allocated_bytes=allocated, reserved_bytes=reserved,
                   peak_allocated_bytes=peak, free_bytes=free, total_bytes=total,
                   notes=f"{free_total_source}; allocated, reserved and peak are this "
                         "process's caching allocator")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class DeviceCount(int):
    """An int that can also be called, for the vendor device managers: the seeds use both
    `manager.device_count` and `manager.device_count()`."""

    def __call__(self) -> int:
        return int(self)
