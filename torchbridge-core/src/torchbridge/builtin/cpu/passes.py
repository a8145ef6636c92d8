"""Passes for the CPU backend, on top of the core's.

| pass | level | when |
| --- | --- | --- |
| compile_value_check | O2 | eval mode, sample input given: skip compile where it cannot pay |
| inference_freezing | O3 | eval mode: inductor freezing |
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.core_passes import compile_ahead, compiled_with
from torchbridge.optimize.measure import preserved_state, sample_call
from torchbridge.optimize.passes import OptimizationPass, PassContext

if TYPE_CHECKING:
    from torchbridge.backend import Backend


def _freeze_check(model: nn.Module, ctx: PassContext) -> str | None:
    # Freezing is an option of the compile pass: with compile skipped it would do nothing.
    return compile_ahead(ctx)


def _freeze(model: nn.Module, ctx: PassContext) -> nn.Module:
    # Inductor freezing turns weights into constants, folds them (bf16 weight casts happen
    # once instead of every call) and prepacks them for oneDNN. Weights changed after this
    # are not seen: inference only.
    ctx.state.setdefault("compile_options", {})["freezing"] = True
    return model


# Ops inductor on CPU hands to the same oneDNN / MKL kernels eager uses: compiling leaves
# their time as it is. Measured on the reference models: with bf16 weights the MLP ran
# 5.4 ms eager and 5.3 ms compiled. Convolutions are not here: compiling them gains (conv
# net 6.1 -> 3.8 ms) through fused post-ops and weight prepacking.
LIBRARY_OPS = frozenset({
    "aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
})
# Skip compile when at least this share of an eager call is library work: compiling could
# then save at most a third of the time, and costs seconds of code generation (4-7 s for
# the reference encoder and decoder LM, cold). Compile anyway with
# optimization.disabled_passes = ["compile_value_check"].
LIBRARY_SHARE_TO_SKIP_COMPILE = 2 / 3


def _needs_sample(model: nn.Module, ctx: PassContext) -> str | None:
    return None if ctx.sample_input is not None else "needs sample_input to measure the model"


class _LibraryTimer(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Adds up the wall time of LIBRARY_OPS calls (CPU kernels run synchronously)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seconds: dict[str, float] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        name = func._schema.name
        if name not in LIBRARY_OPS:
            return func(*args, **(kwargs or {}))
        started = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
        return out


def library_time_share(model: nn.Module, call: Callable[[nn.Module], Any], calls: int = 3
                       ) -> tuple[float, str]:
    """(share of an eager call's wall time spent in LIBRARY_OPS, those ops as text), over
    `calls` calls after a warm-up. The wall time includes Python and dispatch overhead,
    which compiling does remove. The model's buffers and the global RNG are left as
    they were."""
    with preserved_state(model):
        call(model)  # warm-up: first-call allocations and lazy inits
        started = time.perf_counter()
        for _ in range(calls):
            call(model)
        total = time.perf_counter() - started
        timer = _LibraryTimer()
        with timer:
            for _ in range(calls):
                call(model)
    library = sum(timer.seconds.values())
    ops = sorted(timer.seconds.items(), key=lambda kv: -kv[1])
    described = ", ".join(f"{name} {sec / total:.0%}" for name, sec in ops) or "none"
    return min(library / total, 1.0), described


def _compile_value(model: nn.Module, ctx: PassContext) -> nn.Module:
    share, top = library_time_share(model, sample_call(ctx.backend, ctx.sample_input))
    verdict = f"measured on the sample input: {share:.0%} of eager time is in matmul and " \
              f"attention kernels that compiling leaves as they are ({top})"
    if share >= LIBRARY_SHARE_TO_SKIP_COMPILE:
        ctx.state["skip_compile"] = f"{verdict}; compiling could save at most " \
                                    f"{1 - share:.0%} and costs seconds"
    ctx.notes.append(f"compile_value_check: {verdict}")
    return model


def _measured(model: nn.Module, ctx: PassContext) -> str | None:
    return None  # its effect is the measurement and the decision, both in the report


def cpu_passes(backend: Backend) -> list[OptimizationPass]:
    passes = [
        OptimizationPass("compile_value_check", "timed the model's matmul and attention "
                         "kernels to decide whether compiling it can pay",
                         OptimizationLevel.O2, _compile_value, _needs_sample,
                         mode="inference", order=78, mutates=False, effect=_measured),
        OptimizationPass("inference_freezing", "inductor freezing: weights folded as "
                         "constants and prepacked for oneDNN", OptimizationLevel.O3, _freeze,
                         _freeze_check, mode="inference", order=79, mutates=False,
                         effect=compiled_with("freezing", "inductor_config")),
    ]
    cpu_config: Any = getattr(backend.config.hardware, "cpu", None)  # a dynamic section
    if cpu_config is not None and not cpu_config.allow_bf16:
        passes.append(OptimizationPass.veto("autocast", "config hardware.cpu.allow_bf16 "
                                            "is off"))
    return passes
