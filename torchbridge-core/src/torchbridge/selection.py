"""Discovery and selection: the one detection path.

Every backend's presence comes from the `torchbridge_detect` hook. The four vendor backends
we ship are known here even when their plugin is missing, so that asking for one says which
package to install.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchbridge.errors import BackendUnavailableError, DeviceError
from torchbridge.plugins import get_plugin_host
from torchbridge.types import BackendStatus, Detection

if TYPE_CHECKING:
    from torchbridge.backend import Backend
    from torchbridge.config import TorchBridgeConfig

BACKEND_ENV = "TORCHBRIDGE_BACKEND"
# Default priority: NVIDIA CUDA, AMD ROCm, Intel XPU, TPU, CPU. Plugins report these.
PRIORITY = {"cuda": 100, "rocm": 90, "xpu": 80, "tpu": 70, "cpu": 0}
ALIASES = {"nvidia": "cuda", "amd": "rocm", "hip": "rocm", "intel": "xpu", "xla": "tpu"}


@dataclass(frozen=True)
class KnownBackend:
    vendor: str
    plugin: str          # entry-point name
    distribution: str
    extra: str
    device_type: str


KNOWN_BACKENDS = {
    "cuda": KnownBackend("NVIDIA", "nvidia", "torchbridge-nvidia", "nvidia", "cuda"),
    "rocm": KnownBackend("AMD", "amd", "torchbridge-amd", "amd", "cuda"),
    "xpu": KnownBackend("Intel", "intel", "torchbridge-intel", "intel", "xpu"),
    "tpu": KnownBackend("Google", "tpu", "torchbridge-tpu", "tpu", "xla"),
}


def _missing_status(name: str, known: KnownBackend) -> BackendStatus:
    host = get_plugin_host()
    record = host.records.get(known.plugin)
    hint: str | None = f"pip install torchbridge[{known.extra}]"
    if record is None:
        reason = f"plugin {known.distribution} is not installed ({hint})"
    elif record.status == "disabled":
        reason, hint = f"plugin {known.plugin} is {record.error}", None
    else:
        reason = f"plugin {known.plugin} is broken: {record.error}"
        hint = f"pip install --force-reinstall {known.distribution}"
    return BackendStatus(name, False, PRIORITY[name], known.device_type, 0, known.vendor,
                         reason, None, hint)


def list_backends() -> list[BackendStatus]:
    """Every known backend, best first, with availability and, when unavailable, why."""
    host = get_plugin_host()
    found: dict[str, BackendStatus] = {}
    for plugin, result in host.call_isolated("torchbridge_detect"):
        detections = result if isinstance(result, (list, tuple)) else [result]
        for det in detections:
            if not isinstance(det, Detection):
                host.record_hook_error(plugin, "torchbridge_detect", TypeError(
                    f"returned {type(det).__name__}, expected torchbridge.types.Detection"))
                continue
            if det.name not in found:  # the first plugin called (tryfirst) wins
                found[det.name] = BackendStatus(
                    det.name, det.available, det.priority, det.device_type,
                    det.device_count if det.available else 0, det.vendor, det.reason, plugin)
    for name, known in KNOWN_BACKENDS.items():
        if name not in found:
            found[name] = _missing_status(name, known)
    return sorted(found.values(), key=lambda s: (-s.priority, s.name))


def normalize_name(name: str) -> str:
    name = name.strip().lower()
    return ALIASES.get(name, name)


def detect_best_backend() -> str:
    """The backend selection would choose: TORCHBRIDGE_BACKEND if set, else the available
    backend with the highest priority ("cuda", "rocm", "xpu", "tpu" or "cpu")."""
    forced = os.environ.get(BACKEND_ENV)
    if forced:
        return normalize_name(forced)
    return next(s.name for s in list_backends() if s.available)


def backend_status(name: str, statuses: list[BackendStatus] | None = None) -> BackendStatus:
    """The status of backend `name`; BackendUnavailableError if absent or unavailable."""
    name = normalize_name(name)
    statuses = list_backends() if statuses is None else statuses
    status = next((s for s in statuses if s.name == name), None)
    if status is None:
        known = ", ".join(s.name for s in statuses)
        raise BackendUnavailableError(f"unknown backend {name!r}; known backends: {known}",
                                      backend=name)
    if not status.available:
        hint = f"; to install: {status.install_hint}" if status.install_hint else ""
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {status.reason}{hint}",
                                      backend=name, install_hint=status.install_hint)
    return status


def get_backend(name: str | None = None, config: TorchBridgeConfig | None = None) -> Backend:
    """The named backend, else config.backend (file, env TORCHBRIDGE_BACKEND, kwargs), else
    the best available one. Raises BackendUnavailableError saying why and what to install."""
    from torchbridge.backend import Backend
    from torchbridge.config import TorchBridgeConfig

    config = config if config is not None else TorchBridgeConfig.load()
    statuses = list_backends()
    chosen = name or config.backend or next(s.name for s in statuses if s.available)
    index = 0
    if ":" in chosen:  # "cuda:1"
        chosen, _, idx = chosen.partition(":")
        if not idx.isdigit():
            raise DeviceError(f"bad device index {idx!r} in backend name {chosen}:{idx}")
        index = int(idx)
    return Backend(backend_status(chosen, statuses), config, index=index)
