"""Keep the faster: with a sample input, the prepared model is timed against O0 (and, when
it is compiled, against itself uncompiled) on that input, round-robin in one process, and
the fastest is what prepare_model returns. Whether compiling pays is therefore decided by
what this machine measures, not by a rule tuned on another one: on a CPU without AMX a
transformer's matmuls leave compiling little to gain, with AMX much more.

The passes a faster candidate leaves out are undone (from the last, as any undo) and
reported skipped with the figures."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from torch import nn

from torchbridge.optimize.forward import CompileState, compile_state, uncompiled
from torchbridge.optimize.measure import Timer, preserved_state, round_robin, wall_timer
from torchbridge.optimize.report import COMPILE_PASS, PassRecord

if TYPE_CHECKING:
    from torchbridge.optimize.run import Run

logger = logging.getLogger("torchbridge.optimize.pipeline")

# Few calls of the model when one candidate is clearly the fastest: 3 timed rounds (9 calls
# for 3 candidates), up to 9 rounds while the two fastest are within
# 10% and O0 is within 1.5x of the fastest (round_robin's baseline): timing stays a small
# part of preparing (a first call users wait for), and a close race that may decide
# whether the model is kept as O0 gets more than 3 samples. Medians, not single samples:
# the Llama of the benchmarks, compiled 20 ms against 24 ms uncompiled, was once timed the
# other way round on 2 samples. Once O0 is out of the race, 3 rounds choose between the
# prepared model and itself uncompiled (a difference of a few percent, where each extra
# round cost a call of both: 0.5 s of a first call of BERT at twice the suite's width).
# No warm-up round: the prepared model has run before (the checks after the passes; O0,
# below, has not), and one slow first sample decides nothing (medians of 3 or more; a
# candidate out after two rounds is given its faster sample). It cost a call of each:
# 0.25-0.4 s of the first call of a Llama, GPT-2 or BERT at twice the suite's width, where
# their figures and what was kept did not move (the suite's five models at its own width).
# At least 0.1 s of samples, for models that run in microseconds (up to 300 rounds). It
# was 0.3 s, which made a model of a few milliseconds a round run 20 rounds however clear
# the winner: 0.3-0.4 s of each first call of the HF suite's models, whose O0 runs 7-24 ms.
# The calls run under no_grad, as the pipeline's checks did (preserved_state): under
# inference_mode a compiled model would recompile inside the timing and look seconds
# slower than it is (seen: "prepared 1100 ms" against 33 ms for O0, and compile undone
# for it).
WARMUP, REPEATS, MAX_REPEATS, MIN_SECONDS, MARGIN = 0, 3, 9, 0.1, 0.10
# Except O0 with a sample input: it is the caller's model (or a copy of it), which
# prepare_model has not called before the rounds (O0's reference output came from the copy
# the passes then changed), and its first call is slow: page faults, lazy setup (a T5
# encoder's first two calls in a process 16.4 and 8.7 ms, then 7.2-8.3; 2-core Intel
# Xeon). O0 far behind is out of the race after two rounds, its figure the faster of its
# two samples, so one slow sample beside that first call made the report's speedup (a
# T5 encoder once 3.7x, where it ran 2.4x O0's speed in a loop). One call of O0, untimed,
# before the rounds: over 20 fresh processes each (five Hugging Face models, four runs,
# benchmarks/report_speedup.py), the report said at most 1.07x what a loop of each model
# measured, against up to 1.21x without (DeiT); it errs low instead (0.72x-1.07x, mean
# 0.93x; Llama and BERT low either way: round-robin against a loop). Timing on the first
# call's input needs none: O0 has just given its reference output there.
WARM_BASELINE = True


def default_timer(synchronize: Callable[[], None]) -> Timer:
    """The timer prepare_model decides with: wall time. (A test suite whose tests are not
    about this decision replaces it, so that their outcome does not hang on the machine's
    speed: tests/conftest.py.)"""
    return wall_timer(synchronize)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def time_candidates(run: Run, baseline: nn.Module | None, timer: Timer,
                    warm_baseline: bool) -> dict[str, float]:
    """Median seconds on the run's input of "O0" (the model as given, placed; left out when
    `baseline` is None), "prepared" and, when the prepared model runs compiled,
    "uncompiled" (the same model, its forward before compile). Eval mode; the models'
    buffers and the RNG are left as they were. `warm_baseline`: O0 is called once, untimed,
    before the rounds (see WARM_BASELINE)."""
    call = run.call
    assert call is not None
    work = run.work
    candidates: dict[str, Callable[[], Any]] = {"prepared": lambda: call(work)}
    if baseline is not None:
        candidates = {"O0": lambda: call(baseline), **candidates}
    state = running_compiled(run)
    if state is not None:
        def without_compile() -> Any:
            with uncompiled(state):
                return call(work)
        candidates["uncompiled"] = without_compile
    with ExitStack() as stack:
        for model in {id(m): m for m in (baseline, work) if m is not None}.values():
            stack.enter_context(preserved_state(model))
            model.eval()
        if baseline is not None and warm_baseline:
            candidates["O0"]()
        return round_robin(candidates, timer, warmup=WARMUP, repeats=REPEATS,
                           max_repeats=MAX_REPEATS, min_seconds=MIN_SECONDS, margin=MARGIN,
                           inference_mode=False, baseline="O0")


def _applied(run: Run, name: str) -> bool:
    return any(entry.p.name == name and entry.effective for entry in run.applied)


def running_compiled(run: Run) -> CompileState | None:
    """The compile state of the run's model when it runs compiled (the compile pass applied
    and its forward not failed), so that "uncompiled" is a candidate; else None."""
    state = compile_state(run.work)
    if state is not None and state.error is None and _applied(run, COMPILE_PASS):
        return state
    return None


def keep_fastest(run: Run, baseline: nn.Module | None, timer: Timer, decide: bool = True,
                 on: str = "the sample input", warm_baseline: bool | None = None) -> None:
    """Times the candidates and keeps the fastest: passes undone as needed, the report's
    speedup and notes say what was measured and kept. decide=False: measured only.
    `baseline` None: O0 is not a candidate (the prepared model against itself
    uncompiled); `on` names the input timed, for the report."""
    warm = WARM_BASELINE if warm_baseline is None else warm_baseline
    seconds = time_candidates(run, baseline, timer, warm)
    kept = min(seconds, key=lambda label: seconds[label]) if decide else "prepared"
    result = run.result
    figures = ", ".join(f"{label} {_ms(s)}" for label, s in seconds.items())
    why = f"timed on {on} ({figures})"
    if not decide:
        result.notes.append(f"{why}: measured only (the model is in training mode)")
    elif kept == "prepared":
        result.notes.append(f"{why}: kept the prepared model")
    else:
        stop = (lambda entry: entry.p.name == COMPILE_PASS) if kept == "uncompiled" else None
        undone = _undo(run, stop, why)
        what = "its forward uncompiled" if kept == "uncompiled" else "as O0 (as given, placed)"
        result.notes.append(f"{why}: {kept} was the fastest, so the model runs {what}; "
                            f"undone: {', '.join(undone) or 'nothing (no pass had changed it)'}")
        logger.info("prepare_model kept %s: %s; undone: %s", kept, figures,
                    ", ".join(undone))
        run.check_effects()
        run.settle_settings()
        run.final_check()
        result.settle_kernel_lines()  # the first call's timing decides after the report
    result.optimized_seconds = seconds[kept]
    if "O0" in seconds:
        result.baseline_seconds = seconds["O0"]
        result.speedup = seconds["O0"] / seconds[kept] if seconds[kept] > 0 else None


# The candidates were timed in one process, under the process-wide settings the passes had
# made: those that change how fast any model runs (ProcessSetting.kept_after_timing:
# glibc's malloc) stay when their pass is undone, or the kept model would not run as timed.
KEPT_AS_TIMED = "the kept model was timed under it"


def _undo(run: Run, stop: Callable[[Any], bool] | None, why: str) -> list[str]:
    """Undo applied passes from the last: through the one `stop` matches, or (stop None)
    every pass after placement (order above 0). Their records say so. Their settings
    declared kept_after_timing stay: KEPT_AS_TIMED."""
    undone: list[str] = []
    while run.applied and run.applied[-1].p.order > 0:
        entry = run.undo_last(after_timing=KEPT_AS_TIMED)
        if not entry.effective:  # reported "no effect": nothing of it to undo or to name
            if stop is not None and stop(entry):
                break
            continue
        undone.append(entry.p.name)
        run.result.passes[entry.record] = PassRecord(
            entry.p.name, "skipped", f"undone after timing: {why}", entry.plugin,
            run.result.passes[entry.record].seconds)
        if stop is not None and stop(entry):
            break
    return undone
