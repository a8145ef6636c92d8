"""Running the passes: collect, order, check, apply with rollback, report, measure."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchbridge.errors import ModelOptimizationError
from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.measure import call_args, compare_latency, output_drift
from torchbridge.optimize.passes import OptimizationPass, PassContext
from torchbridge.optimize.report import OptimizationResult, PassRecord, attach_result
from torchbridge.plugins import get_plugin_host

if TYPE_CHECKING:
    from torchbridge.backend import Backend

logger = logging.getLogger(__name__)


def collect_passes(backend: Backend, level: OptimizationLevel
                   ) -> list[tuple[str, OptimizationPass]]:
    """(plugin, pass) pairs, one per pass name, in run order. A plugin called earlier
    (tryfirst) replaces a same-named pass from one called later; a veto from any plugin
    wins over the pass whatever the order."""
    host = get_plugin_host()
    chosen: dict[str, tuple[str, OptimizationPass]] = {}
    vetoes: dict[str, tuple[str, OptimizationPass]] = {}
    for plugin, passes in host.call_isolated("torchbridge_optimization_passes",
                                             backend=backend, level=level):
        for p in passes:
            if not isinstance(p, OptimizationPass):
                host.record_hook_error(plugin, "torchbridge_optimization_passes", TypeError(
                    f"returned {type(p).__name__}, expected OptimizationPass"))
                continue
            (vetoes if p.veto_reason is not None else chosen).setdefault(p.name, (plugin, p))
    for name, (plugin, veto) in vetoes.items():
        if name in chosen:
            chosen[name] = (plugin, replace(chosen[name][1], veto_reason=veto.veto_reason))
    return sorted(chosen.values(), key=lambda item: (item[1].order, item[1].name))


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
    return p.check(model, ctx)


def _forward(model: nn.Module, args: tuple[Any, ...]) -> Any:
    with torch.no_grad():
        torch.manual_seed(0)  # same dropout masks in reference and candidate
        return model(*args)


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

    baseline: nn.Module | None = None
    reference_out = None
    args: tuple[Any, ...] = ()
    if sample_input is not None:  # O0 = the same model, only placed on the device
        args = call_args(backend, sample_input)
        baseline = copy.deepcopy(model).to(backend.device)
        reference_out = _forward(baseline, args)

    work = model if inplace else copy.deepcopy(model)
    ctx = PassContext(backend=backend, level=level, config=backend.config,
                      device_info=backend.get_device_info(), training=model.training,
                      sample_input=sample_input)
    result = OptimizationResult(model=work, backend=backend.name, level=level)
    for plugin, p in collect_passes(backend, level):
        reason = _skip_reason(p, plugin, work, ctx)
        if reason is not None:
            result.passes.append(PassRecord(p.name, "skipped", reason, plugin))
            continue
        assert p.apply is not None
        snapshot = copy.deepcopy(work) if p.mutates else work
        started = time.perf_counter()
        try:
            work = p.apply(work, ctx)
        except Exception as exc:
            work = snapshot
            error = f"{type(exc).__name__}: {exc}"
            logger.warning("pass %s failed and was rolled back: %s", p.name, error)
            result.passes.append(PassRecord(p.name, "failed", error, plugin))
            if strict:
                raise ModelOptimizationError(f"pass {p.name!r} failed: {error}") from exc
            continue
        result.passes.append(PassRecord(p.name, "applied", p.description, plugin,
                                        time.perf_counter() - started))
    result.model = work
    result.notes.extend(ctx.notes)

    if sample_input is not None and baseline is not None:
        candidate_out = _forward(work, args)
        result.max_abs_diff, result.max_rel_diff = output_drift(reference_out, candidate_out)
        if measure:
            result.baseline_seconds, result.optimized_seconds = compare_latency(
                lambda: baseline(*args), lambda: work(*args), backend.synchronize)
            result.speedup = result.baseline_seconds / result.optimized_seconds
    attach_result(work, result)
    return result
