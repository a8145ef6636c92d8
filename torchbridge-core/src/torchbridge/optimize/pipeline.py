"""Running the passes: collect, order, check, apply with rollback, report, measure."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from torch import nn

from torchbridge.errors import ConfigurationError, ModelOptimizationError, TorchBridgeError
from torchbridge.levels import LEVEL_TOLERANCE, OptimizationLevel
from torchbridge.optimize.forward import compile_state
from torchbridge.optimize.measure import (
    compare_latency,
    output_drift,
    preserved_state,
    sample_call,
)
from torchbridge.optimize.passes import OptimizationPass, PassContext, PassSkipped
from torchbridge.optimize.report import OptimizationResult, PassRecord, attach_result
from torchbridge.optimize.snapshot import ModelSnapshot
from torchbridge.plugins import get_plugin_host, is_fatal
from torchbridge.types import DeviceInfo

if TYPE_CHECKING:
    from torchbridge.backend import Backend

logger = logging.getLogger(__name__)


@dataclass
class CollectedPasses:
    """The passes one run considers, in run order, as (plugin, pass); and what was wrong
    with the contributions: malformed passes (left out) and vetoes naming no pass."""

    passes: list[tuple[str, OptimizationPass]]
    problems: list[str] = field(default_factory=list)


def _pass_problem(p: object) -> str | None:
    if not isinstance(p, OptimizationPass):
        return f"contributed {type(p).__name__} {p!r:.60}, expected OptimizationPass"
    if not isinstance(p.name, str) or not p.name:
        return f"a pass name must be a non-empty string, got {p.name!r}"
    if p.veto_reason is not None:
        return None if isinstance(p.veto_reason, str) else \
            f"veto of {p.name!r}: reason must be a string, got {p.veto_reason!r}"
    try:
        OptimizationLevel.parse(p.min_level)
    except ConfigurationError:
        return f"pass {p.name!r}: min_level {p.min_level!r} is not O0-O3"
    for what in ("apply", "check"):
        if not callable(getattr(p, what)):
            return f"pass {p.name!r}: {what} must be callable, got {getattr(p, what)!r}"
    if p.mode not in ("any", "inference", "training"):
        return f"pass {p.name!r}: mode must be any, inference or training, got {p.mode!r}"
    if not isinstance(p.order, (int, float)) or isinstance(p.order, bool):
        return f"pass {p.name!r}: order must be a number, got {p.order!r}"
    if not isinstance(p.mutates, bool):
        return f"pass {p.name!r}: mutates must be True or False, got {p.mutates!r}"
    return None


def _list_problem(result: object) -> str | None:
    if isinstance(result, (list, tuple)):
        return None
    return f"returned {type(result).__name__}, expected a list of OptimizationPass"


def collect_passes(backend: Backend, level: OptimizationLevel) -> CollectedPasses:
    """One pass per name, in run order. A plugin called earlier (tryfirst) replaces a
    same-named pass from one called later; a veto from any plugin wins over the pass
    whatever the order. Malformed contributions are their plugin's error, left out."""
    host = get_plugin_host()
    chosen: dict[str, tuple[str, OptimizationPass]] = {}
    vetoes: dict[str, tuple[str, OptimizationPass]] = {}
    problems: list[str] = []
    hook = "torchbridge_optimization_passes"
    for impl in host.implementations(hook):
        plugin = impl.plugin_name
        ok, passes = host.call_one(impl, hook, {"backend": backend, "level": level},
                                   _list_problem)
        if not ok:  # raised or returned something that is not a list: the run says so
            problems.append(f"plugin {plugin}: {passes}")
            continue
        for p in passes or ():
            problem = _pass_problem(p)
            if problem is not None:
                problems.append(f"plugin {plugin}: " + host.record_hook_error(
                    plugin, hook, problem))
                continue
            if p.veto_reason is None:
                p = replace(p, min_level=OptimizationLevel.parse(p.min_level))
            (vetoes if p.veto_reason is not None else chosen).setdefault(p.name, (plugin, p))
    for name, (plugin, veto) in vetoes.items():
        if name in chosen:
            chosen[name] = (plugin, replace(chosen[name][1], veto_reason=veto.veto_reason))
            continue
        message = f"vetoes pass {name!r}, but no plugin offers a pass of that name for " \
                  f"backend {backend.name!r} (known: {', '.join(sorted(chosen))})"
        record = host.records.get(plugin)
        if record is not None:
            record.warn(message)
        problems.append(f"plugin {plugin} {message}")
    ordered = sorted(chosen.values(), key=lambda item: (item[1].order, item[1].name))
    return CollectedPasses(ordered, problems)


def _skip_reason(p: OptimizationPass, plugin: str, model: nn.Module, ctx: PassContext
                 ) -> str | None:
    if p.veto_reason is not None:
        return f"vetoed by plugin {plugin}: {p.veto_reason}"
    if p.name in ctx.config.optimization.disabled_passes:
        return "disabled by config optimization.disabled_passes"
    if ctx.level < p.min_level:
        return f"level {ctx.level.value} is below this pass's {p.min_level.value}"
    if p.mode == "inference" and ctx.training:
        return "model is in training mode and this pass is for inference only"
    if p.mode == "training" and not ctx.training:
        return "model is in eval mode and this pass is for training only"
    reason = p.check(model, ctx)
    if reason is not None and not isinstance(reason, str):
        raise TypeError(f"check returned {type(reason).__name__}, expected a reason string "
                        "or None")
    return reason


def _copy(model: nn.Module, why: str) -> nn.Module:
    try:
        return copy.deepcopy(model)
    except Exception as exc:
        raise ModelOptimizationError(
            f"the model cannot be deep-copied ({type(exc).__name__}: {exc}), and {why}; "
            "pass inplace=True to prepare the model itself") from exc


def _run_sample(model: nn.Module, call: Callable[[nn.Module], Any]) -> Any:
    """The model's output on the sample input, in eval mode (no dropout, BatchNorm on its
    running statistics: comparable between runs), leaving no trace on the model or the
    global RNG."""
    with preserved_state(model):
        model.eval()
        return call(model)


def _verify(model: nn.Module, call: Callable[[nn.Module], Any], reference: Any,
            tolerance: float) -> tuple[Any, float, float]:
    """(output, max abs drift, max rel drift) of the model after a pass; raises
    _Unverified when its output is no drop-in for the reference."""
    out = _run_sample(model, call)
    state = compile_state(model)
    if state is not None and state.error is not None:
        raise _Unverified(f"the compiled model failed on the sample input: "
                          f"{type(state.error).__name__}: {state.error}")
    try:
        max_abs, max_rel = output_drift(reference, out)
    except ValueError as exc:
        raise _Unverified(str(exc)) from None
    if not max_rel <= tolerance:
        raise _Unverified(f"output drift {max_rel:.3g} (max abs {max_abs:.3g}) exceeds the "
                          f"level's tolerance {tolerance:g}")
    return out, max_abs, max_rel


class _Unverified(Exception):
    """A pass's result failed the check on the sample input."""


def _changed(p: OptimizationPass, before: nn.Module, after: nn.Module,
             forward: object) -> bool:
    return p.mutates or after is not before or after.__dict__.get("forward") is not forward


def _device_info(backend: Backend, result: OptimizationResult) -> DeviceInfo:
    """The device's description for the passes. When no plugin can describe the device,
    the run goes on knowing nothing about it: float32 only, no low-precision dtype, so
    passes that need more skip themselves; the report says why."""
    try:
        return backend.get_device_info()
    except TorchBridgeError as exc:
        result.notes.append(f"device description unavailable ({exc}); passes ran as for an "
                            "unknown device: float32 only")
        return DeviceInfo(name="unknown", backend=backend.name, memory_total_gb=None,
                          memory_available_gb=None, compute_capability=None,
                          supported_dtypes=["float32"], device=str(backend.device),
                          notes=str(exc))


def run_pipeline(backend: Backend, model: nn.Module, level: Any, *, sample_input: Any = None,
                 measure: bool = False, inplace: bool = False, strict: bool | None = None
                 ) -> OptimizationResult:
    if not isinstance(model, nn.Module):
        raise ModelOptimizationError(f"expected a torch.nn.Module, got {type(model).__name__}")
    level = OptimizationLevel.parse(backend.config.optimization_level if level is None
                                    else level)
    strict = backend.config.strict if strict is None else strict
    if measure and sample_input is None:
        raise ModelOptimizationError("measure=True needs sample_input to run the model")
    call = sample_call(backend, sample_input) if sample_input is not None else None
    tolerance = LEVEL_TOLERANCE[level.value]

    baseline = _copy(model, "measure=True times the unprepared model against the prepared "
                     "one").to(backend.device) if measure else None
    work = model if inplace else _copy(model, "prepare_model works on a copy")
    result = OptimizationResult(model=work, backend=backend.name, level=level)
    ctx = PassContext(backend=backend, level=level, config=backend.config,
                      device_info=_device_info(backend, result), training=model.training,
                      sample_input=sample_input)
    ctx.state["measure"] = measure
    collected = collect_passes(backend, level)
    result.notes.extend(collected.problems)
    if strict and collected.problems:
        raise ModelOptimizationError("; ".join(collected.problems))
    reference: Any = None
    last_out: Any = None
    have_reference = False
    for plugin, p in collected.passes:
        if call is not None and not have_reference and p.order > 0:
            # O0's output: the model as given, placed on the device.
            try:
                reference = last_out = _run_sample(work, call)
            except Exception as exc:
                raise ModelOptimizationError(
                    f"the model raised on the sample input before any pass ran: "
                    f"{type(exc).__name__}: {exc}") from exc
            have_reference = True
        started = time.perf_counter()
        snapshot: ModelSnapshot | None = None
        saved_state, saved_notes = _copy_state(ctx.state), len(ctx.notes)
        try:
            reason = _skip_reason(p, plugin, work, ctx)
            if reason is not None:
                result.passes.append(PassRecord(p.name, "skipped", reason, plugin))
                continue
            assert p.apply is not None
            snapshot = ModelSnapshot(work, tensors=p.mutates)
            forward = work.__dict__.get("forward")
            out = p.apply(work, ctx)
            if not isinstance(out, nn.Module):
                raise TypeError(f"apply returned {type(out).__name__}, expected the "
                                "nn.Module it was given or its replacement")
            if have_reference and _changed(p, work, out, forward):
                last_out, *_ = _verify(out, call, reference, tolerance)  # type: ignore[arg-type]
            work = out
        except BaseException as exc:
            if snapshot is not None:
                snapshot.restore()  # the model as it was, also the caller's own (inplace)
            ctx.state.clear()
            ctx.state.update(saved_state)
            del ctx.notes[saved_notes:]
            if is_fatal(exc):
                raise
            if isinstance(exc, PassSkipped):
                result.passes.append(PassRecord(p.name, "skipped", str(exc), plugin))
                continue
            error = str(exc) if isinstance(exc, _Unverified) else f"{type(exc).__name__}: {exc}"
            logger.warning("pass %s (plugin %s) failed and was rolled back: %s", p.name,
                           plugin, error)
            result.passes.append(PassRecord(p.name, "failed", error, plugin))
            if strict:
                if isinstance(exc, TorchBridgeError):
                    raise  # already names the problem (a plugin's own error class)
                raise ModelOptimizationError(f"pass {p.name!r} failed: {error}") from exc
            continue
        result.passes.append(PassRecord(p.name, "applied", p.description, plugin,
                                        time.perf_counter() - started))
    result.model = work
    result.notes.extend(ctx.notes)
    result.kernel_substitutions = ctx.state.get("kernel_substitutions", [])

    if call is not None:
        if not have_reference:  # no pass after placement: the model is O0's
            reference = last_out = _run_sample(work, call)
        result.max_abs_diff, result.max_rel_diff = output_drift(reference, last_out)
        if measure and baseline is not None:
            with preserved_state(baseline), preserved_state(work):
                result.baseline_seconds, result.optimized_seconds = compare_latency(
                    lambda: call(baseline), lambda: call(work), backend.synchronize)
            result.speedup = result.baseline_seconds / result.optimized_seconds
    attach_result(work, result)
    return result


def _copy_state(state: dict[str, Any]) -> dict[str, Any]:
    """ctx.state as it was before a pass: values one level deep (compile options)."""
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in state.items()}
