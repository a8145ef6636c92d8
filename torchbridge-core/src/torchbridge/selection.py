"""Discovery and selection: the one detection path.

Every backend's presence comes from the `torchbridge_detect` hook, called once per process
(`list_backends(rescan=True)` asks again). What plugins report is checked before a backend
is offered: a malformed Detection is its plugin's error, never a crash of discovery, and the
built-in cpu backend cannot be replaced or made unavailable. The four vendor backends we ship
are known here even when their plugin is missing, so that asking for one says which package
to install.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import warnings
from dataclasses import dataclass

import torch

from torchbridge import devices
from torchbridge.errors import BackendUnavailableError, DeviceError
from torchbridge.plugins import (
    PluginHost,
    PluginRecord,
    cached_for,
    exclusive_step,
    get_plugin_host,
)
from torchbridge.types import BackendStatus, Detection

BACKEND_ENV = "TORCHBRIDGE_BACKEND"
# Default priority: NVIDIA CUDA, AMD ROCm, Intel XPU, TPU, CPU. Plugins report these.
PRIORITY = {"cuda": 100, "rocm": 90, "xpu": 80, "tpu": 70, "cpu": 0}
ALIASES = {"nvidia": "cuda", "amd": "rocm", "hip": "rocm", "intel": "xpu", "xla": "tpu"}
FALLBACKS = ("cpu", "generic")  # the core's answers a backend may opt into
_NAME = re.compile(r"[a-z][a-z0-9_-]*")


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


def _known_record(host: PluginHost, known: KnownBackend) -> PluginRecord | None:
    """The record of a known plugin: its entry point name, or `name[distribution]` when
    another distribution uses the same name."""
    records = [r for r in host.records.values()
               if r.name == known.plugin or r.name.startswith(f"{known.plugin}[")]
    return next((r for r in records if r.distribution == known.distribution),
                records[0] if records else None)


def _missing_status(host: PluginHost, name: str, known: KnownBackend) -> BackendStatus:
    record = _known_record(host, known)
    hint: str | None = f"pip install torchbridge[{known.extra}]"
    if record is None:
        reason = f"plugin {known.distribution} is not installed ({hint})"
    elif record.status == "disabled":
        reason, hint = f"plugin {known.plugin} is {record.error}", None
    else:
        reason = f"plugin {record.name} is broken: {record.error}"
        hint = f"pip install --force-reinstall {known.distribution}"
    return BackendStatus(name, False, PRIORITY[name], known.device_type, 0, known.vendor,
                         reason, None, hint)


def detection_problem(det: object, plugin: str, builtin: bool) -> str | None:
    """None when `det` is a well-formed Detection this plugin may report; else what is
    wrong with it. Cheap: attribute checks, and one device count from torch for an
    available accelerator."""
    if not isinstance(det, Detection):
        return f"returned {type(det).__name__}, expected torchbridge.Detection"
    name = det.name
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return f"backend name must be lower-case letters, digits, '_' or '-', got {name!r}"
    if name in ALIASES:
        return f"backend name {name!r} is reserved: it is an alias of {ALIASES[name]!r}"
    if name == "cpu" and not builtin:
        return "the cpu backend is built in; a plugin cannot replace it or mark it unavailable"
    if type(det.available) is not bool:
        return f"{name}: available must be True or False, got {det.available!r}"
    for field_name in ("priority", "device_count"):
        value = getattr(det, field_name)
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name}: {field_name} must be an int, got {value!r}"
    if det.device_count < 0 or (det.available and det.device_count < 1):
        return f"{name}: an available backend needs device_count >= 1, got {det.device_count}"
    for field_name in ("vendor", "reason"):
        value = getattr(det, field_name)
        if value is not None and not isinstance(value, str):
            return f"{name}: {field_name} must be a string or None, got {value!r}"
    problem = devices.device_type_problem(det.device_type)
    if problem is not None:
        return f"{name}: {problem}"
    if det.fallbacks is not None:
        if not isinstance(det.fallbacks, tuple) or not set(det.fallbacks) <= set(FALLBACKS):
            return f"{name}: fallbacks must be a tuple of {FALLBACKS}, got {det.fallbacks!r}"
        if "cpu" in det.fallbacks and det.device_type != "cpu":
            return f"{name}: the cpu fallback describes the host CPU; device type is " \
                   f"{det.device_type!r}"
    if det.available:
        seen = devices.runtime_device_count(det.device_type)
        if seen is not None and det.device_count > seen:
            return (f"{name}: claims {det.device_count} {det.device_type} device(s), but "
                    f"torch {torch.__version__} sees {seen}")
    return None


def _discover(host: PluginHost) -> list[BackendStatus]:
    found: dict[str, BackendStatus] = {}
    for impl in host.implementations("torchbridge_detect"):
        plugin = impl.plugin_name
        record = host.records.get(plugin)
        builtin = record is not None and record.group == "builtin"
        started = time.perf_counter()
        ok, result = host.call_one(impl, "torchbridge_detect", {})
        seconds = time.perf_counter() - started
        if record is not None:
            record.detect_seconds = seconds
        if not ok or result is None:
            continue
        detections = list(result) if isinstance(result, (list, tuple)) else [result]
        for det in detections:
            problem = detection_problem(det, plugin, builtin)
            if problem is not None:
                host.record_hook_error(plugin, "torchbridge_detect", problem)
                continue
            if det.name in found:  # the first plugin called (tryfirst) wins
                if record is not None:
                    record.warn(f"also reports backend {det.name!r}, which plugin "
                                f"{found[det.name].plugin} reported first; ignored")
                continue
            if not det.available and not det.reason and record is not None:
                record.warn(f"reports backend {det.name!r} unavailable without a reason")
                det = dataclasses.replace(det, reason=f"plugin {plugin} gave no reason")
            if det.fallbacks is None and record is not None and not builtin:
                message = (f"backend {det.name!r} leans on the core's fallback answers without "
                           "opting in; set Detection(fallbacks=(...)) (\"generic\", \"cpu\") "
                           "or () and answer every device-level hook yourself")
                record.warn(message)
                warnings.warn(f"plugin {plugin}: {message}", DeprecationWarning, stacklevel=2)
            found[det.name] = BackendStatus(
                det.name, det.available, det.priority, det.device_type,
                det.device_count if det.available else 0, det.vendor, det.reason, plugin,
                fallbacks=det.fallbacks, detect_seconds=seconds)
    for name, known in KNOWN_BACKENDS.items():
        if name not in found:
            found[name] = _missing_status(host, name, known)
    return sorted(found.values(), key=lambda s: (-s.priority, s.name))


_discovery: tuple[PluginHost, int, list[BackendStatus]] | None = None


def list_backends(rescan: bool = False) -> list[BackendStatus]:
    """Every known backend, best first, with availability and, when unavailable, why.
    Discovery runs once per plugin set; `rescan=True` asks every plugin again (after a
    driver appeared, in tests that replay recorded devices)."""
    global _discovery
    host = get_plugin_host()
    cached: list[BackendStatus] | None = cached_for(_discovery, host)
    if not rescan and cached is not None:
        return list(cached)
    with exclusive_step("discovering backends"):
        statuses = _discover(host)
    _discovery = (host, host.generation, statuses)
    return list(statuses)


def parse_backend_spec(spec: str) -> tuple[str, int]:
    """A backend string split into name and device index: "cuda" -> ("cuda", 0), "cuda:1"
    -> ("cuda", 1). A malformed one (no name, an index that is not a plain decimal number)
    is a DeviceError naming it; whether the name exists is backend_status's question."""
    name, colon, index = spec.partition(":")
    if not name.strip():
        raise DeviceError(f"malformed backend {spec!r}: no backend name; expected a name "
                          "such as 'cuda' or 'cuda:1'")
    if not colon:
        return name, 0
    if not (index.isascii() and index.isdigit()):
        raise DeviceError(f"bad device index {index!r} in backend name {spec}; expected a "
                          "number such as cuda:1")
    return name, int(index)


def normalize_name(name: str) -> str:
    name = name.strip().lower()
    return ALIASES.get(name, name)


def detect_best_backend() -> str:
    """The backend selection would choose: TORCHBRIDGE_BACKEND if set, else the available
    backend with the highest priority ("cuda", "rocm", "xpu", "tpu" or "cpu")."""
    forced = os.environ.get(BACKEND_ENV)
    if forced:
        return normalize_name(forced)
    return best_available(list_backends()).name


def best_available(statuses: list[BackendStatus]) -> BackendStatus:
    status = next((s for s in statuses if s.available), None)
    if status is None:  # only if the built-in cpu plugin itself is broken
        raise BackendUnavailableError("no backend is available, not even cpu: the "
                                      "torchbridge-core installation is broken")
    return status


def backend_status(name: str, statuses: list[BackendStatus] | None = None) -> BackendStatus:
    """The status of backend `name`; BackendUnavailableError if absent or unavailable."""
    if not isinstance(name, str):
        raise BackendUnavailableError(f"backend name must be a string, got {name!r}")
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
