"""Recordings: what each vendor plugin's probe seam sees on a machine, as JSON, and the
replay of a recording at that seam (for tests without the hardware).

Every vendor plugin asks the hardware only through one module, its probe seam
(`torchbridge_nvidia.probe`, `torchbridge_amd.probe`, `torchbridge_intel.probe`). `capture()`
calls the seam's public functions on this machine and writes down their answers;
`replay(entry, monkeypatch)` patches the same functions to give those answers back, so the
plugin, and the contract suite (`torchbridge.testing.BackendContract`), run as on the
recorded machine. `torchbridge doctor --record FILE` writes `capture()`.

Nothing identifying beyond the device is recorded: no hostname, serial number, UUID or PCI
bus id (`pci_bus_id` fields are written as null; keys in `SCRUBBED_KEYS` are dropped).

Format (`FORMAT`): {"format", "source" ("captured" or "hand-written from public
specifications"), "description", "versions": {...}, "plugins": [entry, ...]}; an entry is
{"plugin", "backend", "probe_module", "device_type", "probe": {"available", "device_count",
"reason"}, "globals": {function: answer}, "devices": [{function: answer}, ...]}.
Dataclass answers are {"type": class name in the probe module, "fields": {...}}.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

FORMAT = "torchbridge-recording/1"
CAPTURED = "captured"
HAND_WRITTEN = "hand-written from public specifications"
SCRUBBED_KEYS = frozenset({"uuid", "serial", "serial_number", "hostname", "host",
                           "pci_bus_id", "bus_id", "pci_bus", "node", "mac"})


@dataclass(frozen=True)
class ProbeSpec:
    """How to record and replay one plugin's probe seam.

    per_device: functions called as f(index) per device; per_device_with_bus: f(index,
    pci_bus_id) (telemetry, found by bus id: recorded per index); globals: f(); inert:
    functions with side effects on the device (replayed as no-ops)."""

    plugin: str
    backend: str
    module: str
    device_type: str
    per_device: tuple[str, ...]
    per_device_with_bus: tuple[str, ...] = ()
    globals: tuple[str, ...] = ()
    inert: tuple[str, ...] = ()


SPECS: dict[str, ProbeSpec] = {spec.plugin: spec for spec in (
    ProbeSpec("nvidia", "cuda", "torchbridge_nvidia.probe", "cuda",
              ("device_properties", "mem_get_info", "allocator_counters"),
              ("gpu_utilization",)),
    ProbeSpec("amd", "rocm", "torchbridge_amd.probe", "cuda",
              ("device_properties", "mem_get_info", "allocator_counters"),
              ("gpu_telemetry",), ("build_arch_list", "hip_version", "flash_attention_built")),
    ProbeSpec("intel", "xpu", "torchbridge_intel.probe", "xpu",
              ("device_properties", "tf32_supported", "mem_get_info", "allocator_counters",
               "telemetry"),
              (), ("xccl_status", "ipex_status", "triton_xpu_status"),
              ("synchronize", "empty_cache", "reset_peak_memory_stats")),
)}


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _scrub(v) for k, v in value.items()
                if str(k).lower() not in SCRUBBED_KEYS}
    if isinstance(value, (list, tuple)):
        return [_scrub(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def encode(value: Any) -> Any:
    """An answer of a probe function as JSON: dataclasses by class name and fields (the
    identifying ones nulled or dropped), tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if f.name in SCRUBBED_KEYS:
                item = None
            fields[f.name] = _scrub(item)
        return {"type": type(value).__name__, "fields": fields}
    return _scrub(value)


def decode(value: Any, module: Any) -> Any:
    """The answer back from JSON: a dataclass of the probe module, tuples where it has them."""
    if isinstance(value, dict) and set(value) == {"type", "fields"}:
        cls = getattr(module, value["type"])
        fields = {}
        for f in dataclasses.fields(cls):
            if f.name not in value["fields"]:
                continue
            item = value["fields"][f.name]
            fields[f.name] = tuple(item) if isinstance(item, list) and "tuple" in str(
                f.type) else item
        return cls(**fields)
    if isinstance(value, list):
        return tuple(value)
    return value


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return encode(fn(*args))
    except Exception as exc:  # a probe that fails is recorded as failing, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}


def capture_plugin(spec: ProbeSpec) -> dict[str, Any]:
    """What `spec`'s probe seam answers on this machine."""
    entry: dict[str, Any] = {"plugin": spec.plugin, "backend": spec.backend,
                             "probe_module": spec.module, "device_type": spec.device_type}
    try:
        module = importlib.import_module(spec.module)
    except ImportError as exc:
        entry["probe"] = {"available": False, "device_count": 0,
                          "reason": f"plugin not installed ({exc})"}
        return entry
    result = module.probe()
    entry["probe"] = {"available": bool(result.available),
                      "device_count": int(result.device_count), "reason": result.reason}
    if not result.available:
        return entry
    entry["globals"] = {name: _call(getattr(module, name)) for name in spec.globals}
    entry["devices"] = [
        {**{name: _call(getattr(module, name), i) for name in spec.per_device},
         **{name: _call(getattr(module, name), i, None) for name in spec.per_device_with_bus}}
        for i in range(int(result.device_count))]
    return entry


def _cpu_entry() -> dict[str, Any]:
    import torch

    from torchbridge.backend import get_backend

    info = get_backend("cpu").get_device_info()
    fields = info.to_dict()
    capabilities: Any = None
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        capabilities = _call(lambda: dict(get()))
    return {"plugin": "cpu", "backend": "cpu", "probe_module": None, "device_type": "cpu",
            "probe": {"available": True, "device_count": 1, "reason": None},
            "device_info": _scrub(fields), "capabilities": capabilities}


def versions() -> dict[str, Any]:
    import torch

    import torchbridge

    found: dict[str, Any] = {
        "torchbridge": torchbridge.__version__,
        "contract": getattr(torchbridge, "CONTRACT_VERSION", None),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "xpu": getattr(torch.version, "xpu", None),
        "python": platform.python_version(), "system": platform.system(),
        "machine": platform.machine()}
    from importlib import metadata

    for dist in ("torchbridge-nvidia", "torchbridge-amd", "torchbridge-intel",
                 "torchbridge-tpu"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return found


def capture(description: str = "") -> dict[str, Any]:
    """Every vendor plugin's probe on this machine, and the cpu backend, as a recording."""
    plugins = [capture_plugin(spec) for spec in SPECS.values()]
    plugins.append(_cpu_entry())
    return {"format": FORMAT, "source": CAPTURED, "description": description,
            "versions": versions(), "plugins": plugins}


def vendor_devices(recording: dict[str, Any]) -> list[dict[str, Any]]:
    """The entries of `recording` with a vendor device present (replayable)."""
    return [e for e in recording.get("plugins", ())
            if e.get("plugin") in SPECS and e.get("probe", {}).get("available")]


def write(path: str | Path, recording: dict[str, Any]) -> None:
    from torchbridge.atomic_file import write_atomically

    data = (json.dumps(recording, indent=2) + "\n").encode()
    from torchbridge.errors import TorchBridgeError

    def put(f: IO[bytes]) -> None:
        f.write(data)

    write_atomically(Path(path), put, error=TorchBridgeError, what="recording")


def load(path: str | Path) -> dict[str, Any]:
    """A recording file, checked against the format (ValueError naming the problem)."""
    data = json.loads(Path(path).read_text())
    problem = problem_of(data)
    if problem is not None:
        raise ValueError(f"{path}: {problem}")
    return data  # type: ignore[no-any-return]


def problem_of(data: Any) -> str | None:
    """Why `data` is not a recording (None: it is)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return f"not a recording: expected \"format\": {FORMAT!r}"
    if data.get("source") not in (CAPTURED, HAND_WRITTEN):
        return f"\"source\" must be {CAPTURED!r} or {HAND_WRITTEN!r}"
    if not isinstance(data.get("plugins"), list):
        return "\"plugins\" must be a list"
    for entry in data["plugins"]:
        probe = entry.get("probe") if isinstance(entry, dict) else None
        if not isinstance(probe, dict) or not isinstance(probe.get("available"), bool):
            return f"entry {entry!r:.60} has no probe answer"
        if entry.get("plugin") in SPECS and probe["available"]:
            devices = entry.get("devices")
            if not isinstance(devices, list) or len(devices) != probe.get("device_count"):
                return f"{entry['plugin']}: one \"devices\" item per device is needed"
    text = json.dumps(data).lower()
    for key in SCRUBBED_KEYS - {"node", "host", "mac"}:
        if f'"{key}": "' in text:
            return f"identifying field {key!r} recorded"
    return None


def replay(entry: dict[str, Any], monkeypatch: Any) -> Any:
    """Patch `entry`'s probe seam (and the device count torch reports for its device type)
    with `monkeypatch` so that the plugin sees the recorded devices; returns the probe
    module. Rescans backends."""
    import torchbridge
    from torchbridge import devices
    from torchbridge.types import ProbeResult

    spec = SPECS[entry["plugin"]]
    module = importlib.import_module(spec.module)
    answer = entry["probe"]
    count = int(answer["device_count"])
    monkeypatch.setattr(module, "probe", lambda: ProbeResult(
        bool(answer["available"]), count, answer.get("reason")))
    recorded = entry.get("devices", [])

    def per_device(name: str) -> Callable[..., Any]:
        values = [decode(d.get(name), module) for d in recorded]
        return lambda index, *_: values[int(index)]

    for name in (*spec.per_device, *spec.per_device_with_bus):
        if recorded and all(name in d for d in recorded):
            monkeypatch.setattr(module, name, per_device(name))
    for name, value in entry.get("globals", {}).items():
        if name in spec.globals:
            decoded = decode(value, module)
            monkeypatch.setattr(module, name, lambda decoded=decoded: decoded)
    for name in spec.inert:
        monkeypatch.setattr(module, name, lambda *args: None)
    real_count = devices.runtime_device_count
    monkeypatch.setattr(devices, "runtime_device_count",
                        lambda kind: count if kind == spec.device_type else real_count(kind))
    torchbridge.list_backends(rescan=True)
    return module
