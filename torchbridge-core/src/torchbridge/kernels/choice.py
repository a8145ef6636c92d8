"""Which implementation of an op runs on a backend, and why each other one does not.

Candidates come from every plugin: `torchbridge_kernel_implementations(backend)` returns
declared implementations; `torchbridge_kernel(op, backend_name, backend)`, the first
contract, returns a plain callable, which becomes an inference-only, opaque implementation
for that backend. They are ordered by `priority` (highest first), then by plugin call order
(tryfirst plugins, vendor plugins, the built-in ones). An implementation is eligible when:
config does not force the reference, it serves this backend, the device meets its
capability or architecture, it trains when the model does, and it computes in the dtype
asked for, and no checked kernel refused it in this process (its output did not match
the reference; see implementations.BoundKernel). The first eligible one is chosen; with
none, the reference runs.
"""

from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

import torchbridge.kernels.ops as ops_module
from torchbridge.errors import KernelError, TorchBridgeError
from torchbridge.kernels.implementations import (
    BoundKernel,
    KernelImplementation,
    bind,
    implementation_problem,
    refusal,
)
from torchbridge.plugins import cached_for, exclusive_step, get_plugin_host

if TYPE_CHECKING:
    from torchbridge.backend import Backend
    from torchbridge.plugins import PluginHost
    from torchbridge.types import DeviceInfo


def _ops_problem(result: object) -> str | None:
    if not isinstance(result, (list, tuple)):
        return f"returned {type(result).__name__}, expected a list of OpDefinition"
    for item in result:
        if not isinstance(item, ops_module.OpDefinition):
            return f"contributed {type(item).__name__} {item!r:.60}, expected OpDefinition"
    return None


_ops_cache: tuple[PluginHost, int, tuple[str, ...]] | None = None
_ops_lock = threading.Lock()


def known_ops() -> tuple[str, ...]:
    """Every op: the core's and those plugins declare through `torchbridge_ops` (registered
    on first use; a declaration that cannot be registered is its plugin's error)."""
    global _ops_cache
    host = get_plugin_host()
    cached = cached_for(_ops_cache, host)
    if cached is not None:
        return tuple(cached)
    # Plugins are asked outside the lock: one whose hook calls back into torchbridge gets a
    # PluginError from the re-entry guard (recorded as its error), not a deadlock.
    with exclusive_step("declaring ops"):
        declared = list(host.call_each("torchbridge_ops", check=_ops_problem))
    with _ops_lock:
        cached = cached_for(_ops_cache, host)
        if cached is not None:
            return tuple(cached)
        names = [d.name for d in ops_module.BUILTIN_OPS]
        for plugin, definitions in declared:
            for definition in definitions:
                try:
                    ops_module.register_op(definition)
                except KernelError as exc:
                    host.record_hook_error(plugin, "torchbridge_ops", str(exc))
                    continue
                if definition.name not in names:
                    names.append(definition.name)
        _ops_cache = (host, host.generation, tuple(names))
        return tuple(names)


def _check_op(op: str) -> None:
    if op not in known_ops():
        raise KernelError(f"unknown op {op!r}; known ops: {', '.join(known_ops())}")


def _list_problem(result: object) -> str | None:
    if not isinstance(result, (list, tuple)):
        return f"returned {type(result).__name__}, expected a list of KernelImplementation"
    return None


def _legacy_problem(kernel: object) -> str | None:
    return None if callable(kernel) else f"returned {kernel!r}, which is not callable"


def _priority_problem(impl: KernelImplementation) -> str | None:
    """Why `impl.priority` cannot order implementations (None: it can): it must be a
    finite number (an int, as declared; a float is taken as it orders the same way). A
    string, None, a bool or NaN would make sorting fail for every user of the op, or
    order it arbitrarily (NaN compares false with everything)."""
    value = impl.priority
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not math.isfinite(value):
        return (f"implementation {impl.name!r} of {impl.op!r}: priority must be a finite "
                f"number (an int, higher is tried first), got "
                f"{type(value).__name__} {value!r:.40}; the implementation is left out")
    return None


def _contribution_problem(impl: object) -> str | None:
    """Why a contributed `impl` is malformed (None: it is well formed)."""
    problem = implementation_problem(impl)
    if problem is None and isinstance(impl, KernelImplementation):
        problem = _priority_problem(impl)
    return problem


def _rank(impl: Any) -> int:
    """0 for a tryfirst hook implementation, 2 for trylast (the built-in plugins), else 1."""
    return 0 if impl.tryfirst else 2 if impl.trylast else 1


def contributed(op: str, backend: Backend) -> list[tuple[str, KernelImplementation]]:
    """(plugin, implementation) for `op` from every plugin, in preference order: highest
    priority, then tryfirst plugins, other plugins, the built-in ones (trylast), across
    both hooks; malformed ones are their plugin's error and left out."""
    return [(plugin, impl) for plugin, _, impl in contributions(op, backend)]


def contributions(op: str, backend: Backend) -> list[tuple[str, str, KernelImplementation]]:
    """As `contributed`, with the hook each implementation came from (plugin, hook, impl):
    a refusal is that hook's error, not another one the plugin may not implement."""
    host = get_plugin_host()
    # (rank, seq, plugin, hook, impl)
    found: list[tuple[int, int, str, str, KernelImplementation]] = []
    hook = "torchbridge_kernel_implementations"
    for hook_impl in host.implementations(hook):
        ok, impls = host.call_one(hook_impl, hook, {"backend": backend}, _list_problem)
        for impl in (impls or ()) if ok else ():
            problem = _contribution_problem(impl)
            if problem is not None:
                host.record_hook_error(hook_impl.plugin_name, hook, problem)
            elif impl.op == op:
                found.append((_rank(hook_impl), len(found), hook_impl.plugin_name, hook, impl))
    legacy = "torchbridge_kernel"
    for hook_impl in host.implementations(legacy):
        ok, kernel = host.call_one(hook_impl, legacy, {"op": op, "backend_name": backend.name,
                                                       "backend": backend}, _legacy_problem)
        if not ok or kernel is None:
            continue
        plugin = hook_impl.plugin_name
        if isinstance(kernel, KernelImplementation):
            problem = _contribution_problem(kernel)
            if problem is not None:
                host.record_hook_error(plugin, legacy, problem)
            elif kernel.op == op:
                found.append((_rank(hook_impl), len(found), plugin, legacy, kernel))
            continue
        found.append((_rank(hook_impl), len(found), plugin, legacy,
                      _legacy(op, backend.name, kernel)))
    found.sort(key=lambda item: (-item[4].priority, item[0], item[1]))
    return [(plugin, hook_name, impl) for _, _, plugin, hook_name, impl in found]


_legacy_cache: dict[tuple[str, str, Any], KernelImplementation] = {}


def _legacy(op: str, backend_name: str, kernel: Any) -> KernelImplementation:
    """The first contract's plain callable as an implementation: inference only, opaque.
    One object per (op, backend, callable), so its wrapper op is made once."""
    key = (op, backend_name, kernel)
    impl = _legacy_cache.get(key)
    if impl is None:
        impl = _legacy_cache[key] = KernelImplementation(
            op=op, name=getattr(kernel, "__name__", type(kernel).__name__), forward=kernel,
            backends=(backend_name,), description="returned by torchbridge_kernel: inference "
            "only, opaque to torch.compile")
    return impl


def _capability(info: DeviceInfo | None) -> tuple[int, int] | None:
    text = info.compute_capability if info is not None else None
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except (TypeError, ValueError):
        return None


def ineligible_reason(impl: KernelImplementation, backend: Backend, info: DeviceInfo | None,
                      *, dtype: torch.dtype | None, training: bool) -> str | None:
    """Why `impl` cannot run `op` on this backend for this use (None: it can)."""
    if impl.unavailable:
        return impl.unavailable
    if impl.backends is not None and backend.name not in impl.backends:
        return f"serves {', '.join(impl.backends)}, not {backend.name}"
    if impl.min_capability is not None:
        have = _capability(info)
        need = ".".join(map(str, impl.min_capability))
        if have is None:
            return f"needs compute capability {need}; the device reports none"
        if have < impl.min_capability:
            return f"needs compute capability {need}; the device has {have[0]}.{have[1]}"
    if impl.architectures is not None:
        arch = info.architecture if info is not None else None
        if not arch or not any(arch.startswith(a) for a in impl.architectures):
            return f"built for {', '.join(impl.architectures)}; the device is {arch or 'unknown'}"
    if training and not impl.trains:
        return "inference only (no backward) and the model is training"
    if dtype is not None and impl.dtypes is not None and dtype not in impl.dtypes:
        return f"computes in {', '.join(str(d) for d in impl.dtypes)}, not {dtype}"
    return None


@dataclass
class Candidate:
    implementation: KernelImplementation
    provider: str
    reason: str | None  # why it is not eligible; None: eligible
    hook: str = "torchbridge_kernel_implementations"  # the plugin hook it came from

    def to_dict(self) -> dict[str, Any]:
        impl = self.implementation
        return {"name": impl.name, "plugin": self.provider, "eligible": self.reason is None,
                "reason": self.reason, "backends": list(impl.backends or ["any"]),
                "dtypes": [str(d) for d in impl.dtypes] if impl.dtypes else ["any"],
                "trains": impl.trains, "traceable": impl.traceable,
                "min_capability": impl.min_capability, "architectures": impl.architectures,
                "priority": impl.priority}


@dataclass
class KernelChoice:
    """The candidates for `op` on `backend` in preference order, each eligible or with the
    reason it is not; `forced_reference` when config rules every implementation out."""

    op: str
    backend: str
    candidates: list[Candidate] = field(default_factory=list)
    forced_reference: str | None = None

    @property
    def eligible(self) -> list[Candidate]:
        return [c for c in self.candidates if c.reason is None]

    @property
    def chosen(self) -> Candidate | None:
        eligible = self.eligible
        return eligible[0] if eligible else None

    def reasons(self) -> list[str]:
        return [f"{c.implementation.name} (plugin {c.provider}): {c.reason}"
                for c in self.candidates if c.reason is not None]

    def bound(self, candidate: Candidate | None = None) -> BoundKernel:
        """The callable for `candidate` (default: the chosen one; None chosen: reference)."""
        pick = candidate if candidate is not None else self.chosen
        if pick is None:
            return bind(None, None, self.op, self.reasons(), backend=self.backend)
        return bind(pick.implementation, pick.provider, self.op, self.reasons(),
                    backend=self.backend, hook=pick.hook)

    def to_dict(self) -> dict[str, Any]:
        chosen = self.chosen
        return {"op": self.op, "backend": self.backend,
                "selected": (f"{chosen.implementation.name} (plugin {chosen.provider})"
                             if chosen else "reference"),
                "forced_reference": self.forced_reference,
                "implementations": [c.to_dict() for c in self.candidates]}


def device_info_or_none(backend: Backend) -> DeviceInfo | None:
    try:
        return backend.get_device_info()
    except TorchBridgeError:
        return None


def choose(op: str, backend: Backend, *, dtype: torch.dtype | None = None,
           training: bool = False, info: DeviceInfo | None = None) -> KernelChoice:
    """Every implementation of `op` for `backend`, in preference order, with its verdict."""
    _check_op(op)
    choice = KernelChoice(op, backend.name)
    kernel_config = backend.config.kernel
    if not kernel_config.enabled:
        choice.forced_reference = "config kernel.enabled is False"
    elif op in kernel_config.disabled_ops:
        choice.forced_reference = "listed in config kernel.disabled_ops"
    info = info if info is not None else device_info_or_none(backend)
    for provider, hook, impl in contributions(op, backend):
        # An implementation a checked kernel refused (its output did not match the
        # reference) stays refused for this op and backend in this process: the next best
        # serves, and the table says why it is passed over.
        reason = choice.forced_reference or refusal(op, backend.name, provider, impl) or \
            ineligible_reason(impl, backend, info, dtype=dtype, training=training)
        choice.candidates.append(Candidate(impl, provider, reason, hook))
    return choice


def kernel_table(backend: Backend, *, training: bool = False) -> list[dict[str, Any]]:
    """Every op with its implementations on `backend`, their plugins, and why each is or
    is not selected (for doctor and `torchbridge kernels`)."""
    info = device_info_or_none(backend)
    return [choose(op, backend, training=training, info=info).to_dict() for op in known_ops()]
