"""TorchBridge: one API to find the best accelerator, describe it, manage its memory and
prepare a model for it.

    import torchbridge
    backend = torchbridge.get_backend()          # best available: cuda, rocm, xpu, tpu, cpu
    model = backend.prepare_model(model, level="O2")
    print(torchbridge.optimization_result(model).summary())

Importing this package is cheap: torch, config (pydantic) and plugins load on first use
of a name that needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# The error classes and the levels enum are plain Python (no torch): imported eagerly.
from torchbridge.errors import (
    BackendUnavailableError,
    CheckpointError,
    ConfigurationError,
    DeviceError,
    DistributedError,
    KernelCompilationError,
    KernelError,
    KernelLaunchError,
    ModelOptimizationError,
    PluginError,
    TorchBridgeError,
    UnsupportedDtypeError,
)
from torchbridge.levels import OptimizationLevel

# The version of the plugin contract (hookspecs, Detection and the other records plugins
# build or receive, the rules the host enforces on them), semantic: MAJOR changes when a
# behaviour a plugin may rely on changes or goes (always after a release of the previous
# major that warns about it with a DeprecationWarning naming the plugin and what to change);
# MINOR when something is added that old plugins need not know about (a new optional hook,
# field or fallback); PATCH for fixes that change no documented behaviour. A plugin declares
# the range it was written for in its module: TORCHBRIDGE_CONTRACT = ">=3,<4".
CONTRACT_VERSION = "3.1.0"
# The release's version, written only here. torchbridge-core's pyproject.toml reads this
# line (a dynamic version, read without importing torchbridge); the other five distributions'
# pyproject.toml repeat it, and tests/test_packaging.py fails when one disagrees.
# torchbridge.__version__ is the installed metadata's, which is this for an install of this
# tree, and this when the distribution's metadata cannot be read (a bare source tree).
_SOURCE_VERSION = "0.3.0"

if TYPE_CHECKING:
    __version__: str
    from torchbridge.backend import Backend, get_backend, get_kernel
    from torchbridge.checkpoint import load_checkpoint, save_checkpoint
    from torchbridge.compatibility import (
        HardwareDetector,
        UnifiedValidator,
        check_compatibility,
    )
    from torchbridge.config import ConfigSection, TorchBridgeConfig
    from torchbridge.errors import OutOfMemoryError
    from torchbridge.hookspecs import hookimpl, hookspec
    from torchbridge.kernels.implementations import KernelImplementation
    from torchbridge.kernels.ops import OpDefinition
    from torchbridge.optimize.kernel_patterns import ModulePattern
    from torchbridge.optimize.passes import OptimizationPass, PassContext
    from torchbridge.optimize.report import OptimizationResult, optimization_result
    from torchbridge.plugins import register_plugin, reload_plugins, unregister_plugin
    from torchbridge.selection import detect_best_backend, list_backends
    from torchbridge.types import BackendStatus, Detection, DeviceInfo, MemoryStats
    from torchbridge.validation import validate

# name -> module that defines it; imported on first attribute access, so that `import
# torchbridge` (and the command line's --help and --version) does not import torch.
_LAZY = {
    "OutOfMemoryError": "torchbridge.errors",  # subclasses torch.OutOfMemoryError
    "hookimpl": "torchbridge.hookspecs",
    "hookspec": "torchbridge.hookspecs",
    "BackendStatus": "torchbridge.types",
    "Detection": "torchbridge.types",
    "DeviceInfo": "torchbridge.types",
    "MemoryStats": "torchbridge.types",
    "Backend": "torchbridge.backend",
    "TorchBridgeConfig": "torchbridge.config",
    "get_kernel": "torchbridge.backend",
    "ConfigSection": "torchbridge.config",
    "OptimizationPass": "torchbridge.optimize.passes",
    "PassContext": "torchbridge.optimize.passes",
    "OptimizationResult": "torchbridge.optimize.report",
    "optimization_result": "torchbridge.optimize.report",
    "register_plugin": "torchbridge.plugins",
    "unregister_plugin": "torchbridge.plugins",
    "reload_plugins": "torchbridge.plugins",
    "get_backend": "torchbridge.backend",
    "save_checkpoint": "torchbridge.checkpoint",
    "load_checkpoint": "torchbridge.checkpoint",
    "validate": "torchbridge.validation",
    "list_backends": "torchbridge.selection",
    "detect_best_backend": "torchbridge.selection",
    "KernelImplementation": "torchbridge.kernels.implementations",
    "OpDefinition": "torchbridge.kernels.ops",
    "ModulePattern": "torchbridge.optimize.kernel_patterns",
    "check_compatibility": "torchbridge.compatibility",
    "HardwareDetector": "torchbridge.compatibility",
    "UnifiedValidator": "torchbridge.compatibility",
}


def _installed_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("torchbridge-core")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return _SOURCE_VERSION


def __getattr__(name: str) -> Any:
    if name == "__version__":
        version = globals()["__version__"] = _installed_version()
        return version
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torchbridge' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, "__version__"})


__all__ = [
    "CONTRACT_VERSION", "Backend", "BackendStatus", "BackendUnavailableError", "CheckpointError",
    "ConfigSection", "ConfigurationError", "Detection", "HardwareDetector", "UnifiedValidator",
    "DeviceError", "DeviceInfo", "DistributedError", "KernelCompilationError", "KernelError",
    "KernelImplementation", "KernelLaunchError", "ModulePattern", "OpDefinition", "MemoryStats",
    "ModelOptimizationError", "OptimizationLevel", "OptimizationPass", "OptimizationResult",
    "OutOfMemoryError", "PassContext", "PluginError", "TorchBridgeConfig", "TorchBridgeError",
    "UnsupportedDtypeError", "check_compatibility", "detect_best_backend", "get_backend",
    "get_kernel", "hookimpl",
    "hookspec",
    "list_backends", "load_checkpoint", "optimization_result", "register_plugin",
    "reload_plugins", "save_checkpoint", "unregister_plugin", "validate", "__version__",
]
