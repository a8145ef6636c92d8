"""Public API, re-exported as `torchbridge.backends.amd`."""

from __future__ import annotations

from torchbridge.backends import SeedOptimizer, named_backend_class
from torchbridge.errors import DeviceError
from torchbridge.fp8 import FP8CompilationResult, FP8Linear, convert_linears_to_fp8

from torchbridge_amd.architecture import (
    ARCHITECTURES,
    AMDFamily,
    PrecisionPolicy,
    arch_name,
    precision_policy,
)
from torchbridge_amd.config import AMDConfig
from torchbridge_amd.devices import preflight_for, telemetry
from torchbridge_amd.errors import (
    AMDBackendError,
    FP8CompilationError,
    InvalidArchitectureError,
    OutOfMemoryError,
    ROCmDeviceError,
    ROCmNotAvailableError,
)
from torchbridge_amd.memory import AMDMemoryManager
from torchbridge_amd.preflight import Preflight, hsa_override_value, run_preflight

_GenericROCmBackend = named_backend_class("rocm", "AMDBackend", ROCmNotAvailableError)


class AMDBackend(_GenericROCmBackend):  # type: ignore[misc, valid-type]
    """The rocm backend: `AMDBackend()`, `AMDBackend(config)`,
    `AMDBackend(optimization_level="O3", device_id=1)`. Raises ROCmNotAvailableError (a
    BackendUnavailableError) without a ROCm build of torch and a visible AMD GPU."""

    def _check_index(self, index: int | None) -> int:
        """The core's check, raising the AMD plugin's ROCmDeviceError (a DeviceError) for
        an index that does not exist."""
        try:
            checked: int = super()._check_index(index)
        except ROCmDeviceError:
            raise
        except DeviceError as exc:
            raise ROCmDeviceError(str(exc)) from None
        return checked

    @property
    def architecture(self) -> str | None:
        """The gfx name ("gfx942"), or "unknown"."""
        architecture: str | None = self.get_device_info().architecture
        return architecture

    def preflight(self, index: int | None = None) -> Preflight:
        """Does this build carry code for the GPU, and will flash attention run on it."""
        return preflight_for(self._check_index(index))

    def telemetry(self, index: int | None = None) -> dict[str, float | None]:
        """Utilization, power, temperature, VRAM from amdsmi (None values without it)."""
        return dict(self.get_device_info(self._check_index(index)).extra["telemetry"])


class AMDOptimizer(SeedOptimizer):
    """`AMDOptimizer(config).optimize(model, optimization_level="balanced")`: the core's
    pipeline on the rocm backend; `result.optimizations_applied` lists what really ran."""

    backend_class = AMDBackend


__all__ = [
    "AMDBackend", "AMDBackendError", "AMDConfig", "AMDFamily", "AMDMemoryManager",
    "AMDOptimizer", "ARCHITECTURES", "FP8CompilationError", "FP8CompilationResult", "FP8Linear",
    "InvalidArchitectureError", "OutOfMemoryError", "Preflight", "PrecisionPolicy",
    "ROCmDeviceError", "ROCmNotAvailableError", "arch_name", "convert_linears_to_fp8",
    "hsa_override_value", "precision_policy", "run_preflight", "telemetry",
]
