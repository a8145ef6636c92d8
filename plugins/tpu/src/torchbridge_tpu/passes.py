"""The TPU plugin's prepare_model passes, on top of the core's placement, conv-BN folding and
autocast (bf16 on XLA).

| pass | level | when |
| --- | --- | --- |
| xla_graph_check | O1 | with a sample input: warns of recompiling graphs, host round trips |
| xla_compilation_cache | O2 | hardware.tpu.enable_xla_cache |
| compile | O2 | replaces the core's: torch.compile(backend="openxla"), unless mode is lazy |

The core's autocast is vetoed when hardware.tpu.precision is float32 or mixed_precision off.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.core_passes import compiled
from torchbridge.optimize.measure import preserved_state, sample_call
from torchbridge.optimize.passes import OptimizationPass, PassContext
from torchbridge.optimize.settings import ProcessSetting

if TYPE_CHECKING:
    from torchbridge.backend import Backend

logger = logging.getLogger(__name__)
_cache_lock = threading.Lock()
_cache_dir: str | None = None


def _graph_check_check(model: nn.Module, ctx: PassContext) -> str | None:
    return None if ctx.sample_input is not None else "needs sample_input to run the model"


def _graph_check(model: nn.Module, ctx: PassContext) -> nn.Module:
    """Run the model twice on the device and read torch_xla's counters. A second run that
    compiles again means the graph changes from call to call (dynamic shapes, Python
    values baked into the graph); aten:: counters are ops XLA cannot lower, run on the host;
    transfers from the device inside forward are host round trips (.item(), printing,
    data-dependent Python control flow). Each costs a TPU dearly."""
    import torch_xla
    import torch_xla.debug.metrics as met

    call = sample_call(ctx.backend, ctx.sample_input)  # a tensor, a tuple or keyword args
    with preserved_state(model):
        call(model)
        torch_xla.sync()
        met.clear_all()
        call(model)
        torch_xla.sync()
    compiles = met.counter_value("UncachedCompile") or 0
    fallbacks = {name: met.counter_value(name) for name in met.counter_names()
                 if name.startswith("aten::")}
    transfers = met.metric_data("TransferFromDeviceTime")
    warnings = []
    if compiles:
        warnings.append(f"the second call compiled {compiles} new graph(s): shapes or Python "
                        "values change between calls; keep input shapes static (pad batches)")
    if fallbacks:
        ops = ", ".join(f"{name} x{count}" for name, count in sorted(fallbacks.items()))
        warnings.append(f"ops run on the host because XLA cannot lower them: {ops}")
    if transfers and transfers[0]:
        warnings.append(f"{transfers[0]} transfer(s) from the device inside forward (.item(), "
                        "printing or data-dependent control flow force a host round trip)")
    ctx.state["xla_graph_warnings"] = warnings
    if warnings:
        ctx.notes.extend(f"xla_graph_check: {w}" for w in warnings)
    else:
        ctx.notes.append("xla_graph_check: static graph, no host fallbacks or round trips")
    return model


def _section(ctx: PassContext) -> Any:
    return ctx.backend.hardware_config


def _cache_check(model: nn.Module, ctx: PassContext) -> str | None:
    if not _section(ctx).enable_xla_cache:
        return "config hardware.tpu.enable_xla_cache is off"
    return None


def _compilation_cache(model: nn.Module, ctx: PassContext) -> nn.Module:
    global _cache_dir
    import torch_xla.runtime as xr

    wanted = _section(ctx).cache_dir or os.path.join(Path.home(), ".cache", "torchbridge",
                                                     "xla")
    with _cache_lock:
        if _cache_dir is None:
            os.makedirs(wanted, exist_ok=True)
            # XLA allows one persistent cache per process, set before the first compilation.
            xr.initialize_cache(wanted, readonly=False)
            _cache_dir = wanted
        elif _cache_dir != wanted:
            raise RuntimeError(f"the XLA compilation cache of this process is already "
                               f"{_cache_dir}; XLA cannot switch it to {wanted}")
    ctx.notes.append(f"xla_compilation_cache: compiled graphs persist in {_cache_dir}")
    return model


# XLA allows one persistent cache per process, set before its first compilation: the
# pipeline reports it as process-wide and cannot set it back.
XLA_CACHE = ProcessSetting("torch_xla persistent compilation cache", lambda: _cache_dir, None,
                           scope="process", why_process="XLA sets one cache per process, "
                           "before its first compilation, and cannot unset it")


def _cache_in_use(model: nn.Module, ctx: PassContext) -> str | None:
    return None if _cache_dir is not None else "no XLA compilation cache was initialized"


def _counters_read(model: nn.Module, ctx: PassContext) -> str | None:
    return None  # its effect is what it read from the counters, in the report's notes


def _compile_check(model: nn.Module, ctx: PassContext) -> str | None:
    if _section(ctx).compilation_mode == "lazy":
        return "config hardware.tpu.compilation_mode is lazy: torch_xla traces lazily, " \
               "without torch.compile"
    return None


def _compile(model: nn.Module, ctx: PassContext) -> nn.Module:
    # The core's in-place compiled forward: the prepared model stays the user's object
    # (attributes, methods, hooks), as with the core's own compile pass.
    from torchbridge.optimize.forward import compiled_forward

    compiled_forward(model, lambda fn: torch.compile(fn, backend="openxla"),
                     options={"backend": "openxla"})
    ctx.notes.append("compile: torch.compile(backend='openxla'); the first call compiles")
    return model


def tpu_passes(backend: Backend) -> list[OptimizationPass]:
    o1, o2 = OptimizationLevel.O1, OptimizationLevel.O2
    passes = [
        OptimizationPass("xla_graph_check", "ran the model twice and read torch_xla's "
                         "counters for recompilation, host fallbacks and round trips", o1,
                         _graph_check, _graph_check_check, order=5, mutates=False,
                         effect=_counters_read),
        OptimizationPass("xla_compilation_cache", "XLA's persistent compilation cache", o2,
                         _compilation_cache, _cache_check, order=1, mutates=False,
                         settings=(XLA_CACHE,), effect=_cache_in_use),
        OptimizationPass("compile", "torch.compile with the openxla backend", o2, _compile,
                         _compile_check, order=80, mutates=False, effect=compiled),
    ]
    section = backend.hardware_config
    if section is not None and section.precision == "float32":
        passes.append(OptimizationPass.veto("autocast", "config hardware.tpu.precision is "
                                            "float32"))
    elif section is not None and not section.mixed_precision:
        passes.append(OptimizationPass.veto("autocast", "config hardware.tpu.mixed_precision "
                                            "is off"))
    return passes
