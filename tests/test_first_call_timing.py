"""Without a sample input, the first call decides (optimize/first_call.py): O2/O3 time the
prepared model on the first call's own input against O0 and itself uncompiled, and keep the
fastest. Decisions are tested with an injected timer that answers by candidate: no test
here depends on how fast this machine is."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torchbridge
from test_keep_fastest import _mlp, _timer
from torchbridge.config import TorchBridgeConfig
from torchbridge.errors import ModelOptimizationError
from torchbridge.optimize.forward import compile_state
from torchbridge.optimize.pipeline import run_pipeline

O0_FASTEST = {"O0": 1.0, "prepared": 3.0, "uncompiled": 2.0}
UNCOMPILED_FASTEST = {"O0": 3.0, "prepared": 2.0, "uncompiled": 1.0}
PREPARED_FASTEST = {"O0": 3.0, "prepared": 1.0, "uncompiled": 2.0}


@pytest.fixture(scope="module")
def backend() -> Any:
    return torchbridge.get_backend("cpu")


def _status(result: Any) -> dict[str, tuple[str, str]]:
    return {p.name: (p.status, p.detail) for p in result.passes}


def test_nothing_is_timed_before_the_first_call(backend: Any) -> None:
    seen: list[str] = []
    result = run_pipeline(backend, _mlp(), "O3", timer=_timer(O0_FASTEST, seen))
    assert seen == [] and result.speedup is None
    assert "compile" in result.optimizations_applied
    assert any("first call in eval mode times the prepared model" in n
               for n in result.notes), result.notes


def test_o0_is_kept_when_it_times_fastest_on_the_first_call(backend: Any) -> None:
    model, x = _mlp(), torch.randn(4, 32)
    expected = model(x)
    result = run_pipeline(backend, model, "O3", timer=_timer(O0_FASTEST))
    prepared = result.model
    out = prepared(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert "forward" not in prepared.__dict__  # no autocast, compiled or timing forward
    assert all(p.dtype == torch.float32 for p in prepared.parameters())
    report = torchbridge.optimization_result(prepared)
    assert report is result  # still attached after the passes were undone
    status = _status(result)
    for name in ("autocast", "low_precision_weights", "compile"):
        assert status[name][0] == "skipped"
        assert status[name][1].startswith(
            "undone after timing: timed on the first call's input"), status[name]
    assert result.speedup == 1.0 and result.baseline_seconds == 1.0
    assert any("O0 was the fastest" in n for n in result.notes)
    assert "first_call_timing" in result.stage_seconds
    # The caller's model, O0 in the timing, is left as it was.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert "forward" not in model.__dict__


def test_compile_is_undone_when_uncompiled_times_fastest(backend: Any) -> None:
    model, x = _mlp(), torch.randn(4, 32)
    result = run_pipeline(backend, model, "O3", timer=_timer(UNCOMPILED_FASTEST))
    result.model(x)
    status = _status(result)
    assert status["compile"][0] == "skipped" and status["autocast"][0] == "applied"
    assert compile_state(result.model) is None
    assert result.speedup == 3.0


def test_the_prepared_model_is_kept_and_timing_happens_once(backend: Any) -> None:
    seen: list[str] = []
    model, x = _mlp(), torch.randn(4, 32)
    result = run_pipeline(backend, model, "O3", timer=_timer(PREPARED_FASTEST, seen))
    prepared = result.model
    first = prepared(x)
    timed = len(seen)
    # Two rounds of all three; O0 and the uncompiled forward, each over 1.5x the prepared
    # model's in both, sit out the third.
    assert seen[6:] == ["prepared"] and set(seen) == {"O0", "prepared", "uncompiled"}
    assert "compile" in result.optimizations_applied and result.speedup == 3.0
    state = compile_state(prepared)
    assert state is not None and state.error is None
    second = prepared(torch.randn(4, 32))
    assert len(seen) == timed  # the second call is not timed
    assert first.dtype == torch.float32 and second.shape == (4, 8)
    torch.testing.assert_close(first, model(x), rtol=0.05, atol=0.05)


def test_the_first_call_returns_its_own_output_and_changes_its_input_once(
        backend: Any) -> None:
    class AddsInPlace(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.add_(1.0)  # changes its input: replays must work on copies
            return self.linear(x)

    model = AddsInPlace().eval()
    result = run_pipeline(backend, model, "O2", timer=_timer(O0_FASTEST))
    x = torch.zeros(2, 8)
    out = result.model(x)
    assert torch.equal(x, torch.ones(2, 8))  # changed once, by the call itself
    torch.testing.assert_close(out, model.linear(torch.ones(2, 8)), rtol=0, atol=0)
    assert "O0 was the fastest" in " ".join(result.notes)


def test_a_prepared_model_pickles_before_its_first_call(backend: Any) -> None:
    # The timing forward pickles and deep-copies as the forward it wraps (here the class's
    # own: kernel substitution installs none), without the run it holds.
    import io
    import pickle

    config = TorchBridgeConfig(optimization={"disabled_passes": [
        "compile", "autocast", "low_precision_weights"]})
    plain = torchbridge.get_backend("cpu", config=config)
    model, x = _mlp(), torch.randn(4, 32)
    result = run_pipeline(plain, model, "O3", timer=_timer(O0_FASTEST))
    assert type(result.model.__dict__["forward"]).__name__ == "_FirstCallTiming"
    restored = pickle.loads(pickle.dumps(result.model))
    torch.save(result.model, io.BytesIO())
    twin = copy.deepcopy(result.model)
    for other in (restored, twin):
        torch.testing.assert_close(other(x), model(x), rtol=0, atol=0)
    assert result.speedup is None  # neither copy timed the original
    result.model(x)
    assert result.speedup == 1.0 and "forward" not in result.model.__dict__


def test_the_first_call_under_inference_mode(backend: Any) -> None:
    model = _mlp()
    result = run_pipeline(backend, model, "O3", timer=_timer(PREPARED_FASTEST))
    with torch.inference_mode():
        x = torch.randn(4, 32)  # an inference tensor
        out = result.model(x)
    assert result.speedup == 3.0
    torch.testing.assert_close(out, model(x.clone()), rtol=0.05, atol=0.05)


def test_a_first_call_in_training_mode_is_not_timed(backend: Any) -> None:
    seen: list[str] = []
    result = run_pipeline(backend, _mlp(), "O3", timer=_timer(O0_FASTEST, seen))
    result.model.train()
    result.model(torch.randn(4, 32))
    assert seen == [] and "compile" in result.optimizations_applied
    assert any("not timed (the model was in training mode" in n for n in result.notes)


def test_an_input_that_cannot_be_replayed_is_not_timed(backend: Any) -> None:
    class Cache:  # stands for a KV cache: an object a call may change
        def __init__(self) -> None:
            self.steps = 0

    class WithCache(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
            if cache is not None:
                cache.steps += 1
            return self.linear(x)

    seen: list[str] = []
    result = run_pipeline(backend, WithCache().eval(), "O2", timer=_timer(O0_FASTEST, seen))
    cache = Cache()
    result.model(torch.randn(2, 8), cache=cache)
    assert seen == [] and cache.steps == 1
    assert any("its input cannot be replayed: it holds a Cache" in n for n in result.notes)


def test_without_a_copy_of_o0_it_times_against_itself_uncompiled(backend: Any) -> None:
    # inplace=True: the caller's model is the prepared one, and O0 would take a copy.
    seen: list[str] = []
    model, x = _mlp(), torch.randn(4, 32)
    result = run_pipeline(backend, model, "O3", inplace=True,
                          timer=_timer(UNCOMPILED_FASTEST, seen))
    assert result.model is model
    model(x)
    assert set(seen) == {"prepared", "uncompiled"}
    assert _status(result)["compile"][0] == "skipped"
    assert result.speedup is None and result.optimized_seconds == 1.0


def test_the_config_turns_it_off(backend: Any) -> None:
    seen: list[str] = []
    config = TorchBridgeConfig(optimization={"time_first_call": False})
    off = torchbridge.get_backend("cpu", config=config)
    result = run_pipeline(off, _mlp(), "O3", timer=_timer(O0_FASTEST, seen))
    result.model(torch.randn(4, 32))
    assert seen == [] and "compile" in result.optimizations_applied
    assert not any("times the prepared model on its own input" in n for n in result.notes)


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_levels_below_o2_do_not_time(backend: Any, level: str) -> None:
    seen: list[str] = []
    result = run_pipeline(backend, _mlp(), level, timer=_timer(O0_FASTEST, seen))
    result.model(torch.randn(4, 32))
    assert seen == []


def test_a_copy_made_before_the_first_call_stays_prepared(backend: Any) -> None:
    seen: list[str] = []
    result = run_pipeline(backend, _mlp(), "O3", timer=_timer(O0_FASTEST, seen))
    twin = copy.deepcopy(result.model)
    twin(torch.randn(4, 32))
    assert seen == []  # the copy does not time (nor undo the original's passes)
    assert compile_state(twin) is not None
    result.model(torch.randn(4, 32))
    assert set(seen) == {"O0", "prepared", "uncompiled"}


def test_a_prepared_model_outside_tolerance_is_undone_at_the_first_call(
        backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The final check, which the first call's input makes possible, undoes passes whose
    # output drifts past the level's tolerance before anything is timed.
    from torchbridge.levels import LEVEL_TOLERANCE
    monkeypatch.setitem(LEVEL_TOLERANCE, "O3", 1e-9)  # bf16 cannot meet it
    model, x = _mlp(), torch.randn(4, 32)
    result = run_pipeline(backend, model, "O3", timer=_timer(PREPARED_FASTEST))
    out = result.model(x)
    assert any(p.status == "failed" and "undone after the run" in p.detail
               for p in result.passes), result.passes
    torch.testing.assert_close(out, model(x), rtol=1e-6, atol=1e-6)


def test_strict_raises_at_the_first_call_when_the_check_fails_and_undoes_all(
        backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.levels import LEVEL_TOLERANCE
    monkeypatch.setitem(LEVEL_TOLERANCE, "O3", 1e-9)
    model, x = _mlp(), torch.randn(4, 32)
    result = run_pipeline(backend, model, "O3", strict=True, timer=_timer(PREPARED_FASTEST))
    with pytest.raises(ModelOptimizationError, match="no drop-in for O0"):
        result.model(x)
    # Not an unchecked prepared model for the calls after: every pass undone.
    assert "forward" not in result.model.__dict__
    torch.testing.assert_close(result.model(x), model(x), rtol=0, atol=0)


def test_a_model_changed_after_prepare_model_is_not_timed(backend: Any) -> None:
    # Undoing would restore the tensors the passes saw: the loaded weights would be lost.
    seen: list[str] = []
    model, x = _mlp(), torch.randn(4, 32)
    result = run_pipeline(backend, model, "O2", timer=_timer(O0_FASTEST, seen))
    trained = _mlp()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)
    result.model.load_state_dict(trained.state_dict())
    out = result.model(x)
    assert seen == []
    assert any("changed since prepare_model" in n for n in result.notes), result.notes
    torch.testing.assert_close(out, trained(x), rtol=0.05, atol=0.05)


def test_the_caller_changing_o0_after_prepare_model_is_not_timed(backend: Any) -> None:
    seen: list[str] = []
    model = _mlp()
    result = run_pipeline(backend, model, "O2", timer=_timer(O0_FASTEST, seen))
    model.register_forward_hook(lambda *_: None)
    result.model(torch.randn(4, 32))
    assert seen == [] and "compile" in result.optimizations_applied


def test_hooks_run_once_on_the_call_and_not_on_the_replays(backend: Any) -> None:
    # A pre-hook the model had before prepare_model (both O0 and the copy have it) that
    # changes its input: replaying through the model would apply it twice to the copy of
    # arguments it already changed.
    calls: list[int] = []
    model = _mlp()

    def double(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        calls.append(1)
        return (args[0] * 2,)
    model.register_forward_pre_hook(double)
    result = run_pipeline(backend, model, "O3", timer=_timer(PREPARED_FASTEST))
    calls.clear()
    x = torch.randn(4, 32)
    out = result.model(x)
    assert calls == [1]
    assert not any(p.status == "failed" for p in result.passes), result.summary()
    assert "compile" in result.optimizations_applied
    torch.testing.assert_close(out, model(x), rtol=0.05, atol=0.05)


def test_a_meta_input_is_not_the_first_call_to_time_on(backend: Any) -> None:
    from torchbridge.optimize.first_call import _not_replayable

    seen: list[str] = []
    result = run_pipeline(backend, _mlp(), "O2", timer=_timer(PREPARED_FASTEST, seen))
    with pytest.raises(Exception):  # noqa: B017 (the model's own error, whatever it is)
        result.model(torch.empty(4, 32, device="meta"))
    assert seen == []
    result.model(torch.randn(4, 32))  # the first real call is timed
    assert set(seen) == {"O0", "prepared", "uncompiled"}
    assert _not_replayable(({"a": [torch.ones(1), 2, None]},), {"b": "x"}) is None


def test_strict_failure_at_the_first_call_leaves_no_setting_in_the_report(
        monkeypatch: pytest.MonkeyPatch, reload_plugins: None) -> None:
    """Every pass undone at the first call: the report's process-wide settings say how
    they are then, not how prepare_model left them."""
    from test_keep_fastest import _Knobs
    from torchbridge.levels import LEVEL_TOLERANCE
    monkeypatch.setitem(LEVEL_TOLERANCE, "O3", 1e-9)
    knobs = _Knobs()
    torchbridge.register_plugin(knobs.plugin(), name="knobs")
    model, x = _mlp(), torch.randn(4, 32)
    result = run_pipeline(torchbridge.get_backend("cpu"), model, "O3", strict=True,
                          timer=_timer(PREPARED_FASTEST))
    assert "speed knob" in {c.name for c in result.process_settings}
    with pytest.raises(ModelOptimizationError, match="no drop-in for O0"):
        result.model(x)
    assert knobs.values == dict.fromkeys(_Knobs.NAMES, "default")
    assert not [c for c in result.process_settings if "knob" in c.name]


def test_a_setting_with_no_way_back_stays_in_the_report_after_a_strict_failure(
        monkeypatch: pytest.MonkeyPatch, reload_plugins: None) -> None:
    """As the XLA cache folder of the TPU plugin: a setting its pass cannot put back."""
    from torchbridge import OptimizationLevel, OptimizationPass
    from torchbridge.levels import LEVEL_TOLERANCE
    from torchbridge.optimize.settings import ProcessSetting
    monkeypatch.setitem(LEVEL_TOLERANCE, "O3", 1e-9)
    knob = {"value": "default"}
    setting = ProcessSetting("one-way knob", lambda: knob["value"], None, scope="process",
                             why_process="it has no way back")

    def turn(model: torch.nn.Module, ctx: Any) -> torch.nn.Module:
        knob["value"] = "turned"
        return model

    class Plugin:
        @torchbridge.hookimpl
        def torchbridge_optimization_passes(self, backend: object, level: object
                                            ) -> list[OptimizationPass]:
            return [OptimizationPass("one_way", "turns a knob", OptimizationLevel.O2, turn,
                                     order=95, mutates=False, settings=(setting,))]
    torchbridge.register_plugin(Plugin(), name="one_way")
    result = run_pipeline(torchbridge.get_backend("cpu"), _mlp(), "O3", strict=True,
                          timer=_timer(PREPARED_FASTEST))
    with pytest.raises(ModelOptimizationError, match="no drop-in for O0"):
        result.model(torch.randn(4, 32))
    assert knob["value"] == "turned"
    [change] = [c for c in result.process_settings if c.name == "one-way knob"]
    assert (change.before, change.after) == ("default", "turned")
    assert any("one-way knob" in n for n in result.notes), result.notes
