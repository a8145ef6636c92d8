"""The Backend facade: one class for every backend; plugins answer through hooks.

Device-level hooks (description, memory, synchronize, ...) are answered by the backend's own
plugin. Before it, another plugin's `tryfirst=True` implementation may override it; after
it, only the core fallbacks the backend opted into (`Detection.fallbacks`) are asked, and
`backend.answered_by` and the answer's notes say when one did.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import pluggy
import torch
from torch.utils import _pytree as pytree

from torchbridge.config import TorchBridgeConfig, default_section, hardware_sections
from torchbridge.errors import BackendUnavailableError, ConfigurationError, DeviceError
from torchbridge.kernels import compute, resolve_kernel
from torchbridge.memory import MemoryManager, apply_memory_fraction
from torchbridge.plugins import describe, exclusive_step, get_plugin_host
from torchbridge.selection import (
    backend_status,
    best_available,
    list_backends,
    parse_backend_spec,
    register_health_check,
)
from torchbridge.types import BackendStatus, DeviceInfo, MemoryStats

if TYPE_CHECKING:
    from torch import nn

    from torchbridge.optimize.report import OptimizationResult

logger = logging.getLogger(__name__)

# Device-level hooks and the type of a valid answer.
DEVICE_HOOKS: dict[str, type] = {
    "torchbridge_device_info": DeviceInfo,
    "torchbridge_memory_stats": MemoryStats,
    "torchbridge_empty_cache": bool,
    "torchbridge_reset_peak_memory_stats": bool,
    "torchbridge_synchronize": bool,
    "torchbridge_distributed_backend": str,
}


def _answer_problem(hook: str) -> Callable[[Any], str | None]:
    expected = DEVICE_HOOKS[hook]

    def problem(result: Any) -> str | None:
        if not isinstance(result, expected):
            return f"returned {type(result).__name__}, expected {expected.__name__} or None"
        if isinstance(result, MemoryStats):
            return impossible_memory_stats(result)
        if isinstance(result, DeviceInfo):
            return impossible_device_info(result)
        return None
    return problem


# An answer no device can give is the plugin's error, not a figure to pass on: free memory
# over the total made doctor print "free 64.00 GiB, total 16.00 GiB" with health ok, a free
# figure in MiB made OOM protection refuse 1 MiB as if memory were short, and a dtype name
# torch has not ("bf16") failed in another plugin's pass. (The contract suite checks more:
# these are the checks that cannot be wrong for any real device, and it runs them too.)
def impossible_memory_stats(stats: MemoryStats) -> str | None:
    for name in ("allocated", "reserved", "peak_allocated", "free", "total"):
        value = getattr(stats, f"{name}_bytes")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            return f"memory stats {name}_bytes = {value!r}: bytes are an int >= 0, or None"
    free, total = stats.free_bytes, stats.total_bytes
    if free is not None and total is not None and free > total:
        return f"memory stats free_bytes {free} > total_bytes {total} (both in bytes)"
    return None


def impossible_device_info(info: DeviceInfo) -> str | None:
    unknown = [d for d in info.supported_dtypes
               if not isinstance(getattr(torch, str(d), None), torch.dtype)]
    if unknown:
        return f"device info supported_dtypes {unknown} are not torch dtype names"
    preferred = info.preferred_low_precision_dtype
    if preferred is not None and preferred not in info.supported_dtypes:
        return (f"device info preferred_low_precision_dtype {preferred!r} is not among its "
                f"supported_dtypes {info.supported_dtypes}")
    total, available = info.memory_total_gb, info.memory_available_gb
    if any(gb is not None and gb < 0 for gb in (total, available)):
        return f"device info memory {available!r} of {total!r} GiB: negative"
    if total is not None and available is not None and available > total:
        return f"device info memory_available_gb {available} > memory_total_gb {total}"
    return None


class Backend:
    """A usable backend: its devices, their memory, synchronization, autocast, and
    prepare_model. Get one from `torchbridge.get_backend()`."""

    def __init__(self, status: BackendStatus, config: TorchBridgeConfig, index: int = 0) -> None:
        if not status.available:
            raise BackendUnavailableError(f"backend {status.name!r} is unavailable: "
                                          f"{status.reason}", backend=status.name)
        self.status = status
        self.config = config
        self.answered_by: dict[str, str] = {}  # hook -> plugin that answered it last
        # Sections the config has none for (it predates their plugin): their defaults.
        self._default_sections: dict[str, Any] = {}
        self._index = self._check_index(0 if index is None else index)
        # Process-wide state changes only where the config asks for one.
        if config.logging_level is not None:
            logging.getLogger("torchbridge").setLevel(config.logging_level)
        apply_memory_fraction(self)
        with exclusive_step("creating a backend"):
            for _ in get_plugin_host().call_each("torchbridge_backend_created", backend=self):
                pass
        # The ops plugins declare exist as torch.ops.torchbridge.<op> once a backend does
        # (not only after the first get_kernel).
        from torchbridge.kernels import register_plugin_ops

        register_plugin_ops()
        logger.info("backend %s selected (%d device(s), plugin %s)", status.name,
                    status.device_count, status.plugin)

    # -- identity -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.status.name

    @property
    def vendor(self) -> str | None:
        return self.status.vendor

    @property
    def plugin(self) -> str | None:
        """The plugin that reported this backend, which answers its hooks."""
        return self.status.plugin

    @property
    def is_available(self) -> bool:
        return self.status.available

    @property
    def device_count(self) -> int:
        return self.status.device_count

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """The core's answers this backend opted into: "generic", "cpu". A plugin written
        before fallbacks existed (Detection.fallbacks None) gets the one for its device
        type, as it did then."""
        if self.status.fallbacks is not None:
            return self.status.fallbacks
        return ("cpu",) if self.status.device_type == "cpu" else ("generic",)

    @property
    def hardware_config(self) -> Any:
        """This backend's config section: the one its plugin contributes (e.g.
        `config.hardware.nvidia` for cuda), or None when its plugin has none. A config
        built before the plugin was registered has no such section (and sets none of its
        values: it could not): this is then the section with its defaults, one object per
        backend (an assignment to it is checked, and recorded nowhere)."""
        sections = hardware_sections()
        section = next((name for name, plugin in sections.owners.items()
                        if plugin == self.plugin), None)
        if section is None:
            return None
        value = getattr(self.config.hardware, section, None)
        if value is not None:
            return value
        model = sections.model.model_fields[section].annotation
        cached = self._default_sections.get(section)
        if not (isinstance(model, type) and isinstance(cached, model)):
            cached = self._default_sections[section] = default_section(section)
        return cached

    def memory_manager(self, **pool_limits: Any) -> MemoryManager:
        """A `torchbridge.memory.MemoryManager` for this backend's device."""
        return MemoryManager(self, **pool_limits)

    def _check_index(self, index: int | None) -> int:
        index = self._index if index is None else index
        if not isinstance(index, int) or isinstance(index, bool) \
                or not 0 <= index < self.device_count:
            raise DeviceError(f"{self.name} has {self.device_count} device(s); "
                              f"index {index!r} does not exist")
        return index

    def device_at(self, index: int | None = None) -> torch.device:
        index = self._check_index(index)
        if self.status.device_type == "cpu":
            return torch.device("cpu")  # so that tensor.device == backend.device holds
        return torch.device(self.status.device_type, index)

    def hook_device(self, index: int | None = None) -> torch.device:
        """The device device-level hooks receive: always with its index, also on cpu."""
        return torch.device(self.status.device_type, self._check_index(index))

    @property
    def device(self) -> torch.device:
        """The torch device tensors and models go to."""
        return self.device_at(None)

    @property
    def devices(self) -> list[torch.device]:
        return [self.device_at(i) for i in range(self.device_count)]

    def __repr__(self) -> str:
        return f"Backend(name={self.name!r}, device={str(self.device)!r}, " \
               f"device_count={self.device_count})"

    # -- device-level hooks ---------------------------------------------------------------
    def _answerers(self, hook: str) -> list[tuple[pluggy.HookImpl, str]]:
        """(implementation, role) in the order they are asked: overrides (another plugin's
        tryfirst), the owner, then the opted-in fallbacks."""
        impls = get_plugin_host().implementations(hook)
        owner, fallbacks = self.plugin, self.fallbacks
        overrides = [(i, "override") for i in impls if i.tryfirst and i.plugin_name != owner
                     and i.plugin_name not in ("cpu", "generic")]
        own = [(i, "own") for i in impls if i.plugin_name == owner]
        fallback = [(i, "fallback") for name in fallbacks for i in impls
                    if i.plugin_name == name != owner]
        return overrides + own + fallback

    def call_device_hook(self, hook: str, index: int | None) -> tuple[Any, str | None]:
        """(answer, who) for a device-level hook; (None, None) when nobody answered. A
        plugin that raises or answers with the wrong type is recorded and skipped."""
        host = get_plugin_host()
        kwargs = {"backend_name": self.name, "device": self.hook_device(index), "backend": self}
        check = _answer_problem(hook)
        for impl, role in self._answerers(hook):
            ok, result = host.call_one(impl, hook, kwargs, check)
            if ok and result is not None and result is not False:
                who = impl.plugin_name if role == "own" else f"{impl.plugin_name} ({role})"
                self.answered_by[hook] = who
                return result, who
        self.answered_by.pop(hook, None)
        return None, None

    def _unanswered(self, hook: str, index: int | None) -> str:
        """Why nobody answered `hook`: with every error a plugin asked for it recorded."""
        host = get_plugin_host()
        errors = [f"plugin {impl.plugin_name} {error}" for impl, _ in self._answerers(hook)
                  for record in [host.records.get(impl.plugin_name)] if record is not None
                  for error in record.errors if error.startswith(f"in {hook}:")]
        fallbacks = ", ".join(self.fallbacks) or "none"
        return (f"no plugin answered {hook} for {self.hook_device(index)} of backend "
                f"{self.name!r} (plugin {self.plugin}, fallbacks: {fallbacks})"
                + "".join(f"; {e}" for e in errors))

    def _fallback_note(self, who: str) -> str | None:
        if "(fallback)" not in who:
            return None
        return f"answered by the core's {who.split()[0]} fallback, not by plugin {self.plugin}"

    # -- description and memory -----------------------------------------------------------
    def get_device_info(self, index: int | None = None) -> DeviceInfo:
        """This backend's device (get_backend("cuda:1"): device 1), or device `index`."""
        info, who = self.call_device_hook("torchbridge_device_info", index)
        if info is None:
            raise DeviceError(self._unanswered("torchbridge_device_info", index))
        changes: dict[str, Any] = {}
        if info.vendor is None and self.vendor is not None:
            changes["vendor"] = self.vendor
        note = self._fallback_note(who or "")
        if note:
            changes["notes"] = f"{info.notes}; {note}" if info.notes else note
        return dataclasses.replace(info, **changes) if changes else info  # type: ignore[no-any-return]

    def get_memory_stats(self, index: int | None = None) -> MemoryStats:
        """Memory in bytes (None where unknowable); `stats["allocated"]` gives MB."""
        stats, who = self.call_device_hook("torchbridge_memory_stats", index)
        if stats is None:
            return MemoryStats(device=str(self.device_at(index)),
                               notes=self._unanswered("torchbridge_memory_stats", index))
        note = self._fallback_note(who or "")
        if note:
            stats = dataclasses.replace(stats, notes=f"{stats.notes}; {note}"
                                        if stats.notes else note)
        return stats  # type: ignore[no-any-return]

    def _device_call(self, hook: str, index: int | None) -> None:
        done, _ = self.call_device_hook(hook, index)
        if done is None:
            raise DeviceError(self._unanswered(hook, index))

    def empty_cache(self) -> None:
        self._device_call("torchbridge_empty_cache", None)

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        self._device_call("torchbridge_reset_peak_memory_stats", index)

    def synchronize(self, index: int | None = None) -> None:
        self._device_call("torchbridge_synchronize", index)

    @property
    def distributed_backend(self) -> str | None:
        """The torch.distributed backend name for this device ("nccl", "gloo", ...)."""
        name, _ = self.call_device_hook("torchbridge_distributed_backend", None)
        return name  # type: ignore[no-any-return]

    # -- execution helpers ----------------------------------------------------------------
    def low_precision_dtype(self, info: DeviceInfo | None = None) -> torch.dtype | None:
        """The dtype O2+ computes in: config.precision, else the device's preferred one
        (from `info` when the caller already has this device's DeviceInfo)."""
        if self.config.precision != "auto":
            dtype: torch.dtype = getattr(torch, self.config.precision)
            return None if dtype == torch.float32 else dtype
        return (info or self.get_device_info()).low_precision_dtype

    def autocast(self, dtype: torch.dtype | None = None, enabled: bool = True
                 ) -> contextlib.AbstractContextManager[Any]:
        """torch.autocast for this device in its low-precision dtype. Disabled (a no-op) when
        the device has no native low-precision dtype and none is given."""
        dtype = dtype or self.low_precision_dtype()
        if dtype is None:
            logger.info("autocast disabled: %s has no native low-precision dtype", self.name)
            return torch.autocast(device_type=self.device.type, enabled=False)
        return torch.autocast(device_type=self.device.type, dtype=dtype, enabled=enabled)

    def get_kernel(self, op: str) -> Callable[..., Any]:
        return resolve_kernel(op, self)

    def to_device(self, obj: Any) -> Any:
        """Move a tensor, a NumPy array, a module, or a (nested) list/tuple/dict of them to
        this device."""
        def move(leaf: Any) -> Any:
            if isinstance(leaf, (torch.Tensor, torch.nn.Module)):
                return leaf.to(self.device)
            if type(leaf).__module__ == "numpy" and hasattr(leaf, "__array__"):
                return torch.as_tensor(leaf).to(self.device)
            return leaf

        return pytree.tree_map(move, obj)

    # -- the PyDotCompute kernel API (torchbridge.kernels.compute) ------------------------
    def check_available(self) -> bool:
        return self.is_available

    def allocate(self, shape: Any, dtype: Any = torch.float32) -> torch.Tensor:
        return compute.allocate(self, shape, dtype)

    def to_host(self, tensor: torch.Tensor) -> Any:
        """A NumPy copy of `tensor`."""
        return compute.to_host(tensor)

    def get_memory_info(self) -> tuple[int, int] | None:
        """(free bytes, total bytes), None where unknowable."""
        return compute.memory_info(self)

    def compile_kernel(self, func: Any, signature: dict[str, str] | None = None,
                       **options: Any) -> compute.CompiledKernel:
        return compute.compile_kernel(self, func, signature, **options)

    def launch_kernel(self, kernel: Any, grid: Any, block: Any, *args: Any) -> None:
        compute.launch_kernel(self, kernel, grid, block, *args)

    def enable_caching(self, enabled: bool = True) -> Any:
        return compute.enable_caching(self, enabled)

    # -- models ---------------------------------------------------------------------------
    def optimize(self, model: nn.Module, level: Any = None, sample_input: Any = None,
                 measure: bool = False, *, inplace: bool = False, strict: bool | None = None,
                 quantize: str | Literal[False] | None = None) -> OptimizationResult:
        """Run the pass pipeline at `level` (default: config.optimization_level) and return
        the full report: passes applied, skipped (why) and failed (error); output drift
        against O0 when `sample_input` is given; measured speedup when `measure=True`,
        which times at every level and, in eval mode, keeps the faster of O0 and the
        prepared model, as O2 and O3 always do with a sample input.
        `quantize`: "int8", "int8_weight_only", "int4_weight_only" or "float8" (default:
        config optimization.quantize; False: none)."""
        # Imported here: the pipeline's modules cost about 15 ms at import, which
        # get_backend() does not pay (benchmarks/startup.py holds it to its bound).
        from torchbridge.optimize.pipeline import run_pipeline

        return run_pipeline(self, model, level, sample_input=sample_input, measure=measure,
                            inplace=inplace, strict=strict, quantize=quantize)

    def prepare_model(self, model: nn.Module, level: Any = None, *, sample_input: Any = None,
                      inplace: bool = False, strict: bool | None = None,
                      distributed: str | None = None, quantize: str | Literal[False] | None = None
                      ) -> nn.Module:
        """The prepared model. Its report: `torchbridge.optimization_result(prepared)`.

        `distributed="ddp"` or `"fsdp"` (after `torchbridge.distributed.initialize()`) wraps
        the prepared model in DistributedDataParallel or FSDP2, outside the level's passes
        (torchbridge.distributed.strategies says why in that order); an unsupported strategy
        is a DistributedError with the reason.

        `quantize="int8"` (or "int8_weight_only", "int4_weight_only", "float8"; default:
        config optimization.quantize) quantizes the Linear layers through torchao where the
        device supports the mode; on the sample input its outputs must keep the accuracy
        gate (config optimization.quantize_min_cosine and quantize_min_argmax_agreement),
        else the quantization is rolled back and the report gives the figures."""
        if distributed is not None:
            from torchbridge.distributed.strategies import prepare_distributed

            return prepare_distributed(self, model, level, distributed,
                                       sample_input=sample_input, inplace=inplace,
                                       strict=strict, quantize=quantize)
        return self.optimize(model, level, sample_input=sample_input, inplace=inplace,
                             strict=strict, quantize=quantize).model

    def prepare_model_with_custom_kernels(self, model: nn.Module, *, sample_input: Any = None,
                                          inplace: bool = False, strict: bool | None = None
                                          ) -> nn.Module:
        """The seeds' name: prepare_model at O3 with kernel substitution forced on, whatever
        config.kernel and optimization.disabled_passes say."""
        kernel = self.config.kernel.model_copy(update={"enabled": True, "substitute": True})
        optimization = self.config.optimization.model_copy(update={"disabled_passes": [
            p for p in self.config.optimization.disabled_passes
            if p != "kernel_substitution"]})
        config = self.config.model_copy(update={"kernel": kernel,
                                                "optimization": optimization})
        forced = Backend(self.status, config, index=self._index)
        return forced.prepare_model(model, "O3", sample_input=sample_input, inplace=inplace,
                                    strict=strict)


def device_hooks_problem(status: BackendStatus) -> str | None:
    """None when backend `status` answers device_info and memory_stats of device 0 through
    the facade, as its users will ask them; else what went wrong. The facade is built
    without announcing it (no torchbridge_backend_created, no process-wide settings): it is
    a question, not a selection."""
    try:
        config = TorchBridgeConfig.load()
    except ConfigurationError:
        config = TorchBridgeConfig()
    probe = object.__new__(Backend)
    probe.status, probe.config, probe.answered_by, probe._index = status, config, {}, 0
    try:
        probe.get_device_info(0)
    except Exception as exc:
        return f"its device hooks failed: {describe(exc)}"
    stats, _ = probe.call_device_hook("torchbridge_memory_stats", 0)
    if stats is None:
        return f"its device hooks failed: {probe._unanswered('torchbridge_memory_stats', 0)}"
    return None


register_health_check(device_hooks_problem)


def get_backend(name: str | None = None, config: TorchBridgeConfig | None = None) -> Backend:
    """The named backend, else config.backend (file, env TORCHBRIDGE_BACKEND, kwargs), else
    the best available one. Raises BackendUnavailableError saying why and what to install."""
    if config is not None and not isinstance(config, TorchBridgeConfig):
        raise TypeError(f"config must be a TorchBridgeConfig, got {type(config).__name__}")
    config = config if config is not None else TorchBridgeConfig.load()
    statuses = list_backends()
    chosen = name if name is not None else config.backend or best_available(statuses).name
    index = 0
    if isinstance(chosen, str):  # "cuda:1"; "" and "cuda:x" are DeviceErrors
        chosen, index = parse_backend_spec(chosen)
    return Backend(backend_status(chosen, statuses), config, index=index)


def get_kernel(op: str, backend: Backend | str | None = None) -> Callable[..., Any]:
    """The implementation of `op` for `backend` (default: the selected backend)."""
    resolved = backend if isinstance(backend, Backend) else get_backend(backend)
    return resolve_kernel(op, resolved)
