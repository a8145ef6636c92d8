"""The one error hierarchy. Vendor plugins subclass these; callers catch these.

Every error names the problem and, where there is one, the fix.

Importing this module does not import torch, so that the command line's `--help` and
`--version` (and anything else that only needs the error classes) start fast. The one class
that needs torch, OutOfMemoryError (a torch.OutOfMemoryError too), is created on first
access: `from torchbridge.errors import OutOfMemoryError` works as for any other name.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any


class TorchBridgeError(Exception):
    """Base of every error TorchBridge raises on purpose."""


class ConfigurationError(TorchBridgeError, ValueError):
    """A config value is wrong. Names the field path, the value and where it came from."""

    def __init__(self, message: str, *, field: str | None = None, value: object = None,
                 source: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.value = value
        self.source = source


class BackendUnavailableError(TorchBridgeError):
    """The requested backend cannot be used here; the message says why and what to install."""

    def __init__(self, message: str, *, backend: str | None = None,
                 install_hint: str | None = None) -> None:
        super().__init__(message)
        self.backend = backend
        self.install_hint = install_hint


class DeviceError(TorchBridgeError):
    """A device operation failed or a device index does not exist."""


if TYPE_CHECKING:
    import torch

    class OutOfMemoryError(DeviceError, torch.OutOfMemoryError):
        """Device memory exhausted. Also a torch.OutOfMemoryError, so existing handlers
        catch it. Sizes in its message are in MiB (2**20 bytes)."""


_lock = threading.Lock()


def _out_of_memory_error() -> type:
    import torch

    class OutOfMemoryError(DeviceError, torch.OutOfMemoryError):
        """Device memory exhausted. Also a torch.OutOfMemoryError, so existing handlers
        catch it. Sizes in its message are in MiB (2**20 bytes)."""

    # Named as if defined at module level: pickle and tracebacks find it by this name.
    OutOfMemoryError.__module__ = __name__
    OutOfMemoryError.__qualname__ = "OutOfMemoryError"
    return OutOfMemoryError


if not TYPE_CHECKING:  # mypy sees the class above; an Any-typed __getattr__ would hide typos
    def __getattr__(name: str) -> Any:
        # PEP 562: built once, on first access, then an ordinary module attribute (one
        # class for every importer, so subclasses and `except` clauses agree).
        if name != "OutOfMemoryError":
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        with _lock:
            cls = globals().get(name)
            if cls is None:
                cls = globals()[name] = _out_of_memory_error()
        return cls


class KernelError(TorchBridgeError):
    """No kernel for an op on a backend, or a kernel failed."""


class KernelCompilationError(KernelError):
    """A kernel could not be built for this device."""


class KernelLaunchError(KernelError):
    """A kernel failed to launch or run; the message names the kernel."""


class ModelOptimizationError(TorchBridgeError):
    """prepare_model/optimize failed (strict mode) or was asked for something invalid."""


class UnsupportedDtypeError(ModelOptimizationError):
    """The model or its input holds a dtype the device cannot compute in (float64 on a
    device whose description says `extra["fp64"] is False`); raised before placement."""


class PluginError(TorchBridgeError):
    """A plugin failed to load or misbehaved. The host keeps working without it."""


class CheckpointError(TorchBridgeError):
    """A checkpoint could not be saved or loaded; names the file and what is wrong with it."""


class DistributedError(TorchBridgeError):
    """Distributed setup or a distributed strategy failed: a launcher environment that is
    missing or inconsistent, no process-group backend for a device, a strategy the device
    or this torch cannot run. Names the variable, backend or strategy, and the fix."""
