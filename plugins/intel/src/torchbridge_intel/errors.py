"""The Intel plugin's exceptions, each under the core hierarchy, so `except
torchbridge.DeviceError` catches an XPUDeviceError as well."""

from __future__ import annotations

from torchbridge import errors


class IntelBackendError(errors.TorchBridgeError):
    """Base of every error the Intel plugin raises."""


class XPUNotAvailableError(IntelBackendError, errors.BackendUnavailableError):
    """No XPU build of torch, or no Intel GPU visible."""


class XPUDeviceError(IntelBackendError, errors.DeviceError):
    """An XPU device call failed or the device index does not exist."""


class OutOfMemoryError(XPUDeviceError, errors.OutOfMemoryError):
    """XPU memory exhausted; the message gives requested, free and total."""


# The core refuses a float64 model on a device without fp64 before placement, for every
# backend (torchbridge.optimize.pipeline.refuse_float64): the name stays, as the core's class.
UnsupportedDtypeError = errors.UnsupportedDtypeError


class IPEXUnavailableError(IntelBackendError, errors.ConfigurationError):
    """config.hardware.intel.use_ipex=True, but no IPEX matching this torch is installed."""
