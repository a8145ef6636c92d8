"""What `torchbridge doctor` reports: everything a bug report needs, as plain data."""

from __future__ import annotations

import platform
import sys
from typing import Any

import torch

import torchbridge
from torchbridge.errors import TorchBridgeError


def _config_value(values: dict[str, Any], path: str) -> Any:
    node: Any = values
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def collect() -> dict[str, Any]:
    from torchbridge.config import TorchBridgeConfig
    from torchbridge.plugins import plugin_records
    from torchbridge.selection import get_backend, list_backends

    report: dict[str, Any] = {
        "versions": {
            "python": sys.version.split()[0], "platform": platform.platform(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "torch_hip": getattr(torch.version, "hip", None),
            "torchbridge-core": torchbridge.__version__,
        },
    }
    backends = list_backends()  # loads plugins and records detection errors
    records = plugin_records()
    for record in records:
        if record.distribution and record.version:
            report["versions"][record.distribution] = record.version
    report["plugins"] = [r.to_dict() for r in records]
    report["backends"] = [s.to_dict() for s in backends]
    try:
        config = TorchBridgeConfig.load()
    except TorchBridgeError as exc:
        report["config"] = {"error": str(exc)}
        report["selected"] = {"error": "no backend selected: the config is invalid"}
        return report
    values = config.model_dump(mode="json")
    report["config"] = {
        "values": values,
        "non_default": {path: {"value": _config_value(values, path), "source": source}
                        for path, source in sorted(config.sources.items())},
    }
    try:
        backend = get_backend(config=config)
        report["selected"] = {
            "name": backend.name, "device": str(backend.device),
            "device_count": backend.device_count,
            "device_info": backend.get_device_info().to_dict(),
            "memory": backend.get_memory_stats().to_dict(),
            "distributed_backend": backend.distributed_backend,
        }
    except TorchBridgeError as exc:
        report["selected"] = {"error": f"{type(exc).__name__}: {exc}"}
    return report


def _gb(value: int | None) -> str:
    return "unknown" if value is None else f"{value / 1024**3:.2f} GiB"


def render(report: dict[str, Any]) -> str:
    """The report as text for pasting into an issue."""
    out = ["## torchbridge doctor", "", "versions:"]
    out += [f"  {k}: {v}" for k, v in report["versions"].items()]
    out += ["", "plugins:"]
    for p in report["plugins"]:
        line = f"  {p['name']:<16} {p['status']:<9} {p['group']}"
        if p["distribution"]:
            line += f"  ({p['distribution']} {p['version'] or ''})".rstrip()
        if p["error"]:
            line += f"\n      error: {p['error']}"
        out.append(line)
    out += ["", "backends (best first):"]
    for b in report["backends"]:
        state = f"available, {b['device_count']} device(s)" if b["available"] else "unavailable"
        line = f"  {b['name']:<8} priority {b['priority']:>4}  {state}"
        if b["reason"]:
            line += f": {b['reason']}"
        out.append(line)
    out += ["", "selected:"]
    sel = report["selected"]
    if "error" in sel:
        out.append(f"  {sel['error']}")
    else:
        info, mem = sel["device_info"], sel["memory"]
        out += [f"  backend: {sel['name']} ({sel['device']}, {sel['device_count']} device(s))",
                f"  device: {info['name']} ({info['vendor']}, {info['architecture']})",
                f"  compute capability: {info['compute_capability']}",
                f"  dtypes: {', '.join(info['supported_dtypes'])}; low precision: "
                f"{info['preferred_low_precision_dtype'] or 'none (stays float32)'}",
                f"  memory: allocated {_gb(mem['allocated_bytes'])}, reserved "
                f"{_gb(mem['reserved_bytes'])}, peak {_gb(mem['peak_allocated_bytes'])}, "
                f"free {_gb(mem['free_bytes'])}, total {_gb(mem['total_bytes'])}",
                f"  distributed backend: {sel['distributed_backend']}"]
        if mem.get("notes"):
            out.append(f"  memory notes: {mem['notes']}")
        if info.get("extra"):
            out.append("  details: " + ", ".join(f"{k}={v}" for k, v in info["extra"].items()))
    out += ["", "config:"]
    cfg = report["config"]
    if "error" in cfg:
        out.append(f"  error: {cfg['error']}")
    else:
        values = cfg["values"]
        out.append(f"  optimization_level: {values['optimization_level']}, precision: "
                   f"{values['precision']}, backend: {values['backend']}, "
                   f"sections: {', '.join(values['hardware']) or 'none'}")
        if not cfg["non_default"]:
            out.append("  all values are defaults")
        for path, item in cfg["non_default"].items():
            out.append(f"  {path} = {item['value']!r}  (from {item['source']})")
    return "\n".join(out)
