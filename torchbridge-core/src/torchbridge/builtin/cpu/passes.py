"""Passes for the CPU backend, on top of the core's. (Whether compiling pays is no pass of
its own: with a sample input the pipeline times the model compiled and uncompiled and keeps
the faster, optimize/fastest.py.)

| pass | level | when |
| --- | --- | --- |
| inference_freezing | O3 | eval mode, compile not skipped: inductor freezing, without |
|  |  | oneDNN weight prepacking |
| heap_reuse | O2 | eval mode, a sample input, glibc's malloc: its calls page-fault (heap.py) |
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from torchbridge.builtin.cpu import heap
from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.core_passes import compile_ahead, compiled_with
from torchbridge.optimize.passes import OptimizationPass, PassContext

if TYPE_CHECKING:
    from torchbridge.backend import Backend


def _freeze_check(model: nn.Module, ctx: PassContext) -> str | None:
    # Freezing is an option of the compile pass: with compile skipped it would do nothing.
    return compile_ahead(ctx)


# Freezing without inductor's oneDNN weight prepacking: prepacked (mkldnn) weights cannot
# be pickled, so inductor's FX graph cache refuses the whole graph ("mkldnn tensors
# unpickleable") and every process compiles it again; without prepacking a second process
# reuses the compiled graph (tests/test_compile_cache.py). Prepacking did not pay for it
# here: O3 with and without it, same process, round-robin (2-core AMD EPYC, avx512_bf16,
# torch 2.13, under load from other jobs): ViT 589 vs 605 ms, BERT 341 vs 315 ms, ResNet
# 18.5 vs 18.7 ms, Llama 1912 vs 1432 ms; and preparing took 1.3-2x longer with it.
PREPACK_WEIGHTS = False
# What the report says the pass does, from the setting it applies.
FREEZING_DESCRIPTION = "inductor freezing: weights folded as constants" + (
    ", prepacked for oneDNN" if PREPACK_WEIGHTS else
    " (not prepacked for oneDNN, so that the compiled graph can be cached)")


def _freeze(model: nn.Module, ctx: PassContext) -> nn.Module:
    # Inductor freezing turns weights into constants and folds them (bf16 weight casts
    # happen once instead of every call). Weights changed after this are not seen:
    # inference only.
    ctx.state.setdefault("inductor_config", {}).update(
        {"freezing": True, "cpp.weight_prepack": PREPACK_WEIGHTS})
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
