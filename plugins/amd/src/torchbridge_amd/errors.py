"""The AMD plugin's exceptions, each under the core hierarchy, so `except
torchbridge.DeviceError` catches a ROCmDeviceError as well."""

from __future__ import annotations

from torchbridge import errors


class AMDBackendError(errors.TorchBridgeError):
    """Base of every error the AMD plugin raises."""


class ROCmNotAvailableError(AMDBackendError, errors.BackendUnavailableError):
    """No ROCm build of torch, or no AMD GPU visible."""


class ROCmDeviceError(AMDBackendError, errors.DeviceError):
    """A HIP device call failed or the device index does not exist (AMDBackend's
    get_device_info, preflight and telemetry)."""


class OutOfMemoryError(AMDBackendError, errors.OutOfMemoryError):
    """GPU memory exhausted; the message gives requested, free and total."""


class FP8CompilationError(AMDBackendError, errors.ModelOptimizationError):
    """A model could not be converted to FP8."""


class InvalidArchitectureError(AMDBackendError, errors.ConfigurationError):
    """config.hardware.amd asks for what the GPU's architecture cannot do."""
