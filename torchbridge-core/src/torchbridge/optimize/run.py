"""One prepare_model run, pass by pass: each pass checked against what it declared, kept
or rolled back, and every applied pass kept on an undo stack with the snapshot of the model
before it; then, when every pass has run, their effects, the process-wide settings, and the
model once more against O0. pipeline.py collects the passes and drives this.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from torchbridge.errors import ModelOptimizationError, TorchBridgeError
from torchbridge.optimize import settings as process
from torchbridge.optimize.forward import compile_state
from torchbridge.optimize.measure import UncheckableOutput, output_drift, preserved_state
from torchbridge.optimize.passes import OptimizationPass, PassContext, PassSkipped
from torchbridge.optimize.report import COMPILE_PASS, OptimizationResult, PassRecord
from torchbridge.optimize.settings import watched
from torchbridge.optimize.snapshot import ModelChanges, ModelSnapshot, SnapshotRestoreError
from torchbridge.plugins import get_plugin_host, is_fatal

logger = logging.getLogger("torchbridge.optimize.pipeline")


def skip_reason(p: OptimizationPass, plugin: str, model: nn.Module, ctx: PassContext
                 ) -> str | None:
    return ruled_out(p, plugin, ctx) or check_reason(p, model, ctx)


def ruled_out(p: OptimizationPass, plugin: str, ctx: PassContext) -> str | None:
    """Why the pass does not run, from its declaration and the run alone (no call into the
    plugin), or None."""
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
    return None


def check_reason(p: OptimizationPass, model: nn.Module, ctx: PassContext) -> str | None:
    """The pass's own check: None to run, else why it is skipped."""
    reason = p.check(model, ctx)
    if reason is not None and not isinstance(reason, str):
        raise TypeError(f"check returned {type(reason).__name__}, expected a reason string "
                        "or None")
    return reason


def run_sample(model: nn.Module, call: Callable[[nn.Module], Any]) -> Any:
    """The model's output on the sample input, in eval mode (no dropout, BatchNorm on its
    running statistics: comparable between runs), leaving no trace on the model or the
    global RNG."""
    with preserved_state(model):
        model.eval()
        return call(model)


OutputCheck = Callable[[Any, Any], "str | None"]


def _verify(model: nn.Module, call: Callable[[nn.Module], Any], reference: Any,
            tolerance: float, output_check: OutputCheck | None = None
            ) -> tuple[float, float]:
    """(max abs drift, max rel drift) of the model's output against the reference; raises
    _Unverified when its output is no drop-in for the reference: beyond the level's
    tolerance, or, once a pass with its own `output_check` (quantization) has been
    applied, failing that check."""
    out = run_sample(model, call)
    state = compile_state(model)
    if state is not None and state.error is not None:
        raise _Unverified(f"the compiled model failed on the sample input: "
                          f"{type(state.error).__name__}: {state.error}")
    try:
        max_abs, max_rel = output_drift(reference, out)
    except UncheckableOutput as exc:
        raise _Uncheckable(str(exc)) from None
    except ValueError as exc:
        raise _Unverified(str(exc)) from None
    if output_check is not None:
        failed = output_check(reference, out)
        if failed is not None:
            raise _Unverified(failed)
        return max_abs, max_rel
    if not max_rel <= tolerance:
        raise _Unverified(f"output drift {max_rel:.3g} (max abs {max_abs:.3g}) exceeds the "
                          f"level's tolerance {tolerance:g}")
    return max_abs, max_rel


class _CompileFailedProbe(Exception):
    """Stands for a compile error while Run._find_compile_dependents asks the effects."""


def _effect_missing(entry: _Applied, run: Run) -> str | None:
    assert entry.p.effect is not None
    try:
        return entry.p.effect(run.work, run.ctx)
    except Exception as exc:  # an effect check that cannot answer: not known to depend
        logger.debug("effect check of %s raised: %s", entry.p.name, exc)
        return None


class _Unverified(Exception):
    """A pass's result failed the check on the sample input."""


class _Uncheckable(_Unverified):
    """The model's outputs hold nothing the check can compare: no pass can be verified."""


class _Lied(Exception):
    """A pass changed what it declared it would not, or what no pass may change."""


class _CheckChanged(_Lied):
    """A pass's check changed the model or a process-wide setting: a check only looks."""


def _lie(p: OptimizationPass, changes: ModelChanges) -> str | None:
    """What the pass changed against its own declaration or what a prepared model keeps
    whatever the pass declared (the training flags, the class and state_dict keys), or
    None."""
    declared = process.declared_names(p.settings)
    problems = [f"changed the process-wide setting {name} ({before!r} -> {after!r}) without "
                "declaring it in OptimizationPass.settings"
                for name, (_, before, after) in changes.settings.items()
                if name not in declared]
    if not p.mutates and changes.mutated:
        problems.append("declared mutates=False but changed " + ModelChanges(
            tensors=changes.tensors, structure=changes.structure).describe())
    if changes.training:
        # The checks on the sample input run in eval mode: dropout switched on passes them.
        problems.append("changed " + ModelChanges(training=changes.training).describe() +
                        " (prepare_model hands the model back in the mode it was given)")
    if changes.unlike:
        problems.append("; ".join(changes.unlike) + " (a prepared model keeps the class and "
                        "the state_dict keys of the model given)")
    return "; ".join(problems) or None


def _check_changed(changes: ModelChanges) -> str | None:
    """What a check changed, or None. Plain attributes are left out, as they are for
    apply: running the model may change them (a call counter)."""
    looked = dataclasses.replace(changes, attributes=[])
    return f"its check changed {looked.describe()}" if looked else None


def _state_changed(before: dict[str, Any], after: dict[str, Any]) -> bool:
    try:
        return bool(before != after)
    except Exception:  # values that do not compare (tensors): count as changed
        return True


@dataclass
class _Applied:
    """A pass that was applied: the model as it was before it, and what it changed."""

    plugin: str
    p: OptimizationPass
    before: ModelSnapshot
    changes: ModelChanges
    record: int  # its index in result.passes
    output_check: OutputCheck | None  # the run's output check before this pass
    effective: bool = True


class Run:
    """One prepare_model run: the passes applied so far, each with the snapshot of the model
    before it, so that any of them, or all, can be undone in reverse order."""

    def __init__(self, work: nn.Module, ctx: PassContext, result: OptimizationResult,
                 call: Callable[[nn.Module], Any] | None, tolerance: float, strict: bool
                 ) -> None:
        self.work, self.ctx, self.result = work, ctx, result
        self.call, self.tolerance, self.strict = call, tolerance, strict
        self.applied: list[_Applied] = []
        # The check of outputs against O0: the level's tolerance, or the output_check of
        # the last applied pass that brought one (quantization's accuracy gate).
        self.output_check: OutputCheck | None = None
        self.scoping: ModelSnapshot | None = None  # before the scoped-settings forward
        self.reference: Any = None
        self.have_reference = False
        # The snapshot to share saved tensors with, and the tensors unchanged since it.
        self.last: ModelSnapshot | None = None
        self.unchanged: set[int] = set()
        # Settings a pass changed that stayed changed when the pass was rolled back or
        # undone (glibc's malloc thresholds have no way back): the report lists them.
        self.stayed: dict[str, process.SettingChange] = {}
        # For each: the record index (the sequence passes ran in) of the first and the
        # last pass it is recorded for: the first gives its value before, the last its
        # value now and the pass named.
        self._stayed_span: dict[str, tuple[int, int]] = {}

    # -- the passes ------------------------------------------------------------------------
    def run(self, plugin: str, p: OptimizationPass) -> None:
        if self.call is not None and not self.have_reference and p.order > 0:
            # O0's output: the model as given, placed on the device.
            try:
                started = time.perf_counter()
                self.reference = run_sample(self.work, self.call)
                self.result.stage_seconds["reference"] = time.perf_counter() - started
            except Exception as exc:
                raise ModelOptimizationError(
                    f"the model raised on the sample input before any pass ran: "
                    f"{type(exc).__name__}: {exc}") from exc
            self.have_reference = True
        result, ctx = self.result, self.ctx
        started = time.perf_counter()
        reason = ruled_out(p, plugin, ctx)
        if reason is not None:
            self._skipped(plugin, p, reason, started)
            return
        # The snapshot comes before the pass's check: a check that changes the model (a
        # probe that leaves a weight scaled) is this pass's failure and is undone, instead
        # of shipping, or of being found by a later pass's comparison (its snapshot reuses
        # the copies saved before the check for the tensors found unchanged) and blamed
        # on that pass.
        before = ModelSnapshot(self.work, watched(p.settings), self.last, self.unchanged)
        saved_state, saved_notes = _copy_state(ctx.state), len(ctx.notes)
        try:
            reason = check_reason(p, self.work, ctx)
            if reason is None:
                assert p.apply is not None
                out = p.apply(self.work, ctx)
                if not isinstance(out, nn.Module):
                    raise TypeError(f"apply returned {type(out).__name__}, expected the "
                                    "nn.Module it was given or its replacement")
            else:
                out = self.work
            # One comparison a pass: where the check lets the pass run, the comparison
            # after apply covers what check and apply changed, both the pass's.
            changes = before.changes(out)
            if reason is not None:
                looked = _check_changed(changes)
                if looked is not None:
                    raise _CheckChanged(looked)
            else:
                lie = _lie(p, changes)
                if lie is not None:
                    raise _Lied(lie)
                # A pass with an `effect` check is taken at that check's word, at the end:
                # its effect may live outside what the snapshot sees (a device runtime).
                if p.effect is None and not changes and \
                        not _state_changed(saved_state, ctx.state):
                    raise PassSkipped("apply changed nothing: not the model, not a "
                                      "process-wide setting, not the run's state")
                check = p.output_check or self.output_check
                if self.have_reference and (changes.model or changes.settings):
                    _verify(out, self.call, self.reference,  # type: ignore[arg-type]
                            self.tolerance, check)
        except BaseException as exc:
            ctx.state.clear()
            ctx.state.update(saved_state)
            del ctx.notes[saved_notes:]
            try:
                before.restore()  # the model as it was, also the caller's own (inplace)
            except SnapshotRestoreError as restore_error:
                raise ModelOptimizationError(
                    f"pass {p.name!r} (plugin {plugin}) failed ({type(exc).__name__}: "
                    f"{exc}) and {restore_error}") from exc
            self._note_stayed(plugin, p, before.settings, len(result.passes))
            self.last, self.unchanged = before, {id(r.tensor) for r in before.tensors}
            if is_fatal(exc):
                raise
            self._failed(plugin, p, exc, time.perf_counter() - started)
            return
        self.last, self.unchanged = before, changes.unchanged
        if reason is not None:
            self._skipped(plugin, p, reason, started)
            return
        self.work = out
        self.applied.append(_Applied(plugin, p, before, changes, len(result.passes),
                                     self.output_check))
        self.output_check = check
        seconds = time.perf_counter() - started
        result.passes.append(PassRecord(p.name, "applied", p.description, plugin, seconds))
        logger.info("pass %s (plugin %s) applied in %.2f s", p.name, plugin, seconds)

    def _skipped(self, plugin: str, p: OptimizationPass, reason: str, started: float
                 ) -> None:
        self.result.passes.append(PassRecord(p.name, "skipped", reason, plugin,
                                             time.perf_counter() - started))
        logger.info("pass %s (plugin %s) skipped: %s", p.name, plugin, reason)

    def _failed(self, plugin: str, p: OptimizationPass, exc: BaseException,
                seconds: float = 0.0) -> None:
        if isinstance(exc, PassSkipped):
            self.result.passes.append(PassRecord(p.name, "skipped", str(exc), plugin,
                                                 seconds))
            return
        if isinstance(exc, _Lied):
            said = f"{exc}; a check only looks" if isinstance(exc, _CheckChanged) \
                else f"the pass {exc}"
            error = f"rolled back: {said}"
            record = get_plugin_host().records.get(plugin)
            if record is not None:
                record.warn(f"pass {p.name!r}: {exc}" if isinstance(exc, _CheckChanged)
                            else f"pass {p.name!r} {exc}")
        elif isinstance(exc, _Unverified):
            error = str(exc)
        else:
            error = f"{type(exc).__name__}: {exc}"
        logger.warning("pass %s (plugin %s) failed and was rolled back: %s", p.name,
                       plugin, error)
        self.result.passes.append(PassRecord(p.name, "failed", error, plugin, seconds))
        if self.strict:
            if isinstance(exc, TorchBridgeError):
                raise exc  # already names the problem (a plugin's own error class)
            raise ModelOptimizationError(f"pass {p.name!r} (plugin {plugin}) failed: "
                                         f"{error}") from exc

    # -- when every pass has run -----------------------------------------------------------
    def check_effects(self) -> None:
        """Each applied pass with an `effect` shows it on the prepared model; one that does
        not is reported skipped, and the settings it changed are put back."""
        for entry in self.applied:
            if entry.p.effect is None or not entry.effective:
                continue
            try:
                missing = entry.p.effect(self.work, self.ctx)
            except Exception as exc:
                missing = f"its effect check raised {type(exc).__name__}: {exc}"
            if missing is None:
                continue
            entry.effective = False
            self.result.passes[entry.record] = PassRecord(
                entry.p.name, "skipped", f"no effect: {missing}", entry.plugin)
            handed = {name for name, (_, before, after) in entry.changes.settings.items()
                      if self._hand_over(entry, name, before, after)}
            for name, (setting, before, after) in entry.changes.settings.items():
                if name not in handed and not process.differs(process.read(setting), after):
                    process.put(setting, before)
            self._note_stayed(entry.plugin, entry.p, {
                name: (setting, before)
                for name, (setting, before, _) in entry.changes.settings.items()
                if name not in handed}, entry.record)
            if entry.changes.model:
                self.result.notes.append(f"{entry.p.name}: its changes to the model stay "
                                         f"({entry.changes.describe()})")
        self._find_compile_dependents()

    def _find_compile_dependents(self) -> None:
        """The applied passes whose effect lives in the compiled forward (compile options
        such as inductor freezing): their effect checks, asked as if the compiled forward
        had failed. Should it fail at a later call, the report lists them failed with
        compile (OptimizationResult.compile_dependents)."""
        state = compile_state(self.work)
        if state is None or state.error is not None:
            self.result.compile_dependents = []
            return
        state.error = _CompileFailedProbe("what if the compiled forward failed")
        try:
            self.result.compile_dependents = [
                entry.p.name for entry in self.applied
                if entry.effective and entry.p.effect is not None
                and entry.p.name != COMPILE_PASS and _effect_missing(entry, self) is not None]
        finally:
            state.error = None

    def _hand_over(self, entry: _Applied, name: str, before: Any, after: Any) -> bool:
        """A pass found without effect is as if it had not run. The later applied passes
        that saved its value `after` of the setting `name` as theirs before would put it
        back when undone: they put back `before` now, up to the first that moved the
        setting on, its owner (a setting of scope "call" had leaked out of its scope
        around calls, as the no-effect pass's value, process-wide). True where the owner
        took over the setting, its recorded change now starting from `before`; False
        where no later applied pass moved it on from `after` (the caller puts it back)."""
        later = [other for other in self.applied if other.record > entry.record]
        owner = next((other for other in later if name in other.changes.settings), None)
        for other in later if owner is None else later[:later.index(owner) + 1]:
            saved = other.before.settings.get(name)
            if saved is not None and not process.differs(saved[1], after):
                other.before.settings[name] = (saved[0], before)
        if owner is None:
            return False
        setting, moved_from, now = owner.changes.settings[name]
        if process.differs(moved_from, after):  # moved by something else in between
            return False
        owner.changes.settings[name] = (setting, before, now)
        return True

    def settle_settings(self) -> None:
        """The process-wide settings the applied passes changed, in the report; those torch
        reads at call time put back and set around each call of the prepared model."""
        # Each change with the span of passes it covers: the earliest gives the value
        # before, the latest the value now and the pass named.
        found: list[tuple[tuple[int, int], process.SettingChange]] = []
        for name, change in self.stayed.items():  # their value now: a later pass may move it
            assert change.setting is not None
            found.append((self._stayed_span[name],
                          dataclasses.replace(change, after=process.read(change.setting))))
        for entry in self.applied:
            if not entry.effective:
                continue
            # A setting that moved because a declared one did (fp32_precision with
            # allow_tf32) follows it: reported and scoped through the declared one.
            covered = process.declared_names(entry.p.settings) - {
                s.name for s in entry.p.settings}
            found += [((entry.record, entry.record), process.SettingChange(
                name, before, after, setting.scope, entry.p.name, entry.plugin,
                setting.why_process, setting))
                for name, (setting, before, after) in entry.changes.settings.items()
                if name not in covered]
        changes: dict[str, process.SettingChange] = {}
        spans: dict[str, tuple[int, int]] = {}
        for (first, last), change in found:
            name = change.name
            if name not in changes:
                changes[name], spans[name] = change, (first, last)
                continue
            (first0, last0), now = spans[name], changes[name]
            changes[name] = dataclasses.replace(change if last > last0 else now,
                                                before=(change if first < first0 else now).before)
            spans[name] = (min(first, first0), max(last, last0))
        kept = [c for c in changes.values() if process.differs(c.before, c.after)]
        self.result.process_settings = kept
        scoped = [c for c in kept if c.scope == "call"]
        for change in scoped:
            assert change.setting is not None
            process.put(change.setting, change.before)
        if scoped:
            self.scoping = ModelSnapshot(self.work, tensors=False)
            process.scope_to_calls(self.work, scoped)

    def final_check(self) -> None:
        """The prepared model against O0 on the sample input, once more, as returned. Outside
        the level's tolerance, passes are undone from the last until it holds (strict:
        the run fails)."""
        if self.call is None:
            return
        if not self.have_reference:  # no pass after placement: the model is O0's
            self.reference = run_sample(self.work, self.call)
            self.have_reference = True
        while True:
            try:
                max_abs, max_rel = _verify(self.work, self.call, self.reference,
                                           self.tolerance, self.output_check)
                self.result.max_abs_diff, self.result.max_rel_diff = max_abs, max_rel
                return
            except _Uncheckable as exc:
                if not any(entry.p.order > 0 for entry in self.applied):
                    # The model as given (placed): nothing it could drift from.
                    self.result.max_abs_diff = self.result.max_rel_diff = None
                    self.result.notes.append(f"outputs not checked: {exc}")
                    return
                problem = str(exc)
            except Exception as exc:
                problem = str(exc) if isinstance(exc, _Unverified) else \
                    f"{type(exc).__name__}: {exc}"
            why = f"the prepared model, checked once more at the end, is no drop-in for " \
                  f"O0 on the sample input: {problem}"
            if self.strict or not self.applied:
                raise ModelOptimizationError(why)
            entry = self.undo_last()
            self.result.passes[entry.record] = PassRecord(
                entry.p.name, "failed", f"undone after the run: {why}", entry.plugin)
            self.result.notes.append(f"{why}; undid {entry.p.name} (plugin {entry.plugin}) "
                                     "and checked again")
            self.settle_settings()

    # -- undoing ---------------------------------------------------------------------------
    def _unscope(self) -> None:
        if self.scoping is not None:
            self.scoping.restore()
            self.scoping = None

    def _note_stayed(self, plugin: str, p: OptimizationPass,
                     saved: dict[str, tuple[process.ProcessSetting, Any]], record: int,
                     kept: str | None = None) -> None:
        """After `p` (its record index: when it ran) was rolled back or undone: of the
        settings `saved` holds with their values before it, those not back to them (their
        setter left them as they were, or, undone after timing, they are
        kept_after_timing: `kept` says why)."""
        for name, (setting, value) in saved.items():
            now = process.read(setting)
            why = _stays_why(setting, kept)
            change = self.stayed.get(name)
            if change is None:
                if process.differs(value, now):
                    self._stayed_span[name] = (record, record)
                    self.stayed[name] = process.SettingChange(
                        name, value, now, "process", p.name, plugin, why, setting)
                    logger.info("pass %s (plugin %s) undone; %s stays %r", p.name, plugin,
                                name, now)
                continue
            first, last = self._stayed_span[name]
            if record < first:  # undoing from the last: its value before is the earlier
                change, first = dataclasses.replace(change, before=value), record
            elif record > last and process.differs(value, now):  # it left the value now
                change = process.SettingChange(name, change.before, now, "process", p.name,
                                               plugin, why, setting)
                last = record
            if process.differs(change.before, now):
                self.stayed[name], self._stayed_span[name] = change, (first, last)
            else:
                del self.stayed[name]

    def stayed_settings(self) -> str | None:
        """The settings that stay changed after undoing (their value now), or None."""
        now = {name: process.read(c.setting) for name, c in self.stayed.items()
               if c.setting is not None}
        stayed = [f"{name} stays {value!r} ({self.stayed[name].why_process})"
                  for name, value in now.items()
                  if process.differs(self.stayed[name].before, value)]
        return "; ".join(stayed) or None

    def undo_last(self, after_timing: str | None = None) -> _Applied:
        """The last applied pass undone. `after_timing`, a reason: the timing undid it, and
        its settings declared kept_after_timing stay, the report giving that reason."""
        self._unscope()
        entry = self.applied.pop()
        entry.before.restore(after_timing=after_timing is not None)
        self._note_stayed(entry.plugin, entry.p, entry.before.settings, entry.record,
                          after_timing)
        self.work = entry.before.model
        self.output_check = entry.output_check
        return entry

    def undo_all(self) -> str | None:
        """Every applied pass undone, in reverse order, and the settings the timing left
        for the model it kept put back (the run failed: no model is kept); what could not
        be, if anything."""
        problems = []
        try:
            self._unscope()
        except SnapshotRestoreError as exc:
            problems.append(str(exc))
        while self.applied:
            entry = self.applied.pop()
            try:
                entry.before.restore()
            except SnapshotRestoreError as exc:
                problems.append(f"after pass {entry.p.name} (plugin {entry.plugin}): {exc}")
            # Also after a restore that failed (it puts back all it can): a setting with no
            # way back stays in the report.
            self._note_stayed(entry.plugin, entry.p, entry.before.settings, entry.record)
            self.work = entry.before.model
            self.output_check = entry.output_check
        for name, change in list(self.stayed.items()):
            setting = change.setting
            if setting is None or not setting.stays_after_timing:
                continue
            try:
                process.put(setting, change.before)
            except Exception as exc:
                problems.append(f"{name}: {exc}")
            if not process.differs(change.before, process.read(setting)):
                del self.stayed[name]
            else:  # its setter left it (a threshold glibc has no way back for)
                self.stayed[name] = dataclasses.replace(change,
                                                        why_process=_stays_why(setting))
        return "; ".join(problems) or None


def _stays_why(setting: process.ProcessSetting, kept: str | None = None) -> str:
    """Why a setting stays after its pass was undone: `kept`, the reason it was left on
    purpose (the timing kept a model timed under it), where it stays_after_timing."""
    why = setting.why_process or "it could not be put back"
    return f"{why}; the pass was undone, the setting stays" + (
        f" ({kept})" if kept and setting.stays_after_timing else "")


def _copy_state(state: dict[str, Any]) -> dict[str, Any]:
    """ctx.state as it was before a pass: values one level deep (compile options)."""
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in state.items()}
