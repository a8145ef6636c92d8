"""What `torchbridge doctor` reports: everything a bug report needs, as plain data.

Each part is collected on its own: a part that fails (a plugin raising, a broken config)
becomes an error string in the report, never a traceback, and the other parts still come.
"""

from __future__ import annotations

import functools
import platform
import sys
from collections.abc import Callable
from typing import Any

import torch

import torchbridge
from torchbridge.backend import DEVICE_HOOKS, Backend, get_backend
from torchbridge.config import TorchBridgeConfig, hardware_sections
from torchbridge.kernels import overridden_ops
from torchbridge.kernels.choice import choose, kernel_table, known_ops
from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.pipeline import collect_passes
from torchbridge.plugins import describe, get_plugin_host, is_fatal, plugin_records
from torchbridge.selection import backend_status, list_backends

SLOW_DETECT_SECONDS = 0.5


def _safely(part: Callable[[], Any]) -> Any:
    try:
        return part()
    except BaseException as exc:
        if is_fatal(exc):
            raise
        return {"error": describe(exc)}


def _config_value(values: dict[str, Any], path: str) -> Any:
    node: Any = values
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _config_report(config: TorchBridgeConfig) -> dict[str, Any]:
    values = config.model_dump(mode="json")
    return {"values": values,
            "non_default": {path: {"value": _config_value(values, path), "source": source}
                            for path, source in sorted(config.sources.items())},
            # A config file or variable not read (a pyproject.toml hidden by
            # torchbridge.toml, a lower-case prefix): doctor runs with warnings off.
            "ignored": dict(config.ignored_sources)}


def _contributions(config: TorchBridgeConfig | None, statuses: list[Any]
                   ) -> dict[str, dict[str, Any]]:
    """plugin -> what it adds or changes: backends, sections, passes and vetoes per backend,
    kernels it answers per op, device-level hooks it overrides."""
    out: dict[str, dict[str, Any]] = {}

    def add(plugin: str, kind: str, item: str) -> None:
        items = out.setdefault(plugin, {}).setdefault(kind, [])
        if item not in items:
            items.append(item)

    for status in statuses:
        if status.plugin:
            add(status.plugin, "backends", status.name)
    for section, plugin in hardware_sections().owners.items():
        add(plugin, "config_sections", f"hardware.{section}")
    if config is None:
        return out

    def backend_contributions(status: Any) -> None:
        backend = Backend(backend_status(status.name, statuses), config)
        for plugin, p in collect_passes(backend, OptimizationLevel.O3).passes:
            if p.veto_reason is not None:
                add(plugin, "vetoes", f"{p.name} on {backend.name}: {p.veto_reason}")
            else:
                add(plugin, "passes", f"{p.name} on {backend.name}")
        for op in known_ops():
            for candidate in choose(op, backend).candidates:
                serves = candidate.implementation.backends
                if serves is not None and backend.name not in serves:
                    continue  # offered to every backend, serving others: not a contribution
                add(candidate.provider, "kernels",
                    f"{op}:{candidate.implementation.name} on {backend.name}")
        for hook in DEVICE_HOOKS:
            for impl, role in backend._answerers(hook):
                if role == "override":
                    add(impl.plugin_name, "overrides", f"{hook} of {backend.name}")
        # Asking each backend to describe itself surfaces plugins that fail when asked.
        for ask in (backend.get_device_info, backend.get_memory_stats):
            failed = _safely(ask)
            if isinstance(failed, dict) and "error" in failed:
                add(status.plugin or "?", "errors", f"{status.name}: {failed['error']}")

    for status in statuses:
        if status.available:
            failed = _safely(functools.partial(backend_contributions, status))
            if failed is not None:
                add(status.plugin or "?", "errors", f"{status.name}: {failed['error']}")
    return out


def _selected(config: TorchBridgeConfig) -> dict[str, Any]:
    backend = get_backend(config=config)
    report: dict[str, Any] = {"name": backend.name, "device": str(backend.device),
                              "device_count": backend.device_count, "plugin": backend.plugin,
                              "fallbacks": list(backend.fallbacks)}
    report["device_info"] = _safely(lambda: backend.get_device_info().to_dict())
    report["memory"] = _safely(lambda: backend.get_memory_stats().to_dict())
    report["distributed_backend"] = _safely(lambda: backend.distributed_backend)
    report["answered_by"] = dict(backend.answered_by)
    report["kernels"] = _safely(lambda: kernel_table(backend))
    return report


def collect() -> dict[str, Any]:
    report: dict[str, Any] = {
        "versions": {
            "python": sys.version.split()[0], "platform": platform.platform(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "torch_hip": getattr(torch.version, "hip", None),
            "torchbridge-core": torchbridge.__version__,
        },
    }
    statuses = _safely(list_backends)  # loads plugins, runs discovery, records errors
    report["backends"] = [s.to_dict() for s in statuses] if isinstance(statuses, list) \
        else statuses
    loaded = _safely(TorchBridgeConfig.load)  # builds the plugin sections, records errors
    config = loaded if isinstance(loaded, TorchBridgeConfig) else None
    report["config"] = _config_report(config) if config is not None else loaded
    if isinstance(statuses, list):
        report["contributions"] = _safely(lambda: _contributions(config, statuses))
    if config is None:
        report["selected"] = {"error": "no backend selected: the config is invalid"}
    else:
        report["selected"] = _safely(lambda: _selected(config))
    # Selection asked the best backends' device hooks: their health is known now.
    refreshed = _safely(list_backends)
    if isinstance(refreshed, list):
        report["backends"] = [s.to_dict() for s in refreshed]
    report["overridden_ops"] = _safely(lambda: [{"op": o, "what": w}
                                                for o, w in overridden_ops()])
    # Last, so that every error the steps above recorded is in the report.
    records = _safely(plugin_records)
    if isinstance(records, list):
        for record in records:
            if record.distribution and record.version and record.group != "builtin":
                report["versions"][record.distribution] = record.version
        report["plugins"] = [r.to_dict() for r in records]
    else:
        report["plugins"] = records
    # Problems of the plugin set as a whole: a TORCHBRIDGE_PLUGINS name no plugin has, ...
    report["plugin_warnings"] = _safely(lambda: list(get_plugin_host().warnings))
    return report


def _gib(value: int | None) -> str:
    """Bytes for people: GiB (2**30 bytes), as every human-facing figure of TorchBridge."""
    return "unknown" if value is None else f"{value / 1024**3:.2f} GiB"


def _render_plugins(plugins: Any) -> list[str]:
    if isinstance(plugins, dict):
        return [f"  error: {plugins['error']}"]
    out = []
    width = max((len(p["name"]) for p in plugins), default=16)
    for p in plugins:
        line = f"  {p['name']:<{width}} {p['status']:<9} {p['group']}"
        if p["distribution"]:
            line += f"  ({p['distribution']} {p['version'] or ''})".rstrip()
        seconds = p.get("detect_seconds")
        if seconds is not None and seconds >= SLOW_DETECT_SECONDS:
            line += f"  slow discovery: {seconds:.2f} s"
        out.append(line)
        out += [f"      error: {e}" for e in p.get("errors") or ([p["error"]] if p["error"]
                                                                 else [])]
        out += [f"      warning: {w}" for w in p.get("warnings", [])]
    return out


def _render_selected(sel: dict[str, Any]) -> list[str]:
    if "error" in sel:
        return [f"  {sel['error']}"]
    out = [f"  backend: {sel['name']} ({sel['device']}, {sel['device_count']} device(s)), "
           f"plugin {sel['plugin']}, fallbacks: {', '.join(sel['fallbacks']) or 'none'}"]
    info, mem = sel["device_info"], sel["memory"]
    if "error" in info:
        out.append(f"  device: error: {info['error']}")
    else:
        out += [f"  device: {info['name']} ({info['vendor']}, {info['architecture']})",
                f"  compute capability: {info['compute_capability']}",
                f"  dtypes: {', '.join(info['supported_dtypes'])}; low precision: "
                f"{info['preferred_low_precision_dtype'] or 'none (stays float32)'}"]
        if info.get("extra"):
            out.append("  details: " + ", ".join(f"{k}={v}" for k, v in info["extra"].items()))
        if info.get("notes"):
            out.append(f"  device notes: {info['notes']}")
    if "error" in mem:
        out.append(f"  memory: error: {mem['error']}")
    else:
        out.append(f"  memory: allocated {_gib(mem['allocated_bytes'])}, reserved "
                   f"{_gib(mem['reserved_bytes'])}, peak {_gib(mem['peak_allocated_bytes'])}, "
                   f"free {_gib(mem['free_bytes'])}, total {_gib(mem['total_bytes'])}")
        if mem.get("notes"):
            out.append(f"  memory notes: {mem['notes']}")
    out.append(f"  distributed backend: {sel['distributed_backend']}")
    answered = sel.get("answered_by") or {}
    if answered:
        out.append("  answered by: " + ", ".join(
            f"{hook.removeprefix('torchbridge_')} {who}" for hook, who in answered.items()))
    return out


def render_kernels(table: Any) -> list[str]:
    """The kernel table: each op, what runs, and each implementation's verdict."""
    if isinstance(table, dict):
        return [f"  error: {table['error']}"]
    out = []
    for entry in table:
        out.append(f"  {entry['op']}: {entry['selected']}")
        first = True
        for impl in entry["implementations"]:
            if not impl["eligible"]:
                verdict = f"not selected: {impl['reason']}"
            elif first:
                verdict, first = "selected", False
            else:
                verdict = "eligible, after the one above (lower priority or later plugin)"
            out.append(f"    {impl['name']} (plugin {impl['plugin']}; "
                       f"{', '.join(impl['backends'])}; {', '.join(impl['dtypes'])}; "
                       f"{'trains' if impl['trains'] else 'inference'}): {verdict}")
    return out


def render(report: dict[str, Any]) -> str:
    """The report as text for pasting into an issue."""
    out = ["## torchbridge doctor", "", "versions:"]
    out += [f"  {k}: {v}" for k, v in report["versions"].items()]
    problems = report.get("plugin_warnings") or []  # first: they explain what follows
    out += ["", "plugins:", *([f"  error: {problems['error']}"] if isinstance(problems, dict)
                              else [f"  warning: {w}" for w in problems]),
            *_render_plugins(report["plugins"])]
    out += ["", "backends (best first):"]
    if isinstance(report["backends"], dict):
        out.append(f"  error: {report['backends']['error']}")
    for b in report["backends"] if isinstance(report["backends"], list) else []:
        state = f"available, {b['device_count']} device(s)" if b["available"] else "unavailable"
        line = f"  {b['name']:<8} priority {b['priority']:>4}  {state}"
        if b["reason"]:
            line += f": {b['reason']}"
        if b.get("health") not in (None, "ok"):
            line += f"; passed over by selection: {b['health']}"
        out.append(line)
    contributions = report.get("contributions", {})
    out += ["", "plugin contributions:"]
    if "error" in contributions:
        out.append(f"  error: {contributions['error']}")
    else:
        for plugin, kinds in contributions.items():
            out.append(f"  {plugin}:")
            out += [f"    {kind}: {', '.join(items)}" for kind, items in kinds.items()]
    out += ["", "selected:", *_render_selected(report["selected"])]
    if "kernels" in report["selected"]:
        out += ["", "kernels (selected backend, eval mode):",
                *render_kernels(report["selected"]["kernels"])]
    overridden = report.get("overridden_ops")
    if overridden:
        out += ["", "ops overridden outside TorchBridge (torch.library):"]
        out += ([f"  error: {overridden['error']}"] if isinstance(overridden, dict)
                else [f"  {o['op']}: {o['what']}" for o in overridden])
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
        out += [f"  ignored: {what}: {why}" for what, why in cfg.get("ignored", {}).items()]
    return "\n".join(out)
