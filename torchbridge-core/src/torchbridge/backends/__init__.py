"""Seed-compatible entry points: `BackendFactory.create(detect_best_backend())`, and
`torchbridge.backends.<vendor>` modules that re-export each vendor plugin's public API."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchbridge.backend import Backend, get_backend
from torchbridge.config import TorchBridgeConfig
from torchbridge.errors import BackendUnavailableError
from torchbridge.memory import MemoryManager
from torchbridge.selection import backend_status, detect_best_backend, list_backends


def named_backend_class(backend_name: str, class_name: str,
                        unavailable_error: type[BackendUnavailableError] | None = None
                        ) -> type[Backend]:
    """A Backend subclass whose constructor selects `backend_name`, for the seeds'
    `NVIDIABackend(config)` / `NVIDIABackend(optimization_level="O2")` style. Without the
    backend it raises `unavailable_error` (a vendor's BackendUnavailableError subclass,
    such as CUDANotAvailableError) with the reason, else BackendUnavailableError."""

    def __init__(self: Backend, config: Any = None, *, optimization_level: Any = None,
                 device_id: int = 0) -> None:
        if config is None:
            config = TorchBridgeConfig.load()
        if optimization_level is not None:
            config = config.model_copy()
            config.optimization_level = optimization_level
        try:
            Backend.__init__(self, backend_status(backend_name), config, index=device_id)
        except BackendUnavailableError as exc:
            if unavailable_error is None:
                raise
            raise unavailable_error(str(exc), backend=backend_name) from None

    return type(class_name, (Backend,), {"__init__": __init__, "__doc__":
                f"The {backend_name} backend; raises BackendUnavailableError without it."})


CPUBackend = named_backend_class("cpu", "CPUBackend")


class SeedOptimizer:
    """The seeds' `<Vendor>Optimizer(config).optimize(model, optimization_level=...)`: the
    core's pipeline on the vendor's backend; `result.optimizations_applied` lists what ran.
    A vendor plugin subclasses it naming its Backend class in `backend_class`."""

    backend_class: Callable[[Any], Backend]  # a named_backend_class

    def __init__(self, config: Any = None, backend: Backend | None = None) -> None:
        self.backend = backend if backend is not None else self.backend_class(config)

    def optimize(self, model: Any, optimization_level: Any = None, sample_input: Any = None,
                 measure: bool = False, **kwargs: Any) -> Any:
        return self.backend.optimize(model, optimization_level, sample_input=sample_input,
                                     measure=measure, **kwargs)


class SeedMemoryManager(MemoryManager):
    """The seeds' `<Vendor>MemoryManager(backend)` / `<Vendor>MemoryManager(config=...)`:
    the core's MemoryManager on the vendor's backend, with the pool limits of the vendor's
    config section. A vendor plugin subclasses it naming `backend_name` and its own
    `oom_error`."""

    backend_name: str

    def __init__(self, backend: Backend | None = None, config: Any = None) -> None:
        if backend is None:
            backend = get_backend(self.backend_name, config)
        section = backend.hardware_config
        super().__init__(backend, pool_max_tensors=section.pool_max_tensors,
                         pool_max_bytes=section.pool_max_bytes)


class BackendFactory:
    """The seeds' factory: `BackendFactory.create("cuda")`."""

    @staticmethod
    def create(name: str | None = None, config: Any = None) -> Backend:
        return get_backend(name, config)

    @staticmethod
    def available_backends() -> list[str]:
        return [s.name for s in list_backends() if s.available]


__all__ = ["Backend", "BackendFactory", "CPUBackend", "SeedMemoryManager",
           "SeedOptimizer", "detect_best_backend", "named_backend_class"]
