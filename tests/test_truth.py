"""prepare_model's word matches what happened: rollback that trusts no declaration, the
end-to-end check against O0, failure paths that leave an inplace caller's model as it was,
and process-wide settings that are declared, reported and scoped."""

from __future__ import annotations

import copy
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torchbridge
from torch import nn
from torchbridge import OptimizationLevel, OptimizationPass
from torchbridge.optimize.settings import TF32_MATMUL

LYING = "tb_misbehaving.passes_lying"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_as_given(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    """Bit for bit as it was: values, dtypes, no instance forward left behind."""
    now = model.state_dict()
    assert list(now) == list(before)
    for key, value in before.items():
        assert now[key].dtype == value.dtype, key
        assert torch.equal(now[key], value), key
    assert "forward" not in model.__dict__


@pytest.fixture
def lying(monkeypatch: pytest.MonkeyPatch, reload_plugins: None) -> Iterator[Any]:
    """The installed lying plugin (tests/misbehaving_plugins), its own gate opened."""
    pytest.importorskip("tb_misbehaving", reason="pip install tests/misbehaving_plugins")

    def behave(how: str) -> None:
        monkeypatch.setenv("TB_LYING_PASSES", how)
        sys.modules.pop(LYING, None)
        importlib.invalidate_caches()
        torchbridge.reload_plugins()

    yield behave
    sys.modules.pop(LYING, None)


def _lying_record(result: torchbridge.OptimizationResult) -> Any:
    return next(p for p in result.passes if p.name == "mb_lying")


@pytest.mark.parametrize("how", ["weights_then_raise", "weights", "structure"])
def test_a_pass_that_lies_about_mutates_is_rolled_back_and_named(lying: Any, how: str
                                                                 ) -> None:
    lying(how)
    model, x = mlp(), torch.randn(4, 16)
    expected = model(x)
    before = state(model)
    for inplace in (False, True):
        result = torchbridge.get_backend("cpu").optimize(model, "O1", sample_input=x,
                                                         inplace=inplace)
        record = _lying_record(result)
        assert record.status == "failed" and record.plugin == "mb_passes_lying"
        if how != "weights_then_raise":
            assert "declared mutates=False but changed" in record.detail
        # Within tolerance of O0 (O1: exact) on the sample input, and the caller's model
        # untouched when it was a copy, put back when it was prepared in place.
        assert torch.equal(result.model(x), expected)
        assert result.max_abs_diff == 0.0
        assert_as_given(model, before)
        assert [type(m) for m in result.model] == [nn.Linear, nn.ReLU, nn.Linear]
    record_warnings = torchbridge.plugins.get_plugin_host().records["mb_passes_lying"].warnings
    if how != "weights_then_raise":
        assert any("mb_lying" in w for w in record_warnings)


def test_a_lying_pass_fails_strict_mode_naming_its_plugin(lying: Any) -> None:
    lying("weights")
    model = mlp()
    before = state(model)
    with pytest.raises(torchbridge.ModelOptimizationError,
                       match=r"pass 'mb_lying' \(plugin mb_passes_lying\)"):
        torchbridge.get_backend("cpu").optimize(model, "O1", inplace=True, strict=True)
    assert_as_given(model, before)


def test_an_undeclared_process_setting_is_caught_and_put_back(lying: Any) -> None:
    lying("setting")
    saved = torch.backends.cuda.matmul.allow_tf32
    result = torchbridge.get_backend("cpu").optimize(mlp(), "O1")
    record = _lying_record(result)
    assert record.status == "failed"
    assert "torch.backends.cuda.matmul.allow_tf32" in record.detail
    assert "without declaring it" in record.detail
    assert torch.backends.cuda.matmul.allow_tf32 is saved


class _Drifting:
    """A pass whose forward is right on its first call and 100 off afterwards: it passes
    its own check; only the check at the end of the run sees it."""

    @torchbridge.hookimpl
    def torchbridge_optimization_passes(self, backend: object, level: object
                                        ) -> list[OptimizationPass]:
        def drift(model: nn.Module, ctx: object) -> nn.Module:
            inner, calls = model.forward, [0]

            def forward(x: torch.Tensor) -> torch.Tensor:
                calls[0] += 1
                return inner(x) + (100.0 if calls[0] > 1 else 0.0)
            model.forward = forward  # type: ignore[method-assign]
            return model

        return [OptimizationPass("drifts_later", "fine once", OptimizationLevel.O1, drift,
                                 order=45, mutates=False)]


def test_the_model_returned_is_checked_once_more_against_o0(reload_plugins: None) -> None:
    torchbridge.register_plugin(_Drifting(), name="drifting")
    model, x = mlp(), torch.randn(4, 16)
    expected = model(x)
    before = state(model)
    result = torchbridge.get_backend("cpu").optimize(model, "O1", sample_input=x,
                                                     inplace=True)
    record = next(p for p in result.passes if p.name == "drifts_later")
    assert record.status == "failed" and "undone after the run" in record.detail
    assert any("checked once more at the end" in n for n in result.notes)
    assert torch.equal(result.model(x), expected) and result.max_abs_diff == 0.0
    with pytest.raises(torchbridge.ModelOptimizationError, match="checked once more"):
        torchbridge.get_backend("cpu").optimize(model, "O1", sample_input=x, inplace=True,
                                                strict=True)
    assert_as_given(model, before)


_TIMING = {"on": False}


class _RaisesWhenTimed(nn.Module):
    """Runs in prepare_model's checks; raises in its timing runs (the timer below marks
    them)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _TIMING["on"]:
            raise RuntimeError("timing run failed")
        out: torch.Tensor = self.body(x)
        return out


def _timing_runs(label: str, fn: Callable[[], Any]) -> float:
    _TIMING["on"] = True
    try:
        fn()
    finally:
        _TIMING["on"] = False
    return 1.0


def test_a_model_failing_its_timing_runs_is_put_back_inplace() -> None:
    from torchbridge.optimize.pipeline import run_pipeline

    model, x = _RaisesWhenTimed().eval(), torch.randn(4, 16)
    before = state(model)
    with pytest.raises(torchbridge.ModelOptimizationError, match="timing run failed") as info:
        run_pipeline(torchbridge.get_backend("cpu"), model, "O3", sample_input=x,
                     measure=True, inplace=True, timer=_timing_runs)
    assert "put back as they were" in str(info.value)
    assert_as_given(model, before)  # float32 weights, no autocast forward


class _LateFailure:
    @torchbridge.hookimpl
    def torchbridge_optimization_passes(self, backend: object, level: object
                                        ) -> list[OptimizationPass]:
        def fail(model: nn.Module, ctx: object) -> nn.Module:
            raise RuntimeError("late pass failed")

        return [OptimizationPass("fails_late", "after everything", OptimizationLevel.O3,
                                 fail, order=95, mutates=False)]


def test_strict_failure_of_a_late_pass_puts_the_inplace_model_back(reload_plugins: None
                                                                  ) -> None:
    torchbridge.register_plugin(_LateFailure(), name="late_failure")
    model = mlp()
    before = state(model)
    with pytest.raises(torchbridge.ModelOptimizationError, match="fails_late"):
        torchbridge.get_backend("cpu").optimize(model, "O3", inplace=True, strict=True)
    assert_as_given(model, before)


class _DeclaresTF32:
    """A pass that declares the process-wide setting it changes."""

    @torchbridge.hookimpl
    def torchbridge_optimization_passes(self, backend: object, level: object
                                        ) -> list[OptimizationPass]:
        def tf32(model: nn.Module, ctx: object) -> nn.Module:
            torch.backends.cuda.matmul.allow_tf32 = True
            return model

        return [OptimizationPass("declared_tf32", "TF32", OptimizationLevel.O1, tf32,
                                 order=35, mutates=False, settings=(TF32_MATMUL,))]


@pytest.fixture
def tf32_off() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def test_declared_settings_are_reported_and_scoped_to_the_models_calls(
        reload_plugins: None, tf32_off: None) -> None:
    torchbridge.register_plugin(_DeclaresTF32(), name="declares_tf32")
    model, x = mlp(), torch.randn(4, 16)
    result = torchbridge.get_backend("cpu").optimize(model, "O1", sample_input=x)
    assert next(p for p in result.passes if p.name == "declared_tf32").status == "applied"
    [change] = result.process_settings
    assert (change.name, change.before, change.after, change.scope, change.pass_name) == (
        "torch.backends.cuda.matmul.allow_tf32", False, True, "call", "declared_tf32")
    assert "setting: torch.backends.cuda.matmul.allow_tf32: False -> True, around each " \
           "call" in result.summary()
    assert result.to_dict()["process_settings"][0]["after"] == "True"
    assert torch.backends.cuda.matmul.allow_tf32 is False  # the process keeps its own

    seen: list[bool] = []
    hook = lambda *_: seen.append(torch.backends.cuda.matmul.allow_tf32)  # noqa: E731
    result.model[0].register_forward_pre_hook(hook)
    result.model(x)
    twin = copy.deepcopy(result.model)  # a copy runs with the same settings
    twin(x)
    assert seen == [True, True] and torch.backends.cuda.matmul.allow_tf32 is False


def test_a_prepared_model_compiled_by_the_user_keeps_its_scoped_settings(
        reload_plugins: None, tf32_off: None) -> None:
    """torch.compile of a prepared model whose settings are scoped to its calls (TF32 and
    cuDNN benchmark on NVIDIA): dynamo breaks the graph at the wrapper that sets them, so
    the model's layers run with them in force, and the process keeps its own after. With
    fullgraph=True the wrapper cannot be traced, as the guide says (found on an H100; the
    same on a CPU): should that change, the guide must too."""
    torchbridge.register_plugin(_DeclaresTF32(), name="declares_tf32")
    model, x = mlp(), torch.randn(4, 16)
    result = torchbridge.get_backend("cpu").optimize(model, "O1", sample_input=x)
    seen: list[bool] = []
    hook = lambda *_: seen.append(torch.backends.cuda.matmul.allow_tf32)  # noqa: E731
    result.model[0].register_forward_pre_hook(hook)
    torch._dynamo.reset()
    compiled = torch.compile(result.model, backend="eager")
    torch.testing.assert_close(compiled(x), model(x))
    assert seen and all(seen) and torch.backends.cuda.matmul.allow_tf32 is False
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(result.model, backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()


class _SilentNoop:
    @torchbridge.hookimpl
    def torchbridge_optimization_passes(self, backend: object, level: object
                                        ) -> list[OptimizationPass]:
        return [OptimizationPass("does_nothing", "claims a speedup", OptimizationLevel.O1,
                                 lambda m, c: m, order=45)]


def test_a_pass_that_changes_nothing_is_not_reported_applied(reload_plugins: None) -> None:
    torchbridge.register_plugin(_SilentNoop(), name="silent_noop")
    result = torchbridge.get_backend("cpu").optimize(mlp(), "O1")
    record = next(p for p in result.passes if p.name == "does_nothing")
    assert record.status == "skipped" and record.detail.startswith("apply changed nothing")


def test_a_pass_whose_effect_is_gone_at_the_end_is_reported_skipped(
        reload_plugins: None) -> None:
    class Counting:
        @torchbridge.hookimpl
        def torchbridge_optimization_passes(self, backend: object, level: object
                                            ) -> list[OptimizationPass]:
            def mark(model: nn.Module, ctx: Any) -> nn.Module:
                ctx.state["marked"] = True
                return model

            return [OptimizationPass(
                "needs_a_later_pass", "works only if another pass follows",
                OptimizationLevel.O1, mark, order=45, mutates=False,
                effect=lambda m, ctx: "no later pass used the mark")]

    torchbridge.register_plugin(Counting(), name="counting")
    result = torchbridge.get_backend("cpu").optimize(mlp(), "O1")
    record = next(p for p in result.passes if p.name == "needs_a_later_pass")
    assert (record.status, record.detail) == ("skipped",
                                               "no effect: no later pass used the mark")


def test_restore_process_settings_puts_back_what_a_run_left_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.optimize.report import OptimizationResult
    from torchbridge.optimize.settings import SettingChange, environment_setting

    monkeypatch.delenv("TB_TEST_SETTING", raising=False)
    setting = environment_setting("TB_TEST_SETTING", "read once per process")
    monkeypatch.setenv("TB_TEST_SETTING", "1")
    result = OptimizationResult(model=mlp(), backend="cpu", level=OptimizationLevel.O2)
    result.process_settings = [SettingChange(setting.name, None, "1", "process", "p", None,
                                             setting.why_process, setting)]
    assert result.restore_process_settings() == []
    import os
    assert "TB_TEST_SETTING" not in os.environ


def test_lazy_and_stateful_models_are_no_liars() -> None:
    """Running the model inside a pass (a measuring pass) materializes lazy parameters and
    moves a call counter: neither is a pass changing what it declared."""
    lazy = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, 4)).eval()

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.calls = nn.Linear(64, 64), 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            out: torch.Tensor = self.body(x)
            return out

    for model, x in ((lazy, torch.randn(4, 8)), (Counting().eval(), torch.randn(4, 64))):
        result = torchbridge.get_backend("cpu").optimize(model, "O2", sample_input=x,
                                                         strict=True)
        assert not result.failed, result.summary()
        assert "autocast" in result.optimizations_applied


def test_hook_handles_the_caller_holds_keep_working() -> None:
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 4, 3)).eval()
    fired: list[int] = []
    handle = model.register_forward_hook(lambda *_: fired.append(1))
    torchbridge.get_backend("cpu").optimize(model, "O1", sample_input=torch.randn(1, 3, 8, 8),
                                            inplace=True)
    handle.remove()
    fired.clear()
    model(torch.randn(1, 3, 8, 8))
    assert fired == []


class _SetsPrecision:
    @torchbridge.hookimpl
    def torchbridge_optimization_passes(self, backend: object, level: object
                                        ) -> list[OptimizationPass]:
        def medium(model: nn.Module, ctx: object) -> nn.Module:
            torch.set_float32_matmul_precision("medium")
            return model

        return [OptimizationPass("sets_precision", "undeclared", OptimizationLevel.O1,
                                 medium, order=45, mutates=False)]


def test_the_float32_precision_api_is_watched_too(reload_plugins: None) -> None:
    torchbridge.register_plugin(_SetsPrecision(), name="sets_precision")
    before = torch.get_float32_matmul_precision()
    result = torchbridge.get_backend("cpu").optimize(mlp(), "O1")
    record = next(p for p in result.passes if p.name == "sets_precision")
    assert record.status == "failed" and "without declaring it" in record.detail
    assert torch.get_float32_matmul_precision() == before  # readable: the APIs not mixed


class _Sticky:
    """A process-wide setting that takes a new value but cannot go back (as glibc's malloc
    thresholds): put back, it stays."""

    def __init__(self, kept_after_timing: bool = False) -> None:
        self.value = "default"
        self.kept_after_timing = kept_after_timing

    def write(self, value: Any) -> None:
        if value != "default":
            self.value = value

    def setting(self) -> Any:
        from torchbridge.optimize.settings import ProcessSetting

        return ProcessSetting("sticky knob", lambda: self.value, self.write, scope="process",
                              why_process="it has no way back",
                              kept_after_timing=self.kept_after_timing)


def _sticky_pass(knob: _Sticky, fail: bool) -> Any:
    class Plugin:
        @torchbridge.hookimpl
        def torchbridge_optimization_passes(self, backend: object, level: object
                                            ) -> list[OptimizationPass]:
            def turn(model: nn.Module, ctx: Any) -> nn.Module:
                knob.write("turned")
                if fail:
                    raise RuntimeError("gave up after turning the knob")
                return model

            return [OptimizationPass("turns_knob", "turns a knob", OptimizationLevel.O1,
                                     turn, order=45, mutates=False,
                                     settings=(knob.setting(),))]
    return Plugin()


@pytest.mark.parametrize("undone_by", ["failure", "final check"])
def test_a_setting_that_stays_after_its_pass_is_undone_is_reported(
        undone_by: str, reload_plugins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    knob = _Sticky()
    torchbridge.register_plugin(_sticky_pass(knob, fail=undone_by == "failure"),
                                name="sticky")
    if undone_by == "final check":  # the end-to-end check finds the model off, once
        from torchbridge.optimize import run as run_module

        verify, calls = run_module._verify, []

        def off_once(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:  # the first is the pass's own check
                raise run_module._Unverified("off")
            return verify(*args, **kwargs)
        monkeypatch.setattr(run_module, "_verify", off_once)
    result = torchbridge.get_backend("cpu").optimize(mlp(), "O1", sample_input=torch.randn(
        4, 16))
    assert next(p for p in result.passes if p.name == "turns_knob").status == "failed"
    [change] = [c for c in result.process_settings if c.name == "sticky knob"]
    assert (change.before, change.after, change.scope, change.pass_name) == (
        "default", "turned", "process", "turns_knob")
    assert "the pass was undone, the setting stays" in change.why_process
    assert "setting: sticky knob: 'default' -> 'turned', process-wide" in result.summary()
    assert result.restore_process_settings() == ["sticky knob: still 'turned' (it has no "
                                                 "way back; the pass was undone, the "
                                                 "setting stays)"]


def test_a_setting_with_no_way_back_undone_by_the_timing_is_not_said_to_be_kept(
        reload_plugins: None) -> None:
    """Only a setting declared kept_after_timing stays because the kept model was timed
    under it; one without a way back stays for that reason alone, and the report says
    so."""
    from torchbridge.optimize.pipeline import run_pipeline

    knob = _Sticky()
    torchbridge.register_plugin(_sticky_pass(knob, fail=False), name="sticky")

    def o0_fastest(label: str, fn: Callable[[], Any]) -> float:
        fn()
        return 1.0 if label == "O0" else 2.0

    result = run_pipeline(torchbridge.get_backend("cpu"), mlp(), "O2",
                          sample_input=torch.randn(4, 16), timer=o0_fastest)
    record = next(p for p in result.passes if p.name == "turns_knob")
    assert record.status == "skipped" and record.detail.startswith("undone after timing")
    [change] = [c for c in result.process_settings if c.name == "sticky knob"]
    assert change.why_process == "it has no way back; the pass was undone, the setting stays"


def test_a_failed_run_names_the_settings_that_stay(reload_plugins: None) -> None:
    from torchbridge.errors import ModelOptimizationError
    from torchbridge.optimize.pipeline import run_pipeline

    knob = _Sticky()
    torchbridge.register_plugin(_sticky_pass(knob, fail=False), name="sticky")

    def broken_timer(label: str, fn: Callable[[], Any]) -> float:
        raise RuntimeError("the timer broke")

    with pytest.raises(ModelOptimizationError) as caught:
        run_pipeline(torchbridge.get_backend("cpu"), mlp(), "O2",
                     sample_input=torch.randn(4, 16), timer=broken_timer)
    assert knob.value == "turned"
    assert "the model was put back as it was, and the process-wide settings too, except: " \
           "sticky knob stays 'turned' (it has no way back; the pass was undone, the " \
           "setting stays)" in str(caught.value)


def _knob_passes(knob: _Sticky, steps: dict[str, tuple[int, str, bool]]) -> Any:
    """Passes named by `steps`: (order, the value each sets the knob to, whether it then
    raises)."""
    def step(value: str, fail: bool) -> Any:
        def apply(model: nn.Module, ctx: Any) -> nn.Module:
            knob.value = value  # directly: a pass may set it back where write() cannot
            if fail:
                raise RuntimeError("gave up after turning the knob")
            return model
        return apply

    class Plugin:
        @torchbridge.hookimpl
        def torchbridge_optimization_passes(self, backend: object, level: object
                                            ) -> list[OptimizationPass]:
            return [OptimizationPass(name, "turns a knob", OptimizationLevel.O2,
                                     step(value, fail), order=order, mutates=False,
                                     settings=(knob.setting(),))
                    for name, (order, value, fail) in steps.items()]
    return Plugin()


def _o0_fastest(label: str, fn: Callable[[], Any]) -> float:
    fn()
    return 1.0 if label == "O0" else 2.0


def test_a_later_pass_setting_back_what_a_failed_one_left_leaves_nothing_to_report(
        reload_plugins: None) -> None:
    from torchbridge.optimize.pipeline import run_pipeline

    knob = _Sticky()
    torchbridge.register_plugin(_knob_passes(knob, {"leaves": (45, "turned", True),
                                                    "resets": (46, "default", False)}),
                                name="sticky")
    result = run_pipeline(torchbridge.get_backend("cpu"), mlp(), "O2",
                          sample_input=torch.randn(4, 16))
    assert knob.value == "default"
    assert not [c for c in result.process_settings if c.name == "sticky knob"]


def test_a_pass_undone_by_the_timing_after_a_failed_one_is_the_one_named(
        reload_plugins: None) -> None:
    """A failed pass left the knob turned; a later pass moved it on and the timing undid
    it, keeping its value (kept_after_timing): the report names the later pass."""
    from torchbridge.optimize.pipeline import run_pipeline

    knob = _Sticky(kept_after_timing=True)
    torchbridge.register_plugin(_knob_passes(knob, {"leaves": (45, "turned", True),
                                                    "moves_on": (95, "further", False)}),
                                name="sticky")
    result = run_pipeline(torchbridge.get_backend("cpu"), mlp(), "O2",
                          sample_input=torch.randn(4, 16), timer=_o0_fastest)
    assert knob.value == "further"
    [change] = [c for c in result.process_settings if c.name == "sticky knob"]
    assert (change.before, change.after, change.pass_name) == ("default", "further",
                                                               "moves_on")
    assert change.why_process.endswith("(the kept model was timed under it)")


class _Dial:
    """A setting torch would read at each op (scope "call"), with a way back."""

    def __init__(self) -> None:
        self.value = "default"

    def setting(self) -> Any:
        from torchbridge.optimize.settings import ProcessSetting

        def write(value: Any) -> None:
            self.value = value
        return ProcessSetting("call dial", lambda: self.value, write, scope="call")


def _dial_passes(dial: _Dial, seen: list[str], moves: bool = True) -> Any:
    """"sets_dial" turns the dial to "a" and is found without effect at the end;
    "moves_dial", later, watches the dial, turns it to "b" (`moves`) and records what the
    model's call sees."""
    def turn(value: str) -> Any:
        def apply(model: nn.Module, ctx: Any) -> nn.Module:
            dial.value = value
            return model
        return apply

    from torchbridge.optimize.forward import install_forward

    def seeing(inner: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            seen.append(dial.value)
            return inner(*args, **kwargs)
        return forward

    def move(model: nn.Module, ctx: Any) -> nn.Module:
        if moves:
            dial.value = "b"
        install_forward(model, seeing)
        return model

    class Plugin:
        @torchbridge.hookimpl
        def torchbridge_optimization_passes(self, backend: object, level: object
                                            ) -> list[OptimizationPass]:
            return [
                OptimizationPass("sets_dial", "turns a dial", OptimizationLevel.O1,
                                 turn("a"), order=95, mutates=False,
                                 settings=(dial.setting(),),
                                 effect=lambda m, ctx: "nothing used the dial"),
                OptimizationPass("moves_dial", "turns the dial on", OptimizationLevel.O1,
                                 move, order=96, settings=(dial.setting(),))]
    return Plugin()


@pytest.mark.parametrize(("moves", "final_check_undoes"),
                         [(True, False), (True, True), (False, True)])
def test_a_setting_of_a_pass_without_effect_that_a_later_pass_moved(
        moves: bool, final_check_undoes: bool, reload_plugins: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass found without effect at the end is as if it had not run: a setting of scope
    "call" that a later pass moved on is that pass's, scoped around calls, and goes back
    to its value before both when that pass is undone too; a later pass that only watched
    it, undone, puts back the value from before the no-effect pass, not its value."""
    from torchbridge.optimize import run as run_module

    dial, seen = _Dial(), []
    torchbridge.register_plugin(_dial_passes(dial, seen, moves), name="dials")
    if final_check_undoes:  # the end-to-end check finds the model off while moves_dial holds
        verify, final = run_module._verify, run_module.Run.final_check
        checking: list[Any] = []

        def off_at_b(*args: Any, **kwargs: Any) -> Any:
            if checking and any(e.p.name == "moves_dial" for e in checking[0].applied):
                raise run_module._Unverified("off")
            return verify(*args, **kwargs)

        def final_check(self: Any) -> None:
            checking.append(self)
            final(self)
        monkeypatch.setattr(run_module, "_verify", off_at_b)
        monkeypatch.setattr(run_module.Run, "final_check", final_check)
    x = torch.randn(4, 16)
    result = torchbridge.get_backend("cpu").optimize(mlp(), "O1", sample_input=x)
    records = {p.name: p for p in result.passes}
    assert (records["sets_dial"].status, records["sets_dial"].detail) == (
        "skipped", "no effect: nothing used the dial")
    assert dial.value == "default"
    changes = [c for c in result.process_settings if c.name == "call dial"]
    if final_check_undoes:
        assert records["moves_dial"].status == "failed"
        assert changes == []
        return
    [change] = changes
    assert (change.before, change.after, change.scope, change.pass_name) == (
        "default", "b", "call", "moves_dial")
    seen.clear()
    result.model(x)
    assert seen == ["b"] and dial.value == "default"
