"""Loading plugins and calling hooks through one typed relay.

Loading happens once per process, lazily, under a lock. A plugin that fails to import, or
raises in an isolated hook (detection, config sections), is logged, recorded with its error
for `torchbridge doctor`, and skipped: the host keeps working.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from torchbridge import hookspecs

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUPS = ("torchbridge.backends", "torchbridge.plugins")
ALLOW_ENV = "TORCHBRIDGE_PLUGINS"
BLOCK_ENV = "TORCHBRIDGE_DISABLE_PLUGINS"


@dataclass
class PluginRecord:
    """One plugin as doctor shows it. status: loaded, failed, disabled or builtin."""

    name: str
    group: str
    status: str
    distribution: str | None = None
    version: str | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class PluginHost:
    """The pluggy PluginManager plus what happened while loading each plugin."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self._load()

    def _load(self) -> None:
        from torchbridge import cpu, generic

        # pluggy calls trylast implementations in registration order, so generic, the last
        # resort for every accelerator, is registered after the CPU plugin.
        for name, module in (("cpu", cpu), ("generic", generic)):
            self.pm.register(module, name=name)
            self.records[name] = PluginRecord(name, "builtin", "builtin", "torchbridge-core")
        allow, block = _env_names(ALLOW_ENV), _env_names(BLOCK_ENV) or set()
        for group in ENTRY_POINT_GROUPS:
            for ep in metadata.entry_points(group=group):
                self._load_entry_point(ep, group, allow, block)

    def _load_entry_point(self, ep: metadata.EntryPoint, group: str,
                          allow: set[str] | None, block: set[str]) -> None:
        dist = getattr(ep, "dist", None)
        record = PluginRecord(ep.name, group, "loaded",
                              dist.metadata["Name"] if dist else None,
                              dist.version if dist else None)
        if ep.name in self.records:
            record.status, record.error = "failed", f"duplicate plugin name {ep.name!r}"
        elif ep.name in block or (allow is not None and ep.name not in allow):
            record.status = "disabled"
            record.error = f"disabled by {BLOCK_ENV if ep.name in block else ALLOW_ENV}"
        else:
            try:
                self.pm.register(ep.load(), name=ep.name)
            except Exception as exc:  # a broken plugin must not break the host
                logger.warning("plugin %s (%s) failed to load: %s", ep.name, ep.value,
                               _describe(exc))
                record.status, record.error = "failed", _describe(exc)
        self.records[ep.name] = record

    def record_hook_error(self, plugin_name: str, hook_name: str, exc: BaseException) -> None:
        error = f"in {hook_name}: {_describe(exc)}"
        record = self.records.get(plugin_name)
        if record is None or record.error != error:  # log once, not on every discovery
            logger.warning("plugin %s raised in %s: %s", plugin_name, hook_name, _describe(exc))
        if record is not None:
            record.status, record.error = "error", error

    def call_isolated(self, hook_name: str, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        """Call every implementation on its own, in pluggy's order, skipping ones that raise.

        Yields (plugin_name, result) for each non-None result.
        """
        hook = getattr(self.pm.hook, hook_name)
        for impl in reversed(hook.get_hookimpls()):  # pluggy calls the last registered first
            try:
                result = impl.function(*(kwargs[arg] for arg in impl.argnames))
            except Exception as exc:
                self.record_hook_error(impl.plugin_name, hook_name, exc)
                continue
            if result is not None:
                yield impl.plugin_name, result

    @property
    def hook(self) -> Any:
        return self.pm.hook


_host: PluginHost | None = None
_lock = threading.Lock()


def get_plugin_host() -> PluginHost:
    """The process-wide plugin host, loaded on first use."""
    global _host
    if _host is None:
        with _lock:
            if _host is None:
                _host = PluginHost()
    return _host


def reload_plugins() -> PluginHost:
    """Forget loaded plugins and load again (after changing TORCHBRIDGE_PLUGINS, in tests)."""
    global _host
    with _lock:
        _host = PluginHost()
    from torchbridge import config

    config.forget_hardware_model()
    return _host


def register_plugin(plugin: object, name: str | None = None) -> str:
    """Register a plugin object at run time (no entry point). Returns its name."""
    host = get_plugin_host()
    registered = host.pm.register(plugin, name=name)
    assert registered is not None
    host.records[registered] = PluginRecord(registered, "runtime", "loaded")
    from torchbridge import config

    config.forget_hardware_model()
    return registered


def unregister_plugin(name: str) -> None:
    host = get_plugin_host()
    host.pm.unregister(name=name)
    host.records.pop(name, None)
    from torchbridge import config

    config.forget_hardware_model()


def plugin_records() -> list[PluginRecord]:
    return list(get_plugin_host().records.values())
