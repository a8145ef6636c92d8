"""Public API, re-exported as `torchbridge.backends.intel`."""

from __future__ import annotations

from torchbridge.backends import SeedOptimizer, named_backend_class

from torchbridge_intel.config import IntelConfig
from torchbridge_intel.devices import XPUDeviceManager
from torchbridge_intel.errors import (
    IntelBackendError,
    IPEXUnavailableError,
    OutOfMemoryError,
    UnsupportedDtypeError,
    XPUDeviceError,
    XPUNotAvailableError,
)
from torchbridge_intel.families import IntelFamily
from torchbridge_intel.memory import IntelMemoryManager
from torchbridge_intel.policy import PrecisionPolicy, precision_policy

_GenericXPUBackend = named_backend_class("xpu", "IntelBackend", XPUNotAvailableError)


class IntelBackend(_GenericXPUBackend):  # type: ignore[misc, valid-type]
    """The xpu backend: `IntelBackend()`, `IntelBackend(config)`,
    `IntelBackend(optimization_level="O3", device_id=1)`. Raises XPUNotAvailableError
    (a BackendUnavailableError) without a usable Intel GPU. Runs on stock torch.xpu;
    intel-extension-for-pytorch is optional."""

    @property
    def family(self) -> str | None:
        """"ponte_vecchio", "alchemist", "battlemage", ... or "unknown"."""
        family: str | None = self.get_device_info().architecture
        return family

    @property
    def supports_fp64(self) -> bool | None:
        """False on devices without float64 (Arc A-series); None where torch does not say."""
        fp64: bool | None = self.get_device_info().extra.get("fp64")
        return fp64


class IntelOptimizer(SeedOptimizer):
    """`IntelOptimizer(config).optimize(model, optimization_level="balanced")`: the core's
    pipeline on the xpu backend; `result.optimizations_applied` lists what really ran."""

    backend_class = IntelBackend


__all__ = [
    "IPEXUnavailableError", "IntelBackend", "IntelBackendError", "IntelConfig",
    "IntelFamily", "IntelMemoryManager", "IntelOptimizer", "OutOfMemoryError",
    "PrecisionPolicy", "UnsupportedDtypeError", "XPUDeviceError", "XPUDeviceManager",
    "XPUNotAvailableError", "precision_policy",
]
