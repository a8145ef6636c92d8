"""The one report type: what prepare_model did, skipped and failed, and what it measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchbridge.levels import OptimizationLevel

if TYPE_CHECKING:
    from torchbridge.optimize.quantize_gate import QuantizationReport
    from torchbridge.optimize.settings import SettingChange

_RESULT_ATTR = "_torchbridge_optimization_result"
QUANTIZE_PASS = "quantize"
COMPILE_PASS = "compile"
KERNEL_SUBSTITUTION_PASS = "kernel_substitution"
FOLDING_PASS = "conv_bn_folding"
LOW_PRECISION_WEIGHTS_PASS = "low_precision_weights"
AUTOCAST_PASS = "autocast"
QUANTIZE_NOT_ASKED = "no quantization asked for (prepare_model(quantize=...) or config " \
                     "optimization.quantize)"


@dataclass(frozen=True)
class PassRecord:
    name: str
    status: str  # applied, skipped, failed
    detail: str  # description when applied, reason when skipped, error when failed
    plugin: str | None = None
    seconds: float = 0.0


@dataclass
class OptimizationResult:
    """Returned by `Backend.optimize`; reachable from a prepared model through
    `torchbridge.optimization_result(model)`."""

    model: nn.Module
    backend: str
    level: OptimizationLevel
    passes: list[PassRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    speedup: float | None = None
    baseline_seconds: float | None = None
    optimized_seconds: float | None = None
    # One entry per module the kernel_substitution pass looked at: module, pattern, op,
    # status (substituted or kept), implementation and plugin, detail, rejected (why not).
    kernel_substitutions: list[dict[str, Any]] = field(default_factory=list)
    # Seconds prepare_model spent outside the passes: "reference" (O0 on the sample input),
    # "final_check" (the prepared model against it once more), "timing" (keep the faster).
    stage_seconds: dict[str, float] = field(default_factory=dict)
    # Process-wide settings the applied passes changed: name, before, after, and scope
    # ("call": in force only around the prepared model's calls; "process": left changed).
    process_settings: list[SettingChange] = field(default_factory=list)
    # The quantization mode asked for (None: none), and what the quantize pass did: its
    # method and accuracy figures (ctx.state["quantization"]). Whether it was kept is its
    # pass record's status: quantization_outcome() puts them together.
    quantize_mode: str | None = None
    quantization: QuantizationReport | None = None
    # Applied passes whose effect lives in the compiled forward (compile options): failed
    # with it should the compiled forward fail at a call after prepare_model returned.
    compile_dependents: list[str] = field(default_factory=list)

    def restore_process_settings(self) -> list[str]:
        """Put back the process-wide settings this run left changed (scope "process"); the
        prepared model may then run slower or differently. Returns what could not be put
        back, with why (e.g. XLA's compilation cache, which a process sets once)."""
        from torchbridge.optimize.settings import differs, put, read

        problems = []
        for change in self.process_settings:
            if change.scope != "process" or change.setting is None:
                continue
            try:
                put(change.setting, change.before)
            except Exception as exc:
                problems.append(f"{change.name}: {exc}")
                continue
            # Read back: a setting may take the call and stay as it is (glibc's malloc
            # thresholds, which have no way back to their dynamic default).
            if differs(change.before, now := read(change.setting)):
                problems.append(f"{change.name}: still {now!r} "
                                f"({change.why_process or 'it could not be put back'})")
        return problems

    def _named(self, status: str) -> list[PassRecord]:
        self._note_changes_since_prepare()
        return [p for p in self.passes if p.status == status]

    def _note_changes_since_prepare(self) -> None:
        """What happened to the prepared model after prepare_model returned, where it
        undoes a pass: the report is read through here (the pass lists, to_dict, summary)."""
        self._note_later_compile_failure()
        self._note_unfolded()
        self._note_weights_restored()
        self._note_converted()

    def _undone_after_return(self, names: tuple[str, ...], why: str) -> None:
        """The applied records of the passes `names` become skipped, "undone after
        prepare_model returned", with why."""
        for i, record in enumerate(self.passes):
            if record.name in names and record.status == "applied":
                self.passes[i] = PassRecord(
                    record.name, "skipped", f"undone after prepare_model returned: {why}",
                    record.plugin, record.seconds)

    def _note_unfolded(self) -> None:
        """A state dict loaded into the prepared model, or train(), makes its folded
        BatchNorms BatchNorms again (folding.FoldedBatchNorm): with none left folded, the
        report says so, and why, instead of listing conv_bn_folding as applied."""
        from torchbridge.optimize.folding import UNFOLDED_BY_LOAD, FoldedBatchNorm, undone_reason

        if any(p.name == FOLDING_PASS and p.status == "applied" for p in self.passes) and \
                not any(isinstance(m, FoldedBatchNorm) for m in self.model.modules()):
            self._undone_after_return((FOLDING_PASS,),
                                      undone_reason(self.model) or UNFOLDED_BY_LOAD)

    def _note_weights_restored(self) -> None:
        """Called in training mode (training_weights.py), or converted to another dtype
        (forward.watch_dtype_conversion), the model's weights stored in low precision are
        in a dtype of their own again: the report says so instead of listing
        low_precision_weights as applied."""
        from torchbridge.optimize.forward import WEIGHTS_RESTORED

        why = self.model.__dict__.get(WEIGHTS_RESTORED)
        if isinstance(why, str):
            self._undone_after_return((LOW_PRECISION_WEIGHTS_PASS,), why)

    def _note_converted(self) -> None:
        """Converted to another floating dtype after prepare_model returned (model.half(),
        .double(), .to(dtype)), the model computes in it without autocast
        (forward.watch_dtype_conversion): autocast is listed as undone. (The weights it
        stored in low precision are converted too: _note_weights_restored says so.)"""
        from torchbridge.optimize.forward import CONVERTED

        now = self.model.__dict__.get(CONVERTED)
        if isinstance(now, torch.dtype):
            name = str(now).removeprefix("torch.")
            self._undone_after_return(
                (AUTOCAST_PASS,), f"the model was converted to {name} (Module.half(), "
                f".double(), .to(dtype)); it computes in {name} as converted, without "
                "autocast")

    def _note_later_compile_failure(self) -> None:
        """The compiled forward runs uncompiled for good once it failed at a call after
        prepare_model returned (a recompile for another input shape that inductor cannot
        compile: forward.compiled_forward), once the weights it froze changed (inductor
        freezing: forward.FrozenTensors), and, for calls its compiled variants do not
        match, once dynamo reached its recompile limit on it; from then on the report says
        so too, instead of listing compile, and the compile options riding on it, as
        applied."""
        from torchbridge.optimize.forward import compile_state

        state = compile_state(self.model)
        if state is None or not any(p.name == COMPILE_PASS and p.status == "applied"
                                    for p in self.passes):
            return
        status, head = "failed", ""
        if state.error is not None:
            why = f"the compiled forward failed at a call after prepare_model returned " \
                  f"({type(state.error).__name__}: {state.error}); the model runs " \
                  "uncompiled from then on"
        elif state.stale is not None:
            status, head = "skipped", "undone after prepare_model returned: "
            why = "the compiled forward held the weights as constants (inductor " \
                  f"freezing), and {state.stale}; the model runs its forward uncompiled " \
                  "from then on, reading the weights as they are (prepare it again to " \
                  "compile them)"
        elif (limit := state.recompile_limit_reached()) is not None:
            why = f"after prepare_model returned, {limit}"
        else:
            return
        for i, record in enumerate(self.passes):
            if record.status != "applied":
                continue
            if record.name == COMPILE_PASS:
                self.passes[i] = PassRecord(record.name, status, head + why, record.plugin,
                                            record.seconds)
            elif record.name in self.compile_dependents:
                self.passes[i] = PassRecord(record.name, status,
                                            f"{record.name} is a compile option, and "
                                            f"{'compile was ' + head if head else ''}{why}",
                                            record.plugin, record.seconds)

    @property
    def applied(self) -> list[PassRecord]:
        return self._named("applied")

    @property
    def skipped(self) -> list[PassRecord]:
        return self._named("skipped")

    @property
    def failed(self) -> list[PassRecord]:
        return self._named("failed")

    @property
    def optimizations_applied(self) -> list[str]:
        """Names of the passes that really ran (the seeds' field)."""
        return [p.name for p in self.applied]

    def settle_kernel_lines(self) -> None:
        """The kernel lines as the kept model runs: where kernel_substitution was undone
        after it ran (the timing kept O0, a final check failed), its modules run their own
        code again, and "substituted" would say what no longer happens."""
        record = next((p for p in self.passes if p.name == KERNEL_SUBSTITUTION_PASS), None)
        if record is None or record.status == "applied":
            return
        for line in self.kernel_substitutions:
            if line.get("status") == "substituted":
                line.update(status="undone", detail=f"was {line.get('implementation')} "
                            f"(plugin {line.get('plugin')}); {record.detail}")

    def quantization_outcome(self) -> dict[str, Any] | None:
        """The quantization asked for, if any: mode, status (applied, skipped, rolled
        back), detail (how, or why not) and, when applied, the gate's figures against O0
        on the sample input (cosine, argmax_agreement and their minimums)."""
        if self.quantize_mode is None:
            return None
        record = next((p for p in self.passes if p.name == QUANTIZE_PASS), None)
        if record is None:
            return {"mode": self.quantize_mode, "status": "skipped",
                    "detail": f"no {QUANTIZE_PASS!r} pass ran for backend {self.backend}"}
        status = {"failed": "rolled back"}.get(record.status, record.status)
        outcome: dict[str, Any] = {"mode": self.quantize_mode, "status": status,
                                   "detail": record.detail}
        q = self.quantization
        if status == "applied" and q is not None:
            outcome.update(detail=q.method, cosine=q.cosine,
                           argmax_agreement=q.argmax_agreement, min_cosine=q.min_cosine,
                           min_argmax_agreement=q.min_argmax_agreement)
        return outcome

    def _quantization_line(self) -> str | None:
        outcome = self.quantization_outcome()
        if outcome is None:
            return None
        if outcome["status"] == "applied" and self.quantization is not None:
            return f"quantization: {outcome['mode']} applied ({outcome['detail']}); " \
                   f"against O0 on the sample input: {self.quantization.figures()}"
        detail = str(outcome["detail"]).removeprefix(f"{outcome['mode']}: ")
        if outcome["status"] == "skipped":
            return f"quantization: {outcome['mode']} skipped: {detail}"
        return detail if detail.startswith("quantization ") else \
            f"quantization {outcome['mode']} rolled back: {detail}"

    def to_dict(self) -> dict[str, Any]:
        self._note_changes_since_prepare()
        return {
            "backend": self.backend, "level": self.level.value,
            "passes": [p.__dict__ for p in self.passes], "notes": self.notes,
            "max_abs_diff": self.max_abs_diff, "max_rel_diff": self.max_rel_diff,
            "speedup": self.speedup, "baseline_seconds": self.baseline_seconds,
            "optimized_seconds": self.optimized_seconds,
            "kernel_substitutions": self.kernel_substitutions,
            "stage_seconds": self.stage_seconds,
            "process_settings": [c.to_dict() for c in self.process_settings],
            "quantization": self.quantization_outcome(),
        }

    def summary(self) -> str:
        self._note_changes_since_prepare()
        lines = [f"{self.backend} {self.level.value}:"]
        for p in self.passes:
            lines.append(f"  {p.status:8} {p.name}: {p.detail}")
        lines += [f"  setting: {c.describe()}" for c in self.process_settings]
        quantization = self._quantization_line()
        if quantization is not None:
            lines.append(f"  {quantization}")
        lines += [f"  note: {n}" for n in self.notes]
        for sub in self.kernel_substitutions:
            how = (f"{sub['implementation']} (plugin {sub['plugin']})"
                   if sub.get("status") == "substituted" else sub.get("status") or "kept")
            lines.append(f"  kernel: {sub['module']} ({sub['pattern']}): {how}: "
                         f"{sub.get('detail', '')}")
        if self.max_abs_diff is not None:
            lines.append(f"  drift vs O0: max abs {self.max_abs_diff:.3g}, "
                         f"max rel {self.max_rel_diff:.3g}")
        if self.speedup is not None and self.baseline_seconds and self.optimized_seconds:
            lines.append(f"  measured speedup vs O0: {self.speedup:.2f}x "
                         f"({self.baseline_seconds * 1e3:.3f} ms -> "
                         f"{self.optimized_seconds * 1e3:.3f} ms a call, timed round-robin)")
        return "\n".join(lines)


def attach_result(model: nn.Module, result: OptimizationResult) -> None:
    """The report, on the model prepare_model returns (or that its first call decided on).
    The weights a frozen compiled forward watches are taken as they are here: what
    prepare_model's own work left after the compile (buffers put back by its checks, a
    distributed wrapper's broadcast of rank 0's weights) is not a change made after it
    returned (forward.FrozenTensors)."""
    from torchbridge.optimize.forward import compile_state

    object.__setattr__(model, _RESULT_ATTR, result)
    for prepared in (model, getattr(model, "module", None)):  # DistributedDataParallel's
        state = compile_state(prepared) if isinstance(prepared, nn.Module) else None
        if state is not None and state.frozen is not None:
            state.frozen.take()


def optimization_result(model: nn.Module) -> OptimizationResult | None:
    """The report of the prepare_model call that produced `model` (None if it did not)."""
    return getattr(model, _RESULT_ATTR, None)
