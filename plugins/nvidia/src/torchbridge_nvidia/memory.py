"""NVIDIAMemoryManager: the core's MemoryManager on a cuda backend, with the limits of
config.hardware.nvidia and the NVIDIA OutOfMemoryError."""

from __future__ import annotations

from torchbridge.backends import SeedMemoryManager

from torchbridge_nvidia.errors import OutOfMemoryError


class NVIDIAMemoryManager(SeedMemoryManager):
    backend_name = "cuda"
    oom_error = OutOfMemoryError
