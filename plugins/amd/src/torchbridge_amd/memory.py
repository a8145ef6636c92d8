"""AMDMemoryManager: the core's MemoryManager on a rocm backend, with the limits of
config.hardware.amd and the AMD OutOfMemoryError."""

from __future__ import annotations

from typing import Any

from torchbridge.memory import MemoryManager

from torchbridge_amd.errors import OutOfMemoryError


class AMDMemoryManager(MemoryManager):
    oom_error = OutOfMemoryError

    def __init__(self, backend: Any = None, config: Any = None) -> None:
        if backend is None:
            from torchbridge.backend import get_backend

            backend = get_backend("rocm", config)
        section = backend.hardware_config
        super().__init__(backend, pool_max_tensors=section.pool_max_tensors,
                         pool_max_bytes=section.pool_max_bytes)
