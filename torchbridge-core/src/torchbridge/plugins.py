"""The plugin host: loading plugins and calling their hooks, each call isolated.

Loading happens once per process, lazily. The built-in plugins (cpu, generic) are loaded the
way entry points are, by module path, so nothing in the core imports them. A plugin that
fails to import, or raises anything but KeyboardInterrupt in a hook (SystemExit included),
is logged, recorded with its error for `torchbridge doctor`, and skipped: the host keeps
working. A plugin that calls back into torchbridge while the host is loading it, or while the
same step is running (discovery, config sections), gets a PluginError instead of a deadlock
or an endless recursion.

The contract a plugin is written against is versioned: `torchbridge.CONTRACT_VERSION`, a
semantic version. A plugin module may declare the range it was written for,
`TORCHBRIDGE_CONTRACT = ">=3,<4"`; outside it the plugin is reported "incompatible" and not
registered. A behaviour a plugin may rely on changes only in a new major version, after a
release of the old major version that warns about it (`deprecated`). The names of the
built-in plugins (cpu, generic, triton) belong to the core: an entry point using one is
reported and never loaded, `register_plugin` refuses them, and `unregister_plugin` cannot
remove them. A name in TORCHBRIDGE_PLUGINS or TORCHBRIDGE_DISABLE_PLUGINS that is no
installed entry point is a warning (logged, and shown by doctor), not an error: the
variable may be set for machines where that plugin is installed.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from torchbridge import CONTRACT_VERSION, hookspecs
from torchbridge.errors import PluginError
from torchbridge.suggestions import did_you_mean

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUPS = ("torchbridge.backends", "torchbridge.plugins")
ALLOW_ENV = "TORCHBRIDGE_PLUGINS"
BLOCK_ENV = "TORCHBRIDGE_DISABLE_PLUGINS"
CONTRACT_ATTRIBUTE = "TORCHBRIDGE_CONTRACT"  # module attribute: the contract range declared
# Loaded first, always (allow/block lists do not apply), in this order: pluggy calls trylast
# implementations in registration order, so generic, the last resort, comes after cpu.
MAX_ERRORS = 20  # distinct errors kept per plugin: a plugin failing in a loop stays readable
BUILTIN_PLUGINS = {"cpu": "torchbridge.builtin.cpu.plugin",
                   "generic": "torchbridge.builtin.generic",
                   "triton": "torchbridge.builtin.triton"}


@dataclass
class PluginRecord:
    """One plugin as doctor shows it. status: builtin, loaded, failed, disabled,
    incompatible (declares a TORCHBRIDGE_CONTRACT range this core is outside of; not
    registered) or error (loaded, then raised or misbehaved in a hook, or its detection
    timed out). `name` is the name it is registered under: the entry point's name, or
    `name[distribution]` when two distributions use it or it is a built-in plugin's name.
    `contract` is the TORCHBRIDGE_CONTRACT range it declared, if any."""

    name: str
    group: str
    status: str
    distribution: str | None = None
    version: str | None = None
    error: str | None = None  # the first error; `errors` has every distinct one
    module: str | None = None
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    detect_seconds: float | None = None
    contract: str | None = None
    detect_timed_out: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "warnings": list(self.warnings), "errors": list(self.errors)}

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            logger.warning("plugin %s: %s", self.name, message)
            self.warnings.append(message)


def describe(exc: BaseException) -> str:
    """`TypeError: message` on one line (pydantic's errors span several)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def selection_problems(allow: set[str] | None, block: set[str], installed: set[str]
                       ) -> list[str]:
    """What is wrong with the names in TORCHBRIDGE_PLUGINS (`allow`) and
    TORCHBRIDGE_DISABLE_PLUGINS (`block`), given the entry-point names `installed`: a name
    that is no installed plugin (a typo, or a plugin installed elsewhere; names match
    exactly, case included), or a built-in plugin named in the block list (built-ins are
    always loaded). A built-in named in the allow list is fine: it is loaded anyway."""
    problems = []
    shown = ", ".join(sorted(installed)) or "none"
    for var, names in ((ALLOW_ENV, allow or set()), (BLOCK_ENV, block)):
        for name in sorted(names):
            if name in BUILTIN_PLUGINS:
                if var == BLOCK_ENV:
                    problems.append(f"{var} names {name!r}, a built-in plugin; built-in "
                                    "plugins are always loaded and cannot be disabled")
            elif name not in installed:
                problems.append(f"{var} names {name!r}, which is no installed plugin; "
                                f"ignored (installed plugins: {shown})"
                                + did_you_mean(name, installed))
    return problems


# -- the contract version -------------------------------------------------------------------
_CLAUSE = re.compile(r"\s*(>=|<=|==|!=|>|<|~=)\s*(\d+(?:\.\d+){0,2})(\.\*)?\s*")
_Version = tuple[int, int, int]


def parse_version(text: str) -> _Version:
    """"3", "3.1" or "3.1.2" as (3, 0, 0), (3, 1, 0), (3, 1, 2); ValueError otherwise."""
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isascii() and p.isdigit() for p in parts):
        raise ValueError(f"{text!r} is not a version such as 3, 3.1 or 3.1.2")
    numbers = [int(p) for p in parts] + [0, 0]
    return numbers[0], numbers[1], numbers[2]


def contract_problem(spec: object, version: str = CONTRACT_VERSION) -> str | None:
    """None when contract `version` satisfies `spec`, a comma-separated list of clauses
    such as ">=3,<4", ">=3.1", "==3.*", "~=3.1" (PEP 440 operators on X[.Y[.Z]] versions,
    missing parts are 0); else why not. A spec that cannot be read raises ValueError."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{CONTRACT_ATTRIBUTE} must be a version range such as \">=3,<4\", "
                         f"got {spec!r}")
    have = parse_version(version)
    for clause in spec.split(","):
        match = _CLAUSE.fullmatch(clause)
        if match is None:
            raise ValueError(f"{CONTRACT_ATTRIBUTE} {spec!r}: cannot read {clause.strip()!r}; "
                             "expected clauses such as >=3 and <4, separated by commas")
        op, text, star = match.groups()
        if star and op not in ("==", "!="):
            raise ValueError(f"{CONTRACT_ATTRIBUTE} {spec!r}: '.*' goes with == or != only")
        want = parse_version(text)
        if star:
            size = len(text.split("."))
            ok = (have[:size] == want[:size]) == (op == "==")
        elif op == "~=":
            size = len(text.split("."))
            if size < 2:
                raise ValueError(f"{CONTRACT_ATTRIBUTE} {spec!r}: ~= needs X.Y")
            ok = have >= want and have[:size - 1] == want[:size - 1]
        else:
            ok = {">=": have >= want, "<=": have <= want, ">": have > want, "<": have < want,
                  "==": have == want, "!=": have != want}[op]
        if not ok:
            return (f"written for plugin contract {spec.strip()}, but this torchbridge-core "
                    f"implements contract {version}")
    return None


def deprecated(plugin: str | None, what: str, change: str, *, removed_in: str | None = None,
               stacklevel: int = 2) -> str:
    """Warn that `plugin` relies on `what`, which changes or goes in contract `removed_in`
    (default: the next major version), and say what to `change`. A DeprecationWarning
    (once per call site, as Python shows them), and a warning on the plugin's record for
    doctor. Every change of a behaviour a plugin may rely on is announced this way for at
    least one release before it happens. Returns the message."""
    until = removed_in or f"{parse_version(CONTRACT_VERSION)[0] + 1}.0.0"
    message = (f"plugin {plugin or '?'}: {what}; this is deprecated and changes in plugin "
               f"contract {until} (this core implements {CONTRACT_VERSION}): {change}")
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)
    host = _host
    record = host.records.get(plugin) if host is not None and plugin is not None else None
    if record is not None:
        record.warn(message.removeprefix(f"plugin {plugin}: "))
    return message


_local = threading.local()


@contextmanager
def exclusive_step(step: str) -> Iterator[None]:
    """Mark `step` ("loading plugins", "discovering backends", ...) as running on this
    thread. A plugin hook that re-enters the same step gets a PluginError naming it."""
    active: set[str] = getattr(_local, "steps", set())
    if step in active:
        raise PluginError(f"a plugin called back into torchbridge while {step}; that step "
                          "cannot run inside itself (call torchbridge from your hooks, "
                          "not while they are being collected)")
    _local.steps = active | {step}
    try:
        yield
    finally:
        _local.steps = active


def is_fatal(exc: BaseException) -> bool:
    """What a plugin may not swallow for the user: Ctrl-C."""
    return isinstance(exc, KeyboardInterrupt)


class PluginHost:
    """The pluggy PluginManager plus what happened while loading and calling each plugin."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        # Problems of the plugin set as a whole (TORCHBRIDGE_PLUGINS naming no installed
        # plugin, ...), each logged once and shown by doctor.
        self.warnings: list[str] = []
        self.generation = 0  # bumped on every (un)registration: caches key on it
        self._load()

    # -- loading ------------------------------------------------------------------------
    def _load(self) -> None:
        for name, module in BUILTIN_PLUGINS.items():
            # A built-in that cannot load is a broken installation, not a plugin to skip.
            self._register(importlib.import_module(module), name)
            self.records[name] = PluginRecord(name, "builtin", "builtin", "torchbridge-core",
                                              module=module)
        allow, block = _env_names(ALLOW_ENV), _env_names(BLOCK_ENV) or set()
        entries = [(group, ep) for group in ENTRY_POINT_GROUPS
                   for ep in metadata.entry_points(group=group)]
        dists_by_name: dict[str, set[str | None]] = {}
        for _, ep in entries:
            dists_by_name.setdefault(ep.name, set()).add(_distribution(ep)[0])
        for problem in selection_problems(allow, block, set(dists_by_name)):
            logger.warning("%s", problem)
            self.warnings.append(problem)
        for group, ep in entries:
            clashing = sorted(str(d) for d in dists_by_name[ep.name] if d != _distribution(ep)[0])
            self._load_entry_point(ep, group, allow, block, clashing)

    def _load_entry_point(self, ep: metadata.EntryPoint, group: str, allow: set[str] | None,
                          block: set[str], clashing: list[str]) -> None:
        dist, version = _distribution(ep)
        builtin = ep.name in BUILTIN_PLUGINS
        name = f"{ep.name}[{dist or ep.value}]" if clashing or builtin else ep.name
        duplicate = name in self.records
        if duplicate:  # declared twice: the first keeps its record
            name = f"{name}[{group}]"
        record = PluginRecord(name, group, "loaded", dist, version, module=ep.value)
        if clashing and not builtin:
            record.warn(f"entry point name {ep.name!r} is also used by "
                        f"{', '.join(clashing)}; registered as {name!r}")
        if builtin:  # never imported: it could neither replace nor remove the built-in
            record.status = "failed"
            record.error = (f"entry point name {ep.name!r} is the built-in plugin's; an entry "
                            "point cannot replace it (rename the entry point)")
        elif duplicate:
            record.status = "failed"
            record.error = f"entry point {ep.name!r} is declared twice"
        elif ep.name in block or (allow is not None and ep.name not in allow):
            record.status = "disabled"
            record.error = f"disabled by {BLOCK_ENV if ep.name in block else ALLOW_ENV}"
        else:
            try:
                plugin = ep.load()
            except BaseException as exc:  # a broken plugin must not break the host
                if is_fatal(exc):
                    raise
                logger.warning("plugin %s (%s) failed to load: %s", name, ep.value,
                               describe(exc))
                record.status, record.error = "failed", f"at import: {describe(exc)}"
                record.errors.append(record.error)
            else:
                self._register_checked(plugin, record)
        self.records[name] = record

    def _register_checked(self, plugin: object, record: PluginRecord) -> None:
        """Register an imported plugin unless it declares a contract range this core is
        outside of (status "incompatible": reported, never called)."""
        if not self.refused_by_contract(plugin, record, "at import"):
            self._register(plugin, record.name)

    def refused_by_contract(self, plugin: object, record: PluginRecord, when: str) -> bool:
        """Whether `plugin`'s TORCHBRIDGE_CONTRACT keeps it out: a range that cannot be read
        (status "failed") or that this core is outside of ("incompatible"), said on
        `record`. False for a plugin that declares none, or whose range holds."""
        spec = getattr(plugin, CONTRACT_ATTRIBUTE, None)
        if spec is None:
            return False
        record.contract = spec if isinstance(spec, str) else repr(spec)
        try:
            problem = contract_problem(spec)
        except ValueError as exc:
            record.status, record.error = "failed", f"{when}: {exc}"
            record.errors.append(record.error)
            return True
        if problem is None:
            return False
        logger.warning("plugin %s is incompatible: %s", record.name, problem)
        record.status = "incompatible"
        record.error = (f"{problem}; not loaded (install a release of "
                        f"{record.distribution or 'the plugin'} written for contract "
                        f"{CONTRACT_VERSION}, or a torchbridge-core its range allows)")
        record.errors.append(record.error)
        return True

    def _register(self, plugin: object, name: str) -> None:
        self.pm.register(plugin, name=name)
        self.generation += 1

    def check_plugin(self, name: str) -> None:
        """Warn about hook implementations that match no hookspec (a typo, as pluggy's
        check_pending finds) and `torchbridge_*` functions without `@hookimpl`."""
        plugin = self.pm.get_plugin(name)
        record = self.records.get(name)
        if plugin is None or record is None:
            return
        for caller in self.pm.get_hookcallers(plugin) or []:
            if caller.spec is None:
                record.warn(f"implements {caller.name}, which is no torchbridge hook "
                            "(a typo?); it is never called")
        implemented = {impl.function.__name__ for caller in self.pm.get_hookcallers(plugin)
                       or [] for impl in caller.get_hookimpls() if impl.plugin is plugin}
        for attr in dir(plugin):
            if attr.startswith("torchbridge_") and attr not in implemented and \
                    callable(getattr(plugin, attr, None)):
                record.warn(f"{attr} is not decorated with @torchbridge.hookimpl; "
                            "it is never called")

    # -- calling ------------------------------------------------------------------------
    def record_hook_error(self, plugin_name: str, hook_name: str, error: BaseException | str
                          ) -> str:
        """Record that `plugin_name` misbehaved in `hook_name`; returns the message."""
        text = error if isinstance(error, str) else describe(error)
        message = f"in {hook_name}: {text}"
        record = self.records.get(plugin_name)
        if record is None or message not in record.errors:  # log once, not on every call
            logger.warning("plugin %s %s", plugin_name, message)
        if record is not None:
            if message not in record.errors and len(record.errors) < MAX_ERRORS:
                record.errors.append(message)
            record.error = record.error or message
            if record.status in ("loaded", "builtin"):
                record.status = "error"
        return message

    def implementations(self, hook_name: str) -> list[pluggy.HookImpl]:
        """The plain implementations of a hook, in the order pluggy would call them.
        Wrappers are reported: hooks called one implementation at a time cannot wrap."""
        impls = []
        for impl in reversed(getattr(self.pm.hook, hook_name).get_hookimpls()):
            if impl.hookwrapper or impl.wrapper:
                self.record_hook_error(impl.plugin_name, hook_name,
                                       "wrappers are not supported on this hook; ignored")
                continue
            impls.append(impl)
        return impls

    def call_one(self, impl: pluggy.HookImpl, hook_name: str, kwargs: dict[str, Any],
                 check: Callable[[Any], str | None] | None = None) -> tuple[bool, Any]:
        """Call one implementation with the arguments it names. (True, result) on success;
        (False, message) when it raised or `check(result)` named a problem (recorded)."""
        try:
            result = impl.function(*(kwargs[arg] for arg in impl.argnames))
        except BaseException as exc:
            if is_fatal(exc):
                raise
            return False, self.record_hook_error(impl.plugin_name, hook_name, exc)
        problem = check(result) if check is not None and result is not None else None
        if problem is not None:
            return False, self.record_hook_error(impl.plugin_name, hook_name, problem)
        return True, result

    def call_one_within(self, impl: pluggy.HookImpl, hook_name: str, kwargs: dict[str, Any],
                        timeout: float | None,
                        check: Callable[[Any], str | None] | None = None) -> tuple[bool, Any]:
        """call_one under a deadline of `timeout` seconds (None: no deadline, on this
        thread). The hook runs in a daemon thread; past the deadline it is left running,
        recorded as this plugin's error, and never waited for again in this process: a
        rescan, or a reload of the plugins, answers at once with the same error while it
        runs, and takes its answer once it has given one (a TPU runtime that started in
        6 s on a busy machine was lost to the process for good)."""
        if timeout is None:
            return self.call_one(impl, hook_name, kwargs, check)
        key = _hook_key(impl, hook_name)
        record = self.records.get(impl.plugin_name)
        abandoned = _timed_out.get(key)
        if abandoned is not None and abandoned.fatal:
            del _timed_out[key]  # a Ctrl-C or exit on its thread: not an answer
        elif abandoned is not None and abandoned.outcome:
            del _timed_out[key]
            if record is not None:
                _forget_timeout(record, hook_name, abandoned.deadline)
            logger.info("plugin %s answered %s after its deadline; taken now",
                        impl.plugin_name, hook_name)
            return abandoned.outcome[0]
        if abandoned is not None:
            if record is not None:
                record.detect_timed_out = True
            return False, self.record_hook_error(impl.plugin_name, hook_name,
                                                 _timeout_message(abandoned.deadline))
        outcome: list[tuple[bool, Any]] = []
        fatal: list[BaseException] = []
        steps: set[str] = getattr(_local, "steps", set())

        def run() -> None:
            _local.steps = steps  # re-entering discovery from the hook is still refused
            try:
                outcome.append(self.call_one(impl, hook_name, kwargs, check))
            except BaseException as exc:  # Ctrl-C: raised again on the calling thread
                fatal.append(exc)

        thread = threading.Thread(target=run, daemon=True,
                                  name=f"torchbridge {hook_name} {impl.plugin_name}")
        thread.start()
        thread.join(timeout)
        if fatal:
            raise fatal[0]
        if not outcome:  # still running: left behind, a daemon thread
            _timed_out[key] = _Abandoned(timeout, outcome, fatal)
            if record is not None:
                record.detect_timed_out = True
            return False, self.record_hook_error(impl.plugin_name, hook_name,
                                                 _timeout_message(timeout))
        return outcome[0]

    def call_each(self, hook_name: str, check: Callable[[Any], str | None] | None = None,
                  **kwargs: Any) -> Iterator[tuple[str, Any]]:
        """Every implementation on its own, in pluggy's order; (plugin, result) for each
        non-None result that passes `check`. One raising is recorded and skipped."""
        for impl in self.implementations(hook_name):
            ok, result = self.call_one(impl, hook_name, kwargs, check)
            if ok and result is not None:
                yield impl.plugin_name, result


@dataclass
class _Abandoned:
    """A hook call left running past its deadline, and what its thread has given since:
    its (ok, result) in `outcome`, or in `fatal` what it raised that is not an answer."""

    deadline: float
    outcome: list[tuple[bool, Any]]
    fatal: list[BaseException]


# Hooks that ran past their deadline in this process: (plugin, module, function, hook) ->
# the call left running. Kept across reload_plugins(): a hanging probe hangs again.
_timed_out: dict[tuple[str, str, str, str], _Abandoned] = {}


def _forget_timeout(record: PluginRecord, hook_name: str, deadline: float) -> None:
    """The record as if the hook had answered in time: its timeout error gone, and its
    status back where nothing else went wrong."""
    message = f"in {hook_name}: {_timeout_message(deadline)}"
    record.errors = [e for e in record.errors if e != message]
    record.detect_timed_out = False
    if record.error == message:
        record.error = record.errors[0] if record.errors else None
    if record.status == "error" and not record.errors:
        record.status = "builtin" if record.group == "builtin" else "loaded"


def _hook_key(impl: pluggy.HookImpl, hook_name: str) -> tuple[str, str, str, str]:
    function = impl.function
    return (impl.plugin_name, str(getattr(function, "__module__", "")),
            str(getattr(function, "__qualname__", "")), hook_name)


def _timeout_message(timeout: float) -> str:
    return (f"timed out after {timeout:g} s (TORCHBRIDGE_DETECT_TIMEOUT); left running in "
            "the background and not asked again in this process (a rescan takes its answer "
            "once it gives one)")


def cached_for(cache: tuple[PluginHost, int, Any] | None, host: PluginHost) -> Any:
    """The value of a (host, generation, value) cache when it was built for the current
    plugin set, else None. Discovery and config sections are cached this way."""
    if cache is not None and cache[0] is host and cache[1] == host.generation:
        return cache[2]
    return None


def _distribution(ep: metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


_host: PluginHost | None = None
_lock = threading.Lock()


def get_plugin_host() -> PluginHost:
    """The process-wide plugin host, loaded on first use. A plugin that calls torchbridge
    at import gets a PluginError (its import fails and is reported), not a deadlock."""
    global _host
    if _host is None:
        with exclusive_step("loading plugins"), _lock:
            if _host is None:
                host = PluginHost()
                for name in host.records:
                    host.check_plugin(name)
                _host = host
    return _host


def reload_plugins() -> PluginHost:
    """Forget loaded plugins and load again (after changing TORCHBRIDGE_PLUGINS, in tests).
    Discovery and config sections are redone on next use."""
    global _host
    with _lock:
        _host = None
    return get_plugin_host()


class _Taken(PluginError, ValueError):
    """A plugin name or object already registered. Also a ValueError: pluggy raised one
    there before, and callers may catch it."""


def _name_holder(host: PluginHost, name: str) -> tuple[str, str] | None:
    """Who holds plugin name `name`, in words, and what the caller can do about it; None
    when the name is free (the record of a refused run-time registration holds none)."""
    record = host.records.get(name)
    if name in BUILTIN_PLUGINS or (record is not None and record.group == "builtin"):
        return f"the built-in plugin {name!r} of torchbridge-core", "choose another name"
    plugin = host.pm.get_plugin(name)
    release = f"unregister_plugin({name!r}) first, or choose another name"
    if record is not None and record.group != "runtime" and plugin is not None:
        dist = f" of {record.distribution}" if record.distribution else ""
        return (f"the installed plugin {name!r}{dist} (entry point {record.module}, "
                f"{record.status})", release)
    # An entry point that is not loaded (disabled, failed, incompatible) holds no name: a
    # fixed plugin registered under it replaces its record, as it always did.
    if plugin is not None:
        return f"the plugin {name!r} registered at run time ({type(plugin).__name__})", release
    return None


def register_plugin(plugin: object, name: str | None = None) -> str:
    """Register a plugin object at run time (no entry point). Returns its name. A name in
    use (a built-in plugin's, an installed entry point's, one registered earlier) or an
    object already registered raises PluginError naming who holds it, and changes
    nothing. A plugin whose TORCHBRIDGE_CONTRACT range this core is outside of (or which
    is no range) is recorded as entry-point plugins are ("incompatible", or "failed") and
    never called, and this raises PluginError saying why; registering a fixed plugin under
    that name later replaces the record."""
    host = get_plugin_host()
    if plugin is None:
        raise PluginError("register_plugin needs a plugin object, got None")
    name = name or None  # "" as before: pluggy's canonical name
    for held, other in host.pm.list_name_plugin():
        if other is plugin:
            raise _Taken(f"this plugin object is already registered as {held!r}; "
                              "nothing was changed (register it once, or register "
                              "another instance under another name)")
    holder = _name_holder(host, name) if name is not None else None
    if holder is not None:
        raise _Taken(f"plugin name {name!r} is already in use by {holder[0]}; nothing "
                     f"was changed ({holder[1]})")
    if name is not None and host.pm.is_blocked(name):
        raise PluginError(f"plugin name {name!r} is blocked; nothing was changed")
    label = name or type(plugin).__name__  # the record of a refusal: a readable name
    if name is None and _name_holder(host, label) is not None:
        label = host.pm.get_canonical_name(plugin)
    record = PluginRecord(label, "runtime", "loaded")
    if host.refused_by_contract(plugin, record, "at registration"):
        # Only a name no plugin holds gets here (or the record of an earlier refusal).
        host.records[label] = record
        host.generation += 1
        raise PluginError(f"plugin {label!r} not registered: {record.error}")
    try:
        registered = host.pm.register(plugin, name=name)
    except ValueError as exc:  # pluggy's: a name or object taken (checked above: a race)
        raise _Taken(f"plugin {label!r} not registered: {exc}".splitlines()[0]) from None
    if registered is None:
        raise PluginError(f"plugin name {label!r} is blocked; nothing was changed")
    host.generation += 1
    host.records[registered] = PluginRecord(registered, "runtime", "loaded")
    host.check_plugin(registered)
    return registered


def unregister_plugin(name: str) -> None:
    """Remove the plugin registered under `name`: one registered at run time (the name
    register_plugin returned), an entry point's plugin that is loaded, or the record of a
    run-time registration that was refused. The built-in cpu plugin cannot be removed
    (PluginError, nothing changes: every backend falls back to it). Removing the built-in
    generic or triton plugin, and a name that is not registered (a typo, a plugin that is
    disabled or failed to load), are DeprecationWarnings: they do what they did, and raise
    PluginError from plugin contract 4."""
    host = get_plugin_host()
    record = host.records.get(name)
    if name == "cpu" or (record is not None and record.group == "builtin"
                         and name not in BUILTIN_PLUGINS):
        raise PluginError(f"plugin {name!r} is built into torchbridge-core and cannot be "
                          "unregistered (without it no backend is left, not even cpu); "
                          "nothing was changed")
    if name in BUILTIN_PLUGINS:
        deprecated(name, f"unregister_plugin({name!r}) removes a plugin built into "
                   "torchbridge-core", "leave it registered (its kernels step aside for a "
                   "plugin's of higher priority, and config kernel.disabled_ops turns ops "
                   "off); this will raise PluginError", stacklevel=2)
    plugin = host.pm.get_plugin(name)
    if plugin is None:
        if record is not None and record.group == "runtime":  # a refused registration
            del host.records[name]
            host.generation += 1
            return
        # Unregistering what is not registered did nothing without a word (a disabled or
        # failed entry point lost its record): a warning now, an error from contract 4.
        names = sorted(n for n, p in host.pm.list_name_plugin() if p is not None)
        what = f"({record.status}: {record.error})" if record is not None else \
            f"(registered: {', '.join(names)}){did_you_mean(str(name), names)}"
        deprecated(name, f"unregister_plugin({name!r}) names no registered plugin {what}",
                   "unregister only a name register_plugin returned; this will raise "
                   "PluginError", stacklevel=2)
        if host.records.pop(name, None) is not None:
            host.generation += 1
        return
    host.pm.unregister(name=name)
    host.records.pop(name, None)
    host.generation += 1


def plugin_records() -> list[PluginRecord]:
    return list(get_plugin_host().records.values())
