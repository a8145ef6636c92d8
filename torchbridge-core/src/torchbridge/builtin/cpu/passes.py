"""Passes for the CPU backend, on top of the core's. (Whether compiling pays is no pass of
its own: with a sample input the pipeline times the model compiled and uncompiled and keeps
the faster, optimize/fastest.py.)

| pass | level | when |
| --- | --- | --- |
| inference_freezing | O3 | eval mode, compile not skipped: inductor freezing, weights |
|  |  | prepacked for oneDNN while float layers remain (prepack.py) |
| heap_reuse | O2 | eval mode, a sample input, glibc's malloc: its calls page-fault (heap.py) |
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from torchbridge.builtin.cpu import heap, prepack
from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.core_passes import compile_ahead, compiled_with
from torchbridge.optimize.passes import OptimizationPass, PassContext

if TYPE_CHECKING:
    from torchbridge.backend import Backend


def _freeze_check(model: nn.Module, ctx: PassContext) -> str | None:
    # Freezing is an option of the compile pass: with compile skipped it would do nothing.
    return compile_ahead(ctx)


# Whether freezing also prepacks the weights for oneDNN: prepack.py (faster calls).
FREEZING_DESCRIPTION = ("inductor freezing: weights folded as constants, and prepacked for "
                        "oneDNN while float convolutions or linear layers remain (config "
                        "hardware.cpu.weight_prepack)")


def _freeze(model: nn.Module, ctx: PassContext) -> nn.Module:
    # Inductor freezing turns weights into constants and folds them (bf16 weight casts
    # happen once instead of every call). Weights changed after this are not seen:
    # inference only.
    cpu_config: Any = getattr(ctx.config.hardware, "cpu", None)  # a dynamic section
    wanted, why = prepack.decide(model, getattr(cpu_config, "weight_prepack", None))
    ctx.notes.append(prepack.arrange(wanted, why))
    ctx.state.setdefault("inductor_config", {}).update(
        {"freezing": True, "cpp.weight_prepack": wanted})
    return model


def _heap_check(model: nn.Module, ctx: PassContext) -> str | None:
    cpu_config: Any = getattr(ctx.config.hardware, "cpu", None)
    if cpu_config is not None and not cpu_config.heap_reuse:
        return "config hardware.cpu.heap_reuse is off"
    if ctx.sample_input is None:
        return "no sample input to count the page faults of a call on"
    return heap.why_not()


def cpu_passes(backend: Backend) -> list[OptimizationPass]:
    passes = [
        OptimizationPass("inference_freezing", FREEZING_DESCRIPTION, OptimizationLevel.O3,
                         _freeze, _freeze_check, mode="inference", order=79, mutates=False,
                         effect=compiled_with("freezing", "inductor_config")),
    ]
    cpu_config: Any = getattr(backend.config.hardware, "cpu", None)  # a dynamic section
    if cpu_config is not None and not cpu_config.allow_bf16:
        passes.append(OptimizationPass.veto("autocast", "config hardware.cpu.allow_bf16 "
                                            "is off"))
    passes.append(OptimizationPass(
        "heap_reuse", "glibc's malloc keeps freed buffers for the next call (the page "
        "faults per call before and after: the report's notes)", OptimizationLevel.O2,
        heap.reuse_heap, _heap_check, mode="inference", order=90, mutates=False,
        settings=heap.SETTINGS))
    return passes


def __getattr__(name: str) -> Any:
    # After 0.3.0 the pass decides per model (prepack.py); a plugin that read this constant
    # gets its 0.3.0 value and a warning, not an AttributeError.
    if name == "PREPACK_WEIGHTS":
        import warnings

        warnings.warn("torchbridge.builtin.cpu.passes.PREPACK_WEIGHTS is deprecated and "
                      "goes in the next major release; it no longer says what the "
                      "inference_freezing pass does: prepack.decide(model, setting) does "
                      "(weights are prepacked while float convolution or linear layers "
                      "remain, config hardware.cpu.weight_prepack)",
                      DeprecationWarning, stacklevel=2)
        return False
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
