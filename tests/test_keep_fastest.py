"""Keep the faster (optimize/fastest.py): with a sample input, O2/O3 time the prepared model
against O0 (and against itself uncompiled) and return the fastest. The decision is tested
with an injected timer that answers by candidate: no test here depends on how fast this
machine is."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchbridge
from torchbridge.optimize.pipeline import run_pipeline


def _timer(costs: dict[str, float], seen: list[str] | None = None
           ) -> Callable[[str, Callable[[], Any]], float]:
    def time_call(label: str, fn: Callable[[], Any]) -> float:
        fn()  # the candidate still runs: the decision is the only thing faked
        if seen is not None:
            seen.append(label)
        return costs[label]
    return time_call


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 8)).eval()


@pytest.fixture(scope="module")
def backend() -> Any:
    return torchbridge.get_backend("cpu")


def test_o0_is_returned_when_the_prepared_model_times_slower(backend: Any) -> None:
    model, x = _mlp(), torch.randn(4, 32)
    expected = model(x)
    result = run_pipeline(backend, model, "O2", sample_input=x,
                          timer=_timer({"O0": 1.0, "prepared": 2.0, "uncompiled": 1.5}))
    prepared = result.model
    assert "forward" not in prepared.__dict__  # no autocast or compiled forward left
    assert all(p.dtype == torch.float32 for p in prepared.parameters())
    torch.testing.assert_close(prepared(x), expected, rtol=0, atol=0)
    status = {p.name: (p.status, p.detail) for p in result.passes}
    assert status["device_placement"][0] == "applied"
    for name in ("autocast", "compile"):
        assert status[name][0] == "skipped"
        assert status[name][1].startswith("undone after timing: timed on the sample input")
    assert any("O0 was the fastest" in n and "O0 1000 ms" in n and "prepared 2000 ms" in n
               for n in result.notes), result.notes
    assert result.speedup == 1.0 and result.baseline_seconds == 1.0


def test_compile_is_undone_when_the_uncompiled_forward_times_faster(backend: Any) -> None:
    model, x = _mlp(), torch.randn(4, 32)
    result = run_pipeline(backend, model, "O3", sample_input=x,
                          timer=_timer({"O0": 3.0, "prepared": 2.0, "uncompiled": 1.0}))
    status = {p.name: (p.status, p.detail) for p in result.passes}
    assert status["compile"][0] == "skipped" and "undone after timing" in status["compile"][1]
    assert status["autocast"][0] == "applied"
    assert status["low_precision_weights"][0] == "applied"
    # Freezing was an option of compile: without compile it has no effect, and says so.
    assert status["inference_freezing"][0] == "skipped"
    assert "no effect" in status["inference_freezing"][1]
    assert torchbridge.optimize.forward.compile_state(result.model) is None
    assert result.speedup == 3.0
    assert any("uncompiled was the fastest" in n for n in result.notes)


def test_the_prepared_model_is_kept_when_it_times_fastest(backend: Any) -> None:
    seen: list[str] = []
    model, x = _mlp(), torch.randn(4, 32)
    result = run_pipeline(backend, model, "O2", sample_input=x,
                          timer=_timer({"O0": 2.0, "prepared": 1.0, "uncompiled": 1.5}, seen))
    assert "compile" in result.optimizations_applied
    assert result.speedup == 2.0 and result.optimized_seconds == 1.0
    # Round-robin: every round times each candidate once, in an order of its own; O0,
    # twice as slow as the fastest in both, sits out the third.
    rounds = [seen[:3], seen[3:6], seen[6:]]
    assert all(sorted(r) == ["O0", "prepared", "uncompiled"] for r in rounds[:2])
    assert sorted(rounds[2]) == ["prepared", "uncompiled"]
    assert any("kept the prepared model" in n for n in result.notes)


def test_o0s_first_call_in_the_process_is_no_sample_of_its_speed(backend: Any) -> None:
    """O0 is the caller's model, which prepare_model had not called before the timing;
    its first call pays for page faults and lazy setup. Far behind, O0 is out of the race
    after two samples and its figure is the faster one: with the first call among them
    and one noisy sample beside it, the report's speedup was that noise."""
    model, x = _mlp(), torch.randn(4, 32)
    calls: list[int] = []
    # The pipeline's copies carry the hook too: only the caller's own model counts.
    model.register_forward_pre_hook(lambda m, _: calls.append(1) if m is model else None)
    first_slow_then_noisy = {1: 10.0, 2: 1.6}  # its nth call; every later one 1.0

    def time_call(label: str, fn: Callable[[], Any]) -> float:
        fn()
        if label == "O0":
            return first_slow_then_noisy.get(len(calls), 1.0)
        return {"prepared": 0.5, "uncompiled": 0.6}[label]

    result = run_pipeline(backend, model, "O2", sample_input=x, timer=time_call)
    assert len(calls) == 3  # one untimed call, then two timed: out of the race
    assert result.baseline_seconds == 1.0 and result.speedup == 2.0
    assert "measured speedup vs O0: 2.00x (1000.000 ms -> 500.000 ms" in result.summary()


def test_inplace_o0_kept_leaves_the_callers_model_as_given(backend: Any) -> None:
    model, x = _mlp(), torch.randn(4, 32)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    result = run_pipeline(backend, model, "O2", sample_input=x, inplace=True,
                          timer=_timer({"O0": 1.0, "prepared": 5.0, "uncompiled": 4.0}))
    assert result.model is model and "forward" not in model.__dict__
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]) and value.dtype == weights[key].dtype


def test_no_timing_without_a_sample_input_or_below_o2(backend: Any) -> None:
    def never(label: str, fn: Callable[[], Any]) -> float:
        raise AssertionError("timed without reason")

    model, x = _mlp(), torch.randn(4, 32)
    assert run_pipeline(backend, model, "O2", timer=never).speedup is None
    assert run_pipeline(backend, model, "O1", sample_input=x, timer=never).speedup is None


def test_training_mode_is_measured_only_with_measure(backend: Any) -> None:
    model, x = _mlp().train(), torch.randn(4, 32)
    timer = _timer({"O0": 1.0, "prepared": 9.0, "uncompiled": 9.0})
    assert run_pipeline(backend, model, "O2", sample_input=x, timer=timer).speedup is None
    measured = run_pipeline(backend, model, "O2", sample_input=x, measure=True, timer=timer)
    assert "autocast" in measured.optimizations_applied  # no decision from a forward
    assert measured.speedup == pytest.approx(1 / 9)
    assert any("measured only" in n for n in measured.notes)


def test_each_round_takes_the_candidates_in_another_order_the_same_in_every_run() -> None:
    """A call pays for what the call before it left in the caches: in a fixed order one
    candidate would always follow the same other one. The orders are seeded: a run is
    repeatable, and the global RNG is not touched."""
    from torchbridge.optimize.measure import round_robin

    def orders() -> list[tuple[str, ...]]:
        seen: list[str] = []
        round_robin({label: (lambda: None) for label in "abcd"},
                    _timer(dict.fromkeys("abcd", 1.0), seen), warmup=0, repeats=12,
                    min_seconds=0.0)
        return [tuple(seen[i:i + 4]) for i in range(0, len(seen), 4)]

    state = random.getstate()
    first = orders()
    assert random.getstate() == state
    assert first == orders() and all(sorted(o) == list("abcd") for o in first)
    predecessors = {o[o.index("b") - 1] for o in first if o.index("b") > 0}
    assert len(predecessors) >= 2, first  # "b" follows more than one other candidate


def test_a_candidate_far_behind_sits_out_a_close_race() -> None:
    from torchbridge.optimize.measure import round_robin

    seen: list[str] = []
    medians = round_robin({label: (lambda: None) for label in ("O0", "a", "b")},
                          _timer({"O0": 2.0, "a": 1.0, "b": 1.01}, seen), warmup=0,
                          repeats=3, max_repeats=9, min_seconds=0.0)
    # O0's two samples, each over 1.5x the others' slowest: out after two rounds.
    assert (seen.count("O0"), seen.count("a"), seen.count("b")) == (2, 9, 9)
    assert medians == {"O0": 2.0, "a": 1.0, "b": 1.01}
    # Without max_repeats (the benchmarks' fixed number of rounds) every candidate runs all.
    seen.clear()
    round_robin({label: (lambda: None) for label in ("O0", "a")},
                _timer({"O0": 2.0, "a": 1.0}, seen), warmup=0, repeats=5, min_seconds=0.0)
    assert seen.count("O0") == seen.count("a") == 5


def _sequence_timer(samples: dict[str, list[float]], seen: list[str]
                    ) -> Callable[[str, Callable[[], Any]], float]:
    """A timer answering each candidate's next sample from `samples`."""
    def time_call(label: str, fn: Callable[[], Any]) -> float:
        fn()
        seen.append(label)
        return samples[label][seen.count(label) - 1]
    return time_call


def test_a_candidate_out_after_two_rounds_is_given_its_faster_sample() -> None:
    """Its median would be the mean of its two samples: one slow one would overstate how
    far behind it was (O0's figure is the report's speedup)."""
    from torchbridge.optimize.measure import round_robin

    seen: list[str] = []
    timer = _sequence_timer({"O0": [3.0, 2.0], "a": [1.0] * 9}, seen)
    medians = round_robin({"O0": lambda: None, "a": lambda: None}, timer, warmup=0,
                          repeats=3, max_repeats=9, min_seconds=0.0)
    assert seen.count("O0") == 2 and medians == {"O0": 2.0, "a": 1.0}


@pytest.mark.parametrize(("costs", "rounds"), [
    ({"O0": 2.0, "a": 1.0, "b": 1.01}, 3),  # O0 out of the race: a and b close, 3 rounds
    ({"O0": 1.01, "a": 1.0, "b": 2.0}, 9),  # O0 in the close race: up to max_repeats
])
def test_a_close_race_gets_extra_rounds_only_while_the_baseline_is_in_it(
        costs: dict[str, float], rounds: int) -> None:
    from torchbridge.optimize.measure import round_robin

    seen: list[str] = []
    round_robin({label: (lambda: None) for label in costs}, _timer(costs, seen), warmup=0,
                repeats=3, max_repeats=9, min_seconds=0.0, baseline="O0")
    assert max(seen.count(label) for label in costs) == rounds


@pytest.mark.parametrize("spiked", ["O0", "a"])
def test_one_noisy_sample_puts_no_candidate_out_of_the_race(spiked: str) -> None:
    """Out of the race after two rounds takes every sample of a candidate over 1.5x
    another's slowest: one sample that noise made three times longer, on either side,
    does not; the medians of the full rounds decide."""
    from torchbridge.optimize.measure import round_robin

    samples = {"O0": [1.2] * 9, "a": [1.0] * 9}
    samples[spiked][0 if spiked == "O0" else 1] = 3.0
    seen: list[str] = []
    timer = _sequence_timer(samples, seen)
    medians = round_robin({"O0": lambda: None, "a": lambda: None}, timer, warmup=0,
                          repeats=3, max_repeats=9, min_seconds=0.0)
    assert seen.count("O0") == seen.count("a") == 3
    assert medians == {"O0": 1.2, "a": 1.0}


def test_a_clear_winner_costs_few_rounds_a_close_race_more() -> None:
    from torchbridge.optimize.measure import round_robin

    def count(costs: dict[str, float]) -> int:
        seen: list[str] = []
        round_robin({label: (lambda: None) for label in costs}, _timer(costs, seen),
                    warmup=0, repeats=3, max_repeats=9, min_seconds=0.0)
        return len(seen) // len(costs)

    assert count({"a": 1.0, "b": 1.2}) == 3
    assert count({"a": 1.0, "b": 1.01}) == 9
    assert count({"a": 1.0}) == 3


def test_candidates_run_in_the_grad_mode_they_were_compiled_in(backend: Any) -> None:
    """The checks compile the model under no_grad; timed under inference_mode it would
    recompile inside the timing (dynamo guards on the grad mode) and look seconds slower
    than it is. Every timed call runs under no_grad, outside inference mode."""
    modes: list[tuple[bool, bool]] = []

    def timer(label: str, fn: Callable[[], Any]) -> float:
        modes.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        fn()
        return {"prepared": 1.0, "uncompiled": 2.0}.get(label, 3.0)

    result = run_pipeline(backend, _mlp(), "O2", sample_input=torch.randn(4, 32), timer=timer)
    assert "compile" in result.optimizations_applied
    assert modes and set(modes) == {(False, False)}


class _Knobs:
    """Three process-wide knobs a plugin's pass turns, each able to go back: one that
    changes how fast any model of the process runs (scope "process", kept_after_timing),
    one torch reads once per process (scope "process"), one it reads at each op (scope
    "call")."""

    NAMES = ("speed", "process", "call")

    def __init__(self) -> None:
        self.values = dict.fromkeys(self.NAMES, "default")

    def setting(self, name: str) -> Any:
        from torchbridge.optimize.settings import ProcessSetting

        return ProcessSetting(f"{name} knob", lambda: self.values[name],
                              lambda value: self.values.__setitem__(name, value),
                              scope="call" if name == "call" else "process",
                              why_process="" if name == "call" else "read once per process",
                              kept_after_timing=name == "speed")

    def plugin(self, fail: bool = False) -> Any:
        from torchbridge.optimize.passes import OptimizationLevel, OptimizationPass

        knobs = self

        class Plugin:
            @torchbridge.hookimpl
            def torchbridge_optimization_passes(self, backend: object, level: object
                                                ) -> list[OptimizationPass]:
                def turn(model: torch.nn.Module, ctx: Any) -> torch.nn.Module:
                    knobs.values.update(dict.fromkeys(knobs.NAMES, "turned"))
                    if fail:
                        raise RuntimeError("gave up after turning the knobs")
                    return model

                return [OptimizationPass("turns_knobs", "turns three knobs",
                                         OptimizationLevel.O2, turn, order=95, mutates=False,
                                         settings=tuple(map(knobs.setting, knobs.NAMES)))]
        return Plugin()


@pytest.mark.parametrize("kept", ["O0", "uncompiled"])
def test_the_model_kept_after_timing_runs_under_the_process_settings_it_was_timed_under(
        kept: str, reload_plugins: None) -> None:
    """The candidates were timed under the process-wide settings the passes made; putting
    back one that changes how fast any model runs, when the timing keeps O0 (or the
    uncompiled forward), would leave the kept model running otherwise than timed. Such a
    setting (kept_after_timing) stays, reported with the reason; the others go back."""
    knobs = _Knobs()
    torchbridge.register_plugin(knobs.plugin(), name="knobs")
    costs = {"O0": 1.0, "prepared": 3.0, "uncompiled": 2.0} if kept == "O0" else \
        {"O0": 3.0, "prepared": 2.0, "uncompiled": 1.0}
    result = run_pipeline(torchbridge.get_backend("cpu"), _mlp(), "O2",
                          sample_input=torch.randn(4, 32), timer=_timer(costs))
    record = next(p for p in result.passes if p.name == "turns_knobs")
    assert (record.status, record.detail.split(":")[0]) == ("skipped", "undone after timing")
    assert knobs.values == {"speed": "turned", "process": "default", "call": "default"}
    [change] = [c for c in result.process_settings if "knob" in c.name]
    assert (change.name, change.before, change.after, change.scope) == (
        "speed knob", "default", "turned", "process")
    assert change.why_process == "read once per process; the pass was undone, the setting " \
                                 "stays (the kept model was timed under it)"
    assert result.restore_process_settings() == []
    assert knobs.values["speed"] == "default"


def test_a_pass_rolled_back_for_failing_puts_every_setting_back(reload_plugins: None) -> None:
    knobs = _Knobs()
    torchbridge.register_plugin(knobs.plugin(fail=True), name="knobs")
    result = run_pipeline(torchbridge.get_backend("cpu"), _mlp(), "O2",
                          sample_input=torch.randn(4, 32),
                          timer=_timer({"O0": 1.0, "prepared": 3.0, "uncompiled": 2.0}))
    assert next(p for p in result.passes if p.name == "turns_knobs").status == "failed"
    assert knobs.values == dict.fromkeys(_Knobs.NAMES, "default")
    assert not [c for c in result.process_settings if "knob" in c.name]


def _speed_knob_passes(knobs: _Knobs, orders: dict[str, int]) -> Any:
    """Passes that each set the speed knob (kept_after_timing) to their own name."""
    from torchbridge.optimize.passes import OptimizationLevel, OptimizationPass

    def setter(value: str) -> Any:
        def turn(model: torch.nn.Module, ctx: Any) -> torch.nn.Module:
            knobs.values["speed"] = value
            return model
        return turn

    class Plugin:
        @torchbridge.hookimpl
        def torchbridge_optimization_passes(self, backend: object, level: object
                                            ) -> list[OptimizationPass]:
            return [OptimizationPass(name, "sets the speed knob", OptimizationLevel.O2,
                                     setter(name), order=order, mutates=False,
                                     settings=(knobs.setting("speed"),))
                    for name, order in orders.items()]
    return Plugin()


@pytest.mark.parametrize("kept", ["O0", "uncompiled"])
def test_two_passes_on_one_setting_report_its_value_before_both_and_now(
        kept: str, reload_plugins: None) -> None:
    """O0 kept: both passes undone, from the last. The uncompiled forward kept: the pass
    before compile stays applied, the one after it is undone. Either way the setting is at
    the second pass's value, which the report gives beside its value before the first."""
    knobs = _Knobs()
    torchbridge.register_plugin(_speed_knob_passes(knobs, {"first": 45, "second": 95}),
                                name="knobs")
    costs = {"O0": 1.0, "prepared": 3.0, "uncompiled": 2.0} if kept == "O0" else \
        {"O0": 3.0, "prepared": 2.0, "uncompiled": 1.0}
    result = run_pipeline(torchbridge.get_backend("cpu"), _mlp(), "O2",
                          sample_input=torch.randn(4, 32), timer=_timer(costs))
    assert knobs.values["speed"] == "second"
    [change] = [c for c in result.process_settings if c.name == "speed knob"]
    assert (change.before, change.after, change.pass_name) == ("default", "second", "second")
    assert change.why_process.endswith("(the kept model was timed under it)")
    result.restore_process_settings()
    assert knobs.values["speed"] == "default"


def test_a_run_failing_after_the_timing_puts_back_what_the_timing_kept(
        reload_plugins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept for the model the timing kept; the run then failed (here its last check), so
    no model is kept and the setting goes back, and the error names no setting."""
    from torchbridge.errors import ModelOptimizationError
    from torchbridge.optimize.run import Run

    knobs = _Knobs()
    torchbridge.register_plugin(knobs.plugin(), name="knobs")
    check, calls = Run.final_check, []

    def fails_after_the_timing(run: Run) -> None:
        calls.append(1)
        if len(calls) == 2:  # the first runs before the timing
            raise RuntimeError("the last check broke")
        check(run)
    monkeypatch.setattr(Run, "final_check", fails_after_the_timing)
    with pytest.raises(ModelOptimizationError) as caught:
        run_pipeline(torchbridge.get_backend("cpu"), _mlp(), "O2",
                     sample_input=torch.randn(4, 32),
                     timer=_timer({"O0": 1.0, "prepared": 3.0, "uncompiled": 2.0}))
    assert knobs.values == dict.fromkeys(_Knobs.NAMES, "default")
    assert "the process-wide settings were put back as they were" in str(caught.value)


def test_passes_of_equal_order_on_one_setting_are_told_apart_by_when_they_ran(
        reload_plugins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Passes of one order run by name; undone, the first gives the value before."""
    knobs = _Knobs()
    torchbridge.register_plugin(_speed_knob_passes(knobs, {"a": 95, "b": 95}), name="knobs")
    timer = _timer({"O0": 1.0, "prepared": 3.0, "uncompiled": 2.0})
    result = run_pipeline(torchbridge.get_backend("cpu"), _mlp(), "O2",
                          sample_input=torch.randn(4, 32), timer=timer)
    [change] = [c for c in result.process_settings if c.name == "speed knob"]
    assert (change.before, change.after, change.pass_name) == ("default", "b", "b")
    result.restore_process_settings()
    assert knobs.values["speed"] == "default"


def test_the_real_timers_hold_the_output_until_the_device_has_run_it() -> None:
    # On a lazy device (XLA) synchronize() runs the graphs of the tensors still alive: a
    # timer that dropped the output before syncing timed the trace only (0.08 ms against
    # 248 ms), and the race undid compile and autocast on those figures.
    import weakref

    from torchbridge.optimize.measure import median_latency, wall_timer

    alive_at_sync: list[bool] = []
    outputs: list[weakref.ref[torch.Tensor]] = []

    def fn() -> torch.Tensor:
        out = torch.ones(4)
        outputs.append(weakref.ref(out))
        return out

    def synchronize() -> None:
        alive_at_sync.append(outputs[-1]() is not None)

    wall_timer(synchronize)("prepared", fn)
    median_latency(fn, synchronize, warmup=2, repeats=3)
    assert alive_at_sync and all(alive_at_sync)


class _KeepsPythonState(torch.nn.Module):
    """A forward that changes the module's own Python attributes: a counter, a list it
    appends to, a dict it fills, a tensor it keeps outside its buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(32, 8)
        self.calls, self.history, self.seen = 0, [], {}
        self.running = torch.zeros(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.calls += 1
        self.history.append(float(y.mean()))
        self.seen[len(self.seen)] = tuple(x.shape)
        self.running.add_(y.detach().float().mean(0))
        self.last = y.detach()
        return y


def test_the_callers_model_timed_as_o0_keeps_its_python_state(backend: Any) -> None:
    """O0 is timed on the caller's own model (no copy): its forward ran a dozen times, and
    the counter, list, dict and kept tensor it changes changed, though the docs say the
    model you pass is not changed. Before: 3 calls counted, listed and kept."""
    model = _KeepsPythonState().eval()
    result = run_pipeline(backend, model, "O2", sample_input=torch.randn(4, 32),
                          timer=_timer({"O0": 1.0, "prepared": 2.0, "uncompiled": 3.0}))
    assert result.model is not model
    assert (model.calls, model.history, model.seen) == (0, [], {})
    assert torch.equal(model.running, torch.zeros(8)) and "last" not in model.__dict__
    model(torch.randn(4, 32))  # and it still runs as it did
    assert model.calls == 1 and len(model.history) == 1


class _SetsUpHooksOnFirstCall(torch.nn.Module):
    """transformers' way with output_hidden_states: the first call registers forward hooks
    that collect outputs and marks the model so that later calls do not register them
    again."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not getattr(self, "hooks_installed", False):
            for layer in self.layers:
                layer.register_forward_hook(lambda m, a, out: self.collected.append(out))
            self.hooks_installed = True
        self.collected: list[torch.Tensor] = []
        for layer in self.layers:
            x = layer(x)
        return tuple(self.collected)


def test_a_model_that_sets_itself_up_at_its_first_call_keeps_that_setup() -> None:
    """The marker was put back after the calls made to measure, the hooks stayed, and the
    next call registered them again: every output came back twice, and the run blamed the
    passes ("output structure changed"). Before: 4 outputs for eager's 2."""
    model = _SetsUpHooksOnFirstCall().eval()
    result = torchbridge.get_backend("cpu").optimize(model, "O1", sample_input=torch.randn(2, 8))
    assert [p.status for p in result.passes if p.name == "device_placement"] == ["applied"]
    assert len(result.model(torch.randn(2, 8))) == 2
