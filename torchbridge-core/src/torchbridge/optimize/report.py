"""The one report type: what prepare_model did, skipped and failed, and what it measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from torchbridge.levels import OptimizationLevel

if TYPE_CHECKING:
    from torchbridge.optimize.settings import SettingChange

_RESULT_ATTR = "_torchbridge_optimization_result"


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
    # Process-wide settings the applied passes changed: name, before, after, and scope
    # ("call": in force only around the prepared model's calls; "process": left changed).
    process_settings: list[SettingChange] = field(default_factory=list)

    def restore_process_settings(self) -> list[str]:
        """Put back the process-wide settings this run left changed (scope "process"); the
        prepared model may then run slower or differently. Returns what could not be put
        back, with why (e.g. XLA's compilation cache, which a process sets once)."""
        from torchbridge.optimize.settings import put

        problems = []
        for change in self.process_settings:
            if change.scope != "process" or change.setting is None:
                continue
            try:
                put(change.setting, change.before)
            except Exception as exc:
                problems.append(f"{change.name}: {exc}")
        return problems

    def _named(self, status: str) -> list[PassRecord]:
        return [p for p in self.passes if p.status == status]

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "level": self.level.value,
            "passes": [p.__dict__ for p in self.passes], "notes": self.notes,
            "max_abs_diff": self.max_abs_diff, "max_rel_diff": self.max_rel_diff,
            "speedup": self.speedup, "baseline_seconds": self.baseline_seconds,
            "optimized_seconds": self.optimized_seconds,
            "kernel_substitutions": self.kernel_substitutions,
            "process_settings": [c.to_dict() for c in self.process_settings],
        }

    def summary(self) -> str:
        lines = [f"{self.backend} {self.level.value}:"]
        for p in self.passes:
            lines.append(f"  {p.status:8} {p.name}: {p.detail}")
        lines += [f"  setting: {c.describe()}" for c in self.process_settings]
        lines += [f"  note: {n}" for n in self.notes]
        for sub in self.kernel_substitutions:
            how = (f"{sub['implementation']} (plugin {sub['plugin']})"
                   if sub.get("status") == "substituted" else "kept")
            lines.append(f"  kernel: {sub['module']} ({sub['pattern']}): {how}: "
                         f"{sub.get('detail', '')}")
        if self.max_abs_diff is not None:
            lines.append(f"  drift vs O0: max abs {self.max_abs_diff:.3g}, "
                         f"max rel {self.max_rel_diff:.3g}")
        if self.speedup is not None and self.baseline_seconds and self.optimized_seconds:
            lines.append(f"  measured speedup vs O0: {self.speedup:.2f}x "
                         f"({self.baseline_seconds * 1e3:.3f} ms -> "
                         f"{self.optimized_seconds * 1e3:.3f} ms, median)")
        return "\n".join(lines)


def attach_result(model: nn.Module, result: OptimizationResult) -> None:
    object.__setattr__(model, _RESULT_ATTR, result)


def optimization_result(model: nn.Module) -> OptimizationResult | None:
    """The report of the prepare_model call that produced `model` (None if it did not)."""
    return getattr(model, _RESULT_ATTR, None)
