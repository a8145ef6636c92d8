"""The NVIDIA plugin's exceptions (the seed's names), each under the core hierarchy, so
`except torchbridge.DeviceError` catches a CUDADeviceError as well."""

from __future__ import annotations

from torchbridge import errors


class NVIDIABackendError(errors.TorchBridgeError):
    """Base of every error the NVIDIA plugin raises."""


class CUDANotAvailableError(NVIDIABackendError, errors.BackendUnavailableError):
    """No CUDA build of torch, or no NVIDIA GPU visible."""


class CUDADeviceError(NVIDIABackendError, errors.DeviceError):
    """A CUDA device call failed or the device index does not exist (CUDADeviceManager)."""


class MemoryAllocationError(NVIDIABackendError, errors.DeviceError):
    """An allocation on an NVIDIA GPU failed; raised as its subclass OutOfMemoryError."""


class OutOfMemoryError(MemoryAllocationError, errors.OutOfMemoryError):
    """GPU memory exhausted; the message gives requested, free and total."""


class FP8CompilationError(NVIDIABackendError, errors.ModelOptimizationError):
    """A model could not be converted to FP8."""


class FlashAttentionError(NVIDIABackendError, errors.KernelError):
    """The requested attention path cannot run the given inputs."""


class InvalidComputeCapabilityError(NVIDIABackendError, errors.DeviceError):
    """The device's compute capability is too old for the requested feature: FP8Compiler
    on a model whose GPU is older than 8.9 (Ada)."""


class KernelLaunchError(NVIDIABackendError, errors.KernelLaunchError):
    """A CUDA kernel failed to launch: a flash-attn kernel FlashAttention3 chose raised
    (e.g. "no kernel image is available for execution on the device")."""


class InvalidArchitectureError(NVIDIABackendError, errors.ConfigurationError):
    """config.hardware.nvidia asks for what the GPU's architecture cannot do."""
