"""IntelMemoryManager: the core's MemoryManager on an xpu backend, with the limits of
config.hardware.intel and the Intel OutOfMemoryError."""

from __future__ import annotations

from torchbridge.backends import SeedMemoryManager

from torchbridge_intel.errors import OutOfMemoryError


class IntelMemoryManager(SeedMemoryManager):
    backend_name = "xpu"
    oom_error = OutOfMemoryError
