"""The Backend facade: one class for every backend; plugins answer through hooks."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchbridge.errors import DeviceError
from torchbridge.plugins import get_plugin_host
from torchbridge.types import BackendStatus, DeviceInfo, MemoryStats

if TYPE_CHECKING:
    from torch import nn

    from torchbridge.config import TorchBridgeConfig
    from torchbridge.optimize.report import OptimizationResult

logger = logging.getLogger(__name__)


class Backend:
    """A usable backend: its devices, their memory, synchronization, autocast, and
    prepare_model. Get one from `torchbridge.get_backend()`."""

    def __init__(self, status: BackendStatus, config: TorchBridgeConfig, index: int = 0) -> None:
        if not status.available:
            from torchbridge.errors import BackendUnavailableError

            raise BackendUnavailableError(f"backend {status.name!r} is unavailable: "
                                          f"{status.reason}", backend=status.name)
        self.status = status
        self.config = config
        self._hooks = get_plugin_host().hook
        self._index = self._check_index(index)
        logging.getLogger("torchbridge").setLevel(config.logging_level)
        from torchbridge.cpu import apply_thread_setting
        from torchbridge.memory import apply_memory_fraction

        apply_thread_setting(config)
        apply_memory_fraction(self)
        logger.info("backend %s selected (%d device(s), plugin %s)", status.name,
                    status.device_count, status.plugin)

    # -- identity -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.status.name

    @property
    def vendor(self) -> str | None:
        return self.status.vendor

    @property
    def is_available(self) -> bool:
        return self.status.available

    @property
    def device_count(self) -> int:
        return self.status.device_count

    @property
    def hardware_config(self) -> Any:
        """This backend's config section, `config.hardware.<plugin name>` (e.g.
        `config.hardware.nvidia` for cuda), or None when its plugin has none."""
        if self.status.plugin is None:
            return None
        return getattr(self.config.hardware, self.status.plugin, None)

    def memory_manager(self, **pool_limits: Any) -> Any:
        """A `torchbridge.memory.MemoryManager` for this backend's device."""
        from torchbridge.memory import MemoryManager

        return MemoryManager(self, **pool_limits)

    def _check_index(self, index: int | None) -> int:
        index = self._index if index is None else index
        if not isinstance(index, int) or not 0 <= index < self.device_count:
            raise DeviceError(f"{self.name} has {self.device_count} device(s); "
                              f"index {index!r} does not exist")
        return index

    def device_at(self, index: int | None = None) -> torch.device:
        index = self._check_index(index)
        if self.status.device_type == "cpu":
            return torch.device("cpu")  # so that tensor.device == backend.device holds
        return torch.device(self.status.device_type, index)

    @property
    def device(self) -> torch.device:
        """The torch device tensors and models go to."""
        return self.device_at(None)

    @property
    def devices(self) -> list[torch.device]:
        return [self.device_at(i) for i in range(self.device_count)]

    def __repr__(self) -> str:
        return f"Backend(name={self.name!r}, device={str(self.device)!r}, " \
               f"device_count={self.device_count})"

    # -- description and memory -----------------------------------------------------------
    def get_device_info(self, index: int = 0) -> DeviceInfo:
        device = self.device_at(index)
        info: DeviceInfo | None = self._hooks.torchbridge_device_info(
            backend_name=self.name, device=device)
        if info is None:
            raise DeviceError(f"no plugin describes {device} of backend {self.name!r}")
        if info.vendor is None and self.vendor is not None:
            info = dataclasses.replace(info, vendor=self.vendor)
        return info

    def get_memory_stats(self, index: int | None = None) -> MemoryStats:
        """Memory in bytes (None where unknowable); `stats["allocated"]` gives MB."""
        device = self.device_at(index)
        stats: MemoryStats | None = self._hooks.torchbridge_memory_stats(
            backend_name=self.name, device=device)
        if stats is None:
            return MemoryStats(device=str(device), notes=f"no plugin reports memory of {device}")
        return stats

    def _device_call(self, hook: str, index: int | None) -> None:
        device = self.device_at(index)
        done = getattr(self._hooks, hook)(backend_name=self.name, device=device)
        if done is None:
            raise DeviceError(f"no plugin implements {hook} for {device} ({self.name})")

    def empty_cache(self) -> None:
        self._device_call("torchbridge_empty_cache", None)

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        self._device_call("torchbridge_reset_peak_memory_stats", index)

    def synchronize(self, index: int | None = None) -> None:
        self._device_call("torchbridge_synchronize", index)

    # -- execution helpers ----------------------------------------------------------------
    def low_precision_dtype(self, info: DeviceInfo | None = None) -> torch.dtype | None:
        """The dtype O2+ computes in: config.precision, else the device's preferred one
        (from `info` when the caller already has this device's DeviceInfo)."""
        if self.config.precision != "auto":
            dtype: torch.dtype = getattr(torch, self.config.precision)
            return None if dtype == torch.float32 else dtype
        return (info or self.get_device_info()).low_precision_dtype

    def autocast(self, dtype: torch.dtype | None = None, enabled: bool = True
                 ) -> contextlib.AbstractContextManager[Any]:
        """torch.autocast for this device in its low-precision dtype. Disabled (a no-op) when
        the device has no native low-precision dtype and none is given."""
        dtype = dtype or self.low_precision_dtype()
        if dtype is None:
            logger.info("autocast disabled: %s has no native low-precision dtype", self.name)
            return torch.autocast(device_type=self.device.type, enabled=False)
        return torch.autocast(device_type=self.device.type, dtype=dtype, enabled=enabled)

    @property
    def distributed_backend(self) -> str | None:
        """The torch.distributed backend name for this device ("nccl", "gloo", ...)."""
        name: str | None = self._hooks.torchbridge_distributed_backend(
            backend_name=self.name, device=self.device)
        return name

    def get_kernel(self, op: str) -> Callable[..., Any]:
        from torchbridge.kernels import get_kernel

        return get_kernel(op, self)

    def to_device(self, obj: Any) -> Any:
        """Move a tensor, a module, or a (nested) list/tuple/dict of tensors to this device."""
        if isinstance(obj, (torch.Tensor, torch.nn.Module)):
            return obj.to(self.device)
        if isinstance(obj, dict):
            return {k: self.to_device(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.to_device(v) for v in obj)
        return obj

    # -- models ---------------------------------------------------------------------------
    def optimize(self, model: nn.Module, level: Any = None, sample_input: Any = None,
                 measure: bool = False, *, inplace: bool = False, strict: bool | None = None
                 ) -> OptimizationResult:
        """Run the pass pipeline at `level` (default: config.optimization_level) and return
        the full report: passes applied, skipped (why) and failed (error); output drift
        against O0 when `sample_input` is given; measured speedup when `measure=True`."""
        from torchbridge.optimize.pipeline import run_pipeline

        return run_pipeline(self, model, level, sample_input=sample_input, measure=measure,
                            inplace=inplace, strict=strict)

    def prepare_model(self, model: nn.Module, level: Any = None, *, sample_input: Any = None,
                      inplace: bool = False, strict: bool | None = None) -> nn.Module:
        """The prepared model. Its report: `torchbridge.optimization_result(prepared)`."""
        return self.optimize(model, level, sample_input=sample_input, inplace=inplace,
                             strict=strict).model
