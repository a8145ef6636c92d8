"""AMDMemoryManager: the core's MemoryManager on a rocm backend, with the limits of
config.hardware.amd and the AMD OutOfMemoryError."""

from __future__ import annotations

from torchbridge.backends import SeedMemoryManager

from torchbridge_amd.errors import OutOfMemoryError


class AMDMemoryManager(SeedMemoryManager):
    backend_name = "rocm"
    oom_error = OutOfMemoryError
