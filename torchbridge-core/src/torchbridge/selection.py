"""Discovery and selection: the one detection path.

Every backend's presence comes from the `torchbridge_detect` hook, called once per process
(`list_backends(rescan=True)` asks again). What plugins report is checked before a backend
is offered: a malformed Detection is its plugin's error, never a crash of discovery, and the
built-in cpu backend cannot be replaced or made unavailable. The four vendor backends we ship
are known here even when their plugin is missing, so that asking for one says which package
to install.

Each plugin's detection runs under a deadline (TORCHBRIDGE_DETECT_TIMEOUT seconds, default
5; "0" turns it off): past it the plugin's backends are unavailable with that reason and the
process never waits for that hook again. Device counts no host can have are rejected. Auto-
selection takes the best available backend that answers its device hooks (device_info and
memory_stats of device 0); one that does not is passed over, with the reason in its
`health`. A rejected Detection, or the backend of a plugin that is disabled, incompatible
or broken, is reported by name, never as an unknown backend.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchbridge import devices
from torchbridge.errors import BackendUnavailableError, ConfigurationError, DeviceError
from torchbridge.plugins import (
    PluginHost,
    PluginRecord,
    cached_for,
    deprecated,
    exclusive_step,
    get_plugin_host,
)
from torchbridge.suggestions import did_you_mean
from torchbridge.types import BackendStatus, Detection

logger = logging.getLogger(__name__)

BACKEND_ENV = "TORCHBRIDGE_BACKEND"
# Default priority: NVIDIA CUDA, AMD ROCm, Intel XPU, TPU, CPU. Plugins report these.
PRIORITY = {"cuda": 100, "rocm": 90, "xpu": 80, "tpu": 70, "cpu": 0}
ALIASES = {"nvidia": "cuda", "amd": "rocm", "hip": "rocm", "intel": "xpu", "xla": "tpu"}
FALLBACKS = ("cpu", "generic")  # the core's answers a backend may opt into
_NAME = re.compile(r"[a-z][a-z0-9_-]*")
DETECT_TIMEOUT_ENV = "TORCHBRIDGE_DETECT_TIMEOUT"
DEFAULT_DETECT_TIMEOUT = 5.0  # seconds per plugin's torchbridge_detect call
MAX_DEVICES_PER_HOST = 64  # more devices of one backend than any host has


def detect_timeout() -> float | None:
    """The deadline of one plugin's detection in seconds: TORCHBRIDGE_DETECT_TIMEOUT, else
    5. None (no deadline: detection runs on the calling thread) when it is "0" or "none"."""
    raw = os.environ.get(DETECT_TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_DETECT_TIMEOUT
    if raw.strip().lower() in ("0", "none", "off"):
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigurationError(f"{DETECT_TIMEOUT_ENV}={raw!r}: expected a number of seconds "
                                 "such as 5 or 0.5 (0 turns the deadline off)",
                                 field=DETECT_TIMEOUT_ENV, value=raw,
                                 source=f"environment variable {DETECT_TIMEOUT_ENV}")
    return seconds


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


def plugin_state(record: PluginRecord) -> str | None:
    """Why a plugin reports no backend: disabled, incompatible, failed to load, its
    detection timed out or raised; None when it is loaded and well."""
    if record.status == "disabled":
        return f"plugin {record.name} is {record.error}"
    if record.status == "incompatible":
        return f"plugin {record.name} is incompatible: {record.error}"
    if record.status == "failed":
        return f"plugin {record.name} failed to load: {record.error}"
    if record.detect_timed_out:
        return f"plugin {record.name}'s detection {_timeout_error(record)}"
    detect_errors = [e for e in record.errors if e.startswith("in torchbridge_detect:")]
    if detect_errors:
        return f"plugin {record.name} failed to detect: {detect_errors[0]}"
    return None


def _timeout_error(record: PluginRecord) -> str:
    message = next((e for e in record.errors if "timed out after" in e), "timed out")
    return message.removeprefix("in torchbridge_detect: ")


def _missing_status(host: PluginHost, name: str, known: KnownBackend) -> BackendStatus:
    record = _known_record(host, known)
    hint: str | None = f"pip install torchbridge[{known.extra}]"
    if record is None:
        reason = f"plugin {known.distribution} is not installed ({hint})"
    elif record.status == "disabled":
        reason, hint = f"plugin {known.plugin} is {record.error}", None
    elif record.status == "incompatible":
        reason = f"plugin {record.name} is incompatible: {record.error}"
        hint = f"pip install --upgrade {known.distribution}"
    elif record.detect_timed_out:
        reason, hint = f"plugin {record.name}'s detection {_timeout_error(record)}", None
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
    if det.device_count > MAX_DEVICES_PER_HOST:
        return (f"{name}: claims {det.device_count} devices; no host has more than "
                f"{MAX_DEVICES_PER_HOST} of one backend")
    cpus = os.cpu_count() or 1
    if det.device_type == "cpu" and det.device_count > cpus:
        return (f"{name}: claims {det.device_count} cpu-hosted device(s), but this host has "
                f"{cpus} CPU(s)")
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


def _rejected_status(det: Detection, plugin: str, problem: str) -> BackendStatus | None:
    """An unavailable row for a rejected Detection whose name is usable, so that asking
    for it says why (None when the name itself is the problem)."""
    name = det.name
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in ALIASES:
        return None
    priority = det.priority if isinstance(det.priority, int) \
        and not isinstance(det.priority, bool) else 0
    device_type = det.device_type if isinstance(det.device_type, str) else "unknown"
    vendor = det.vendor if isinstance(det.vendor, str) else None
    reason = (f"plugin {plugin} reported it, but its Detection was rejected: "
              f"{problem.removeprefix(f'{name}: ')}")
    return BackendStatus(name, False, priority, device_type, 0, vendor, reason, plugin)


# backend name -> the plugin that reported it, over this process: a backend whose plugin is
# later disabled, incompatible or broken is still reported by name.
_reported_by: dict[str, str] = {}


def _discover(host: PluginHost) -> list[BackendStatus]:
    found: dict[str, BackendStatus] = {}
    rejected: dict[str, BackendStatus] = {}
    timeout = detect_timeout()
    for impl in host.implementations("torchbridge_detect"):
        plugin = impl.plugin_name
        record = host.records.get(plugin)
        builtin = record is not None and record.group == "builtin"
        started = time.perf_counter()
        # The built-ins are the core's code, asked on this thread: cpu is never late.
        ok, result = host.call_one_within(impl, "torchbridge_detect", {},
                                          None if builtin else timeout)
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
                row = _rejected_status(det, plugin, problem) \
                    if isinstance(det, Detection) else None
                if row is not None:
                    rejected.setdefault(row.name, row)
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
                deprecated(plugin, f"backend {det.name!r} leans on the core's fallback answers "
                           "without opting in",
                           "set Detection(fallbacks=(...)) (\"generic\", \"cpu\") or () and "
                           "answer every device-level hook yourself", stacklevel=2)
            _reported_by.setdefault(det.name, plugin)
            found[det.name] = BackendStatus(
                det.name, det.available, det.priority, det.device_type,
                det.device_count if det.available else 0, det.vendor, det.reason, plugin,
                fallbacks=det.fallbacks, detect_seconds=seconds)
    for name, known in KNOWN_BACKENDS.items():
        if name not in found:
            found[name] = _missing_status(host, name, known)
    for name, row in rejected.items():
        found.setdefault(name, row)
    for name, plugin in _reported_by.items():  # reported earlier, by a plugin now silent
        record = host.records.get(plugin)
        state = plugin_state(record) if record is not None else None
        if name not in found and state is not None and record is not None:
            found[name] = BackendStatus(name, False, 0, "unknown", 0, None, state, plugin)
    return sorted(found.values(), key=lambda s: (-s.priority, s.name))


@dataclass
class _Discovery:
    statuses: list[BackendStatus]
    health: dict[str, str]  # backend -> "ok" or why selection passed it over


_discovery: tuple[PluginHost, int, _Discovery] | None = None


def _current() -> _Discovery:
    global _discovery
    host = get_plugin_host()
    cached: _Discovery | None = cached_for(_discovery, host)
    if cached is not None:
        return cached
    with exclusive_step("discovering backends"):
        found = _Discovery(_discover(host), {})
    _discovery = (host, host.generation, found)
    return found


def list_backends(rescan: bool = False) -> list[BackendStatus]:
    """Every known backend, best first, with availability and, when unavailable, why.
    Discovery runs once per plugin set; `rescan=True` asks every plugin again (after a
    driver appeared, in tests that replay recorded devices), except those whose detection
    timed out earlier in this process. `health` says what auto-selection found."""
    global _discovery
    if rescan:
        _discovery = None
    found = _current()
    return [dataclasses.replace(s, health=found.health[s.name]) if s.name in found.health
            else s for s in found.statuses]


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


def same_device_key(spec: str) -> tuple[str, int]:
    """What a backend string names, spelled any way: "CPU", "cpu:0" and "cpu" are one
    device, as are an alias and its backend ("nvidia", "cuda:0")."""
    name, index = parse_backend_spec(spec)
    return normalize_name(name), index


def detect_best_backend() -> str:
    """TORCHBRIDGE_BACKEND if set, else the available backend with the highest priority
    ("cuda", "rocm", "xpu", "tpu" or "cpu"): what get_backend() chooses unless a config
    file or config object names a backend (`backend = ...`), which this does not read, so
    that discovery stays cheap (no pydantic: tests/test_errors_and_types.py).

    TORCHBRIDGE_BACKEND is checked as get_backend() checks it: the backend's name (an
    alias resolved; with ":N" where it names a device index), or the error get_backend()
    would raise (a malformed value, an unknown or unavailable backend), not the value as
    it stands."""
    forced = os.environ.get(BACKEND_ENV)
    if forced:
        name, index = parse_backend_spec(forced)
        status = backend_status(name)
        return status.name if ":" not in forced else f"{status.name}:{index}"
    return best_available(list_backends()).name


def best_available(statuses: list[BackendStatus]) -> BackendStatus:
    """The first available backend of `statuses` (best first) that answers its device
    hooks; each one that does not is passed over, the reason kept as its `health`. The
    built-in cpu backend is not asked: it is the last resort."""
    found = _current()
    for status in statuses:
        if not status.available:
            continue
        if status.plugin == "cpu" or status.name == "cpu":
            return status
        health = found.health.get(status.name)
        if health is None:
            problem = health_problem(status)
            health = found.health[status.name] = "ok" if problem is None else problem
            if problem is not None:
                logger.warning("backend %s passed over by selection: %s", status.name,
                               problem)
        if health == "ok":
            return dataclasses.replace(status, health=health)
    # only if the built-in cpu plugin itself is broken
    raise BackendUnavailableError("no backend is available, not even cpu: the "
                                  "torchbridge-core installation is broken")


# How selection asks a backend's device hooks: through the Backend facade, which registers
# its check when torchbridge.backend is imported (this layer cannot import the facade above
# it).
_health_check: Callable[[BackendStatus], str | None] | None = None


def register_health_check(check: Callable[[BackendStatus], str | None]) -> None:
    global _health_check
    _health_check = check


def health_problem(status: BackendStatus) -> str | None:
    """None when backend `status` answers device_info and memory_stats of device 0; else
    what went wrong."""
    if _health_check is None:
        # A process that has only detected so far (a bare detect_best_backend()): the
        # package's lazy attribute imports the facade, which registers the check. Paid only
        # when an accelerator backend is the candidate (cpu is never asked).
        import torchbridge

        torchbridge.Backend  # noqa: B018
    assert _health_check is not None
    return _health_check(status)


def backend_status(name: str, statuses: list[BackendStatus] | None = None) -> BackendStatus:
    """The status of backend `name`; BackendUnavailableError if absent or unavailable."""
    if not isinstance(name, str):
        raise BackendUnavailableError(f"backend name must be a string, got {name!r}")
    name = normalize_name(name)
    statuses = list_backends() if statuses is None else statuses
    status = next((s for s in statuses if s.name == name), None)
    if status is None:
        state = _silent_plugin(name)
        if state is not None:
            raise BackendUnavailableError(f"backend {name!r} is unavailable: {state}",
                                          backend=name)
        raise BackendUnavailableError(unknown_backend_message(name, statuses), backend=name)
    if not status.available:
        hint = f"; to install: {status.install_hint}" if status.install_hint else ""
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {status.reason}{hint}",
                                      backend=name, install_hint=status.install_hint)
    return status


def unknown_backend_message(name: str, statuses: list[BackendStatus]) -> str:
    """"unknown backend 'cdua'; known backends: ...; did you mean 'cuda'?"."""
    known = [s.name for s in statuses]
    return (f"unknown backend {name!r}; known backends: {', '.join(known)}"
            + did_you_mean(name, [*known, *ALIASES]))


def _silent_plugin(name: str) -> str | None:
    """Why a plugin named `name` (its entry point's name) reports no backend, when it is
    disabled, incompatible or broken: a backend is often named after its plugin."""
    host = get_plugin_host()
    for record in host.records.values():
        if record.name == name or record.name.startswith(f"{name}["):
            state = plugin_state(record)
            if state is not None:
                return f"{state} (no other plugin reports a backend of this name)"
    return None
