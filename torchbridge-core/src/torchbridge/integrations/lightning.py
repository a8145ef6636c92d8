"""A PyTorch Lightning Accelerator for whatever backend TorchBridge selects (CUDA, ROCm,
XPU, TPU, a third-party plugin's device), registered as "torchbridge":

    import torchbridge.integrations.lightning        # registers the accelerator
    trainer = lightning.Trainer(accelerator="torchbridge", devices="auto")

Lightning has accelerators for CUDA, MPS, XLA and the CPU only. This one takes the backend
TorchBridge selects (or `TORCHBRIDGE_BACKEND`, or `TorchBridgeAccelerator.for_backend("xpu")`),
parses `devices` against its device count, binds the device through the backend, and reports
memory from the backend's MemoryStats. Lightning stays optional: importing this module
without it raises ImportError saying what to install.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch

try:
    from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry
except ImportError as exc:  # pragma: no cover - exercised where Lightning is absent
    raise ImportError("torchbridge.integrations.lightning needs PyTorch Lightning: "
                      "pip install lightning") from exc

from torchbridge.backend import get_backend
from torchbridge.distributed.runtime import bind_device
from torchbridge.errors import DeviceError, TorchBridgeError

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from torchbridge.backend import Backend

logger = logging.getLogger(__name__)

NAME = "torchbridge"


def parse_device_indices(devices: Any, device_count: int, device_type: str) -> list[int]:
    """Lightning's `devices` (an int N: the first N, -1: all; "N", "-1", "0,2"; a list of
    indices) as device indices. On a backend whose devices are the host CPU, N processes
    may exceed the device count (Lightning's CPU accelerator allows the same); elsewhere a
    request beyond the devices present is a DeviceError."""
    if isinstance(devices, str):
        text = devices.strip()
        if text in ("auto", "-1"):
            devices = -1
        elif "," in text:
            try:
                devices = [int(part) for part in text.split(",") if part.strip()]
            except ValueError:
                raise DeviceError(f"devices={devices!r}: expected indices such as '0,1'"
                                  ) from None
        else:
            try:
                devices = int(text)
            except ValueError:
                raise DeviceError(f"devices={devices!r}: expected a count, -1, 'auto' or "
                                  "indices such as '0,1'") from None
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices == -1:
            return list(range(device_count))
        if devices < 1:
            raise DeviceError(f"devices={devices}: need at least one device (or -1 for all)")
        if devices > device_count and device_type != "cpu":
            raise DeviceError(f"devices={devices}, but the backend has {device_count} "
                              f"{device_type} device(s)")
        return [i % device_count for i in range(devices)]
    if isinstance(devices, (list, tuple)) and devices \
            and all(isinstance(i, int) and not isinstance(i, bool) for i in devices):
        bad = [i for i in devices if not 0 <= i < device_count]
        if bad:
            raise DeviceError(f"devices={list(devices)}: no device {bad[0]} (the backend has "
                              f"{device_count}: indices 0 to {device_count - 1})")
        if len(set(devices)) != len(devices):
            raise DeviceError(f"devices={list(devices)} names a device twice")
        return list(devices)
    raise DeviceError(f"devices={devices!r}: expected an int, -1, 'auto', 'N', '0,1' or a "
                      "list of device indices")


class TorchBridgeAccelerator(Accelerator):  # type: ignore[misc]
    """Lightning Accelerator over a TorchBridge backend. Lightning calls the device-parsing
    methods on the class, so the backend is a class attribute: `backend_name` None means
    the one TorchBridge selects; `for_backend(name)` makes a class bound to another."""

    backend_name: ClassVar[str | None] = None

    @classmethod
    def for_backend(cls, name: str) -> type[TorchBridgeAccelerator]:
        return type(f"TorchBridgeAccelerator[{name}]", (cls,), {"backend_name": name})

    @classmethod
    def backend(cls, index: int | None = None) -> Backend:
        if index is None:
            return get_backend(cls.backend_name)
        base = get_backend(cls.backend_name)
        return base if index == 0 else get_backend(f"{base.name}:{index}", config=base.config)

    # -- what Lightning asks the class ----------------------------------------------------
    @classmethod
    def parse_devices(cls, devices: Any) -> list[int]:  # type: ignore[override]
        backend = cls.backend()
        return parse_device_indices(devices, backend.device_count, backend.device.type)

    @classmethod
    def get_parallel_devices(cls, devices: Any) -> list[torch.device]:  # type: ignore[override]
        backend = cls.backend()
        indices = devices if isinstance(devices, list) else cls.parse_devices(devices)
        return [backend.device_at(i) for i in indices]

    @classmethod
    def auto_device_count(cls) -> int:  # type: ignore[override]
        return max(1, cls.backend().device_count)

    @classmethod
    def is_available(cls) -> bool:  # type: ignore[override]
        try:
            cls.backend()
        except TorchBridgeError:
            return False
        return True

    @staticmethod
    def name() -> str:
        return NAME

    @classmethod
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        accelerator_registry.register(
            NAME, cls, description="any backend TorchBridge selects (CUDA, ROCm, XPU, TPU, "
            "third-party)", override=True)

    # -- what Lightning asks the instance -------------------------------------------------
    def setup_device(self, device: torch.device) -> None:
        backend = self.backend()
        if device.type != backend.device.type:
            return  # Lightning's single-device default ("cpu"); setup() corrects it
        bind_device(device)

    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning picks "cpu" as the single device of any accelerator it does not know,
        and CUDA as the device of mixed precision; both become this backend's device."""
        from lightning.pytorch.strategies import SingleDeviceStrategy

        backend = self.backend()
        strategy = trainer.strategy
        if isinstance(strategy, SingleDeviceStrategy) \
                and strategy.root_device.type != backend.device.type:
            devices = getattr(trainer._accelerator_connector, "_parallel_devices", None)
            device = devices[0] if devices else backend.device
            logger.info("single-device strategy moved from %s to %s", strategy.root_device,
                        device)
            strategy._root_device = device
            self.setup_device(device)
        precision = trainer.precision_plugin
        if getattr(precision, "device", backend.device.type) != backend.device.type:
            precision.device = backend.device.type  # type: ignore[attr-defined]

    def teardown(self) -> None:
        try:
            self.backend().empty_cache()
        except DeviceError as exc:
            logger.debug("empty_cache at teardown: %s", exc)

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        """Memory of `device` in bytes from the backend's MemoryStats; figures the backend
        cannot know are left out rather than reported as 0."""
        index = torch.device(device).index or 0
        backend = self.backend()
        stats = backend.get_memory_stats(min(index, backend.device_count - 1))
        fields = ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "free_bytes",
                  "total_bytes")
        return {name: getattr(stats, name) for name in fields
                if getattr(stats, name) is not None}


if NAME not in AcceleratorRegistry:
    TorchBridgeAccelerator.register_accelerators(AcceleratorRegistry)
