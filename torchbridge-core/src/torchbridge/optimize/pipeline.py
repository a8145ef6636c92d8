"""prepare_model: collect the passes (one per name, vetoes, malformed contributions), refuse
what cannot run (float64 without fp64), then run them (optimize/run.py) and measure."""

from __future__ import annotations

import copy
import difflib
import logging
import time
import typing
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from torchbridge.config import QuantizeMode
from torchbridge.errors import (
    ConfigurationError,
    ModelOptimizationError,
    TorchBridgeError,
    UnsupportedDtypeError,
)
from torchbridge.levels import LEVEL_TOLERANCE, OptimizationLevel
from torchbridge.optimize import fastest
from torchbridge.optimize.fastest import keep_fastest
from torchbridge.optimize.first_call import install_first_call_timing
from torchbridge.optimize.measure import Timer, sample_call
from torchbridge.optimize.passes import OptimizationPass, PassContext
from torchbridge.optimize.report import OptimizationResult, attach_result
from torchbridge.optimize.run import Run
from torchbridge.optimize.settings import ProcessSetting
from torchbridge.plugins import get_plugin_host
from torchbridge.progress import progress
from torchbridge.suggestions import did_you_mean, shortened
from torchbridge.types import DeviceInfo

if TYPE_CHECKING:
    from torchbridge.backend import Backend

logger = logging.getLogger(__name__)
QUANTIZE_MODES: tuple[str, ...] = typing.get_args(QuantizeMode)


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
    if not isinstance(p.settings, (tuple, list)) or not all(
            isinstance(s, ProcessSetting) for s in p.settings):
        return f"pass {p.name!r}: settings must be a tuple of ProcessSetting, got " \
               f"{p.settings!r:.80}"
    if p.effect is not None and not callable(p.effect):
        return f"pass {p.name!r}: effect must be callable or None, got {p.effect!r}"
    if p.output_check is not None and not callable(p.output_check):
        return f"pass {p.name!r}: output_check must be callable or None, got " \
               f"{p.output_check!r}"
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


def _disabled_unknown(backend: Backend, collected: CollectedPasses) -> list[str]:
    """Notes for names in config optimization.disabled_passes that no pass of this run has:
    a misspelt name disabled nothing, and the pass it meant ran. (A pass of a plugin not
    installed here is no mistake: a note, not an error.)"""
    names = sorted({p.name for _, p in collected.passes})
    notes = []
    for name in dict.fromkeys(backend.config.optimization.disabled_passes):
        if name in names:
            continue
        notes.append(f"config optimization.disabled_passes names {name!r}, which no pass of "
                     f"this run has, so it disabled nothing{did_you_mean(name, names)}")
    for note in notes:  # info: a pass of another backend's plugin is no mistake
        logger.info("%s", note)
    return notes


def copy_model(model: nn.Module, why: str) -> nn.Module:
    try:
        return copy.deepcopy(model)
    except Exception as exc:
        raise ModelOptimizationError(
            f"the model cannot be deep-copied ({type(exc).__name__}: {exc}), and {why}; "
            "pass inplace=True to prepare the model itself") from exc


def _device_info(backend: Backend, notes: list[str]) -> DeviceInfo:
    """The device's description for the passes. When no plugin can describe the device,
    the run goes on knowing nothing about it: float32 only, no low-precision dtype, so
    passes that need more skip themselves; the report says why."""
    try:
        return backend.get_device_info()
    except TorchBridgeError as exc:
        notes.append(f"device description unavailable ({exc}); passes ran as for an "
                     "unknown device: float32 only")
        return DeviceInfo(name="unknown", backend=backend.name, memory_total_gb=None,
                          memory_available_gb=None, compute_capability=None,
                          supported_dtypes=["float32"], device=str(backend.device),
                          notes=str(exc))


def refuse_float64(model: nn.Module, sample_input: Any, info: DeviceInfo) -> None:
    """A device whose description says it has no float64 (`extra["fp64"] is False`) cannot
    run a float64 model at all: refused before anything is placed, in every mode."""
    if info.extra.get("fp64") is not False:
        return
    found = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
             if t.dtype == torch.float64]
    found += [f"sample_input[{i}]" for i, leaf in enumerate(pytree.tree_leaves(sample_input))
              if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.float64]
    if found:
        raise UnsupportedDtypeError(
            f"float64 tensors ({shortened(found, 5)}): {info.name} has no float64 support "
            "(its device description says fp64 is False), so the model cannot run there. "
            "Convert the model and its inputs with .float() (or .to(torch.float32)) first")


def quantize_mode(backend: Backend, quantize: Any) -> str | None:
    """The quantization mode of a run: `quantize` as given (False: none, whatever the
    config says), else config optimization.quantize. An unknown mode is refused, naming
    the modes there are."""
    if quantize is None:
        quantize = backend.config.optimization.quantize
    if quantize is None or quantize is False:
        return None
    if quantize not in QUANTIZE_MODES:
        close = difflib.get_close_matches(str(quantize), QUANTIZE_MODES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigurationError(f"quantize={quantize!r} is not a quantization mode "
                                 f"(modes: {', '.join(QUANTIZE_MODES)}){hint}")
    return str(quantize)


def _on_device(model: nn.Module, device: torch.device) -> bool:
    return all(t.device.type == device.type and (device.index is None or t.device == device)
               for t in [*model.parameters(), *model.buffers()])


def run_pipeline(backend: Backend, model: nn.Module, level: Any, *, sample_input: Any = None,
                 measure: bool = False, inplace: bool = False, strict: bool | None = None,
                 quantize: Any = None, timer: Timer | None = None, first_call: bool = True
                 ) -> OptimizationResult:
    """The report of one prepare_model run (Backend.optimize documents the arguments).
    `timer` times one call for the keep-the-faster decision (tests inject one; default:
    wall time). `first_call=False`: the first call is never timed (distributed=: the
    wrapper put around the model afterwards is a change the first call would refuse)."""
    if not isinstance(model, nn.Module):
        raise ModelOptimizationError(f"expected a torch.nn.Module, got {type(model).__name__}")
    level = OptimizationLevel.parse(backend.config.optimization_level if level is None
                                    else level)
    strict = backend.config.strict if strict is None else strict
    mode = quantize_mode(backend, quantize)
    if measure and sample_input is None:
        raise ModelOptimizationError("measure=True needs sample_input to run the model")
    notes: list[str] = []
    info = _device_info(backend, notes)
    refuse_float64(model, sample_input, info)
    call = sample_call(backend, sample_input) if sample_input is not None else None

    # With a sample input, O2 and O3 time the prepared model against O0 and keep the
    # faster (optimize/fastest.py); measure=True times at every level. In training mode
    # only measure=True times (a forward is not a training step: no decision from it).
    timing = call is not None and (measure or (level >= OptimizationLevel.O2
                                               and not model.training))
    baseline = None
    if timing:
        # O0 to time against: the caller's own model when it is untouched by the run and
        # already on the device (no copy), else a copy placed there.
        baseline = model if not inplace and _on_device(model, backend.device) else copy_model(
            model, "prepare_model times the model as given against the prepared one"
        ).to(backend.device)
    work = model if inplace else copy_model(model, "prepare_model works on a copy")
    result = OptimizationResult(model=work, backend=backend.name, level=level, notes=notes,
                                quantize_mode=mode)
    ctx = PassContext(backend=backend, level=level, config=backend.config, device_info=info,
                      training=model.training, sample_input=sample_input, quantize=mode)
    ctx.state["measure"] = measure
    collected = collect_passes(backend, level)
    result.notes.extend(collected.problems)
    result.notes.extend(_disabled_unknown(backend, collected))
    if strict and collected.problems:
        raise ModelOptimizationError("; ".join(collected.problems))
    run = Run(work, ctx, result, call, LEVEL_TOLERANCE[level.value], strict)
    try:
        with progress(len(collected.passes), f"prepare_model {level.value}") as bar:
            for plugin, p in collected.passes:
                bar.step(p.name)
                run.run(plugin, p)
        result.notes.extend(ctx.notes)
        run.check_effects()
        run.settle_settings()
        started = time.perf_counter()
        run.final_check()
        if call is not None:  # without a sample input there is nothing to check on
            result.stage_seconds["final_check"] = time.perf_counter() - started
        work = result.model = run.work
        if baseline is not None:
            started = time.perf_counter()
            keep_fastest(run, baseline, timer or fastest.default_timer(backend.synchronize),
                         decide=not model.training)
            result.stage_seconds["timing"] = time.perf_counter() - started
            work = result.model = run.work
        elif call is None and level >= OptimizationLevel.O2 and not model.training and \
                first_call and backend.config.optimization.time_first_call:
            # No sample input: the first call's input is the sample (optimize/first_call.py).
            # O0 is the caller's model when that costs no copy.
            install_first_call_timing(
                run, model if not inplace and _on_device(model, backend.device) else None,
                timer or fastest.default_timer(backend.synchronize))
        result.kernel_substitutions = ctx.state.get("kernel_substitutions", [])
        result.settle_kernel_lines()
        result.quantization = ctx.state.get("quantization")
    except BaseException as exc:
        # Whatever failed after passes ran: the model as it was (the caller's own object
        # when inplace), the process-wide settings as they were, and a TorchBridge error.
        leftover = run.undo_all()
        if leftover is not None:
            raise ModelOptimizationError(
                f"prepare_model failed ({type(exc).__name__}: {exc}) and could not put the "
                f"model back as it was: {leftover}") from exc
        stayed = run.stayed_settings()
        if stayed is not None:
            logger.warning("prepare_model failed; process-wide settings that stay: %s",
                           stayed)
        if isinstance(exc, TorchBridgeError) or not isinstance(exc, Exception):
            raise  # names the problem already; or Ctrl-C, which is the user's
        settings = "the process-wide settings were put back as they were" if stayed is None \
            else f"the process-wide settings too, except: {stayed}"
        raise ModelOptimizationError(
            f"prepare_model failed after passes ran ({type(exc).__name__}: {exc}); the model "
            f"was put back as it was, and {settings}") from exc
    attach_result(work, result)
    return result
