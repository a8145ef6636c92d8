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


_COMPILES, _TRANSFERS = "UncachedCompile", "TransferFromDeviceTime"


def _xla_counts(met: Any) -> dict[str, int]:
    """torch_xla's counts so far of compiles, transfers from the device and each aten::
    (host fallback) op. They are the process's, and the user's: the graph check reads them
    before and after its second call instead of clearing them."""
    counts = {name: met.counter_value(name) or 0 for name in met.counter_names()
              if name.startswith("aten::")}
    counts[_COMPILES] = met.counter_value(_COMPILES) or 0
    transfers = met.metric_data(_TRANSFERS)  # (samples in all, accumulated, recent samples)
    counts[_TRANSFERS] = transfers[0] if transfers else 0
    return counts


def _graph_check(model: nn.Module, ctx: PassContext) -> nn.Module:
    """Run the model twice on the device and read how torch_xla's counters grew over the
    second run. A second run that compiles again means the graph changes from call to call
    (dynamic shapes, Python values baked into the graph); aten:: counters are ops XLA cannot
    lower, run on the host; transfers from the device inside forward are host round trips
    (.item(), printing, data-dependent Python control flow). Each costs a TPU dearly."""
    import torch_xla
    import torch_xla.debug.metrics as met

    call = sample_call(ctx.backend, ctx.sample_input)  # a tensor, a tuple or keyword args
    with preserved_state(model):
        call(model)
        torch_xla.sync()
        before = _xla_counts(met)
        call(model)
        torch_xla.sync()
        after = _xla_counts(met)
    grown = {name: count - before.get(name, 0) for name, count in after.items()
             if count > before.get(name, 0)}
    compiles = grown.pop(_COMPILES, 0)
    transfers = grown.pop(_TRANSFERS, 0)
    fallbacks = grown  # the aten:: counters
    warnings = []
    if compiles:
        warnings.append(f"the second call compiled {compiles} new graph(s): shapes or Python "
                        "values change between calls; keep input shapes static (pad batches)")
    if fallbacks:
        ops = ", ".join(f"{name} x{count}" for name, count in sorted(fallbacks.items()))
        warnings.append(f"ops run on the host because XLA cannot lower them: {ops}")
    if transfers:
        warnings.append(f"{transfers} transfer(s) from the device inside forward (.item(), "
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
    # XLA compiles static shapes only: each new input shape is a new graph, and dynamo
    # gives up on a forward at its recompile limit, saying so once in its log only.
    limit = torch._dynamo.config.recompile_limit
    ctx.notes.append("compile: torch.compile(backend='openxla'); the first call compiles, "
                     "and so does the first call with each new input shape; once "
                     f"torch._dynamo.config.recompile_limit ({limit}) shapes have compiled, "
                     "new ones run without torch.compile: keep input shapes static (pad "
                     "batches)")
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
