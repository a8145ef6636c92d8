"""Public API, re-exported as `torchbridge.backends.nvidia`."""

from __future__ import annotations

from torchbridge.backends import SeedOptimizer, named_backend_class

from torchbridge_nvidia.architecture import NVIDIAArchitecture, PrecisionPolicy, precision_policy
from torchbridge_nvidia.attention import FlashAttention3
from torchbridge_nvidia.config import NVIDIAConfig
from torchbridge_nvidia.devices import CUDADeviceManager
from torchbridge_nvidia.errors import (
    CUDADeviceError,
    CUDANotAvailableError,
    FlashAttentionError,
    FP8CompilationError,
    InvalidArchitectureError,
    InvalidComputeCapabilityError,
    KernelLaunchError,
    MemoryAllocationError,
    NVIDIABackendError,
    OutOfMemoryError,
)
from torchbridge_nvidia.fp8 import FP8CompilationResult, FP8Compiler, FP8Linear
from torchbridge_nvidia.memory import NVIDIAMemoryManager

_GenericCUDABackend = named_backend_class("cuda", "NVIDIABackend", CUDANotAvailableError)


class NVIDIABackend(_GenericCUDABackend):  # type: ignore[misc, valid-type]
    """The cuda backend: `NVIDIABackend()`, `NVIDIABackend(config)`,
    `NVIDIABackend(optimization_level="O3", device_id=1)`. Raises CUDANotAvailableError
    (a BackendUnavailableError) without a usable NVIDIA GPU."""

    @property
    def compute_capability(self) -> str | None:
        capability: str | None = self.get_device_info().compute_capability
        return capability

    @property
    def architecture(self) -> str | None:
        architecture: str | None = self.get_device_info().architecture
        return architecture


class NVIDIAOptimizer(SeedOptimizer):
    """`NVIDIAOptimizer(config).optimize(model, optimization_level="balanced")`: the core's
    pipeline on the cuda backend; `result.optimizations_applied` lists what really ran."""

    backend_class = NVIDIABackend


__all__ = [
    "CUDADeviceError", "CUDADeviceManager", "CUDANotAvailableError", "FP8CompilationError",
    "FP8CompilationResult", "FP8Compiler", "FP8Linear", "FlashAttention3",
    "FlashAttentionError", "InvalidArchitectureError", "InvalidComputeCapabilityError",
    "KernelLaunchError", "MemoryAllocationError", "NVIDIAArchitecture", "NVIDIABackend",
    "NVIDIABackendError", "NVIDIAConfig", "NVIDIAMemoryManager", "NVIDIAOptimizer",
    "OutOfMemoryError", "PrecisionPolicy", "precision_policy",
]
