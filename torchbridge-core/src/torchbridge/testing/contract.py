"""The backend contract: what every backend must honour for the facade to mean anything, and
proof that the plugin itself answers (not the core's fallbacks standing in for it).

Subclass `BackendContract` in a pytest module and set `backend_name`. Override
`make_model` to test with your own model, and `make_unavailable` to show the path where
your hardware is absent. Each test says what a user relies on.

Without the hardware, run it on a recorded device: set `recorded` to what the recording is
and override `record` to replay its properties at your probe seam. No tensor can be placed
on a recorded device, so the tests that need one skip and say so; everything else runs
(identity, device info, memory figures, hooks, config, the unavailable path, device calls,
and prepare_model's report at every level with the passes in `passes_needing_the_device`
disabled).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import torchbridge
from torchbridge import ConfigurationError, DeviceError, DeviceInfo, MemoryStats
from torchbridge.backend import DEVICE_HOOKS
from torchbridge.config import hardware_sections
from torchbridge.devices import device_module
from torchbridge.levels import LEVEL_TOLERANCE, OptimizationLevel


def small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).eval()


def _args(sample: Any) -> tuple[Any, ...]:
    return sample if isinstance(sample, tuple) else (sample,)


def _answer(backend: torchbridge.Backend, hook: str) -> None:
    """Call the facade method behind `hook` so that backend.answered_by records it."""
    calls: dict[str, Callable[[], Any]] = {
        "torchbridge_device_info": backend.get_device_info,
        "torchbridge_memory_stats": backend.get_memory_stats,
        "torchbridge_empty_cache": backend.empty_cache,
        "torchbridge_reset_peak_memory_stats": backend.reset_peak_memory_stats,
        "torchbridge_synchronize": backend.synchronize,
        "torchbridge_distributed_backend": lambda: backend.distributed_backend}
    calls[hook]()


# The device calls the core's generic fallback makes through torch's own device module
# (torch.cuda, torch.xpu): on a recorded device they are logged, not run.
_DEVICE_MODULE_CALLS = ("synchronize", "empty_cache", "reset_peak_memory_stats")


class BackendContract:
    backend_name: ClassVar[str]
    levels: ClassVar[tuple[str, ...]] = ("O0", "O1", "O2", "O3")
    recorded: ClassVar[str | None] = None
    """None for a real device. For a recorded one (its properties replayed at your probe
    seam by `record`), what the recording is, e.g. "NVIDIA H100 80GB HBM3 at
    torchbridge_nvidia.probe". It appears in the reason of every test skipped for it."""
    passes_needing_the_device: ClassVar[tuple[str, ...]] = ("device_placement", "compile")
    """On a recorded device, the passes prepare_model runs with disabled: they move tensors
    to the device or run the model there. Add yours if they do too."""

    def record(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Replay the recorded device at your probe seam, patching with `monkeypatch` (so it
        is undone after each test). The `backend` fixture calls it before making the backend
        when `recorded` is set; override it then."""
        pytest.fail(f"{type(self).__name__} sets recorded = {self.recorded!r} but does not "
                    "override record(monkeypatch) to install the recording")

    def needs_the_device(self, what: str) -> None:
        """Skip the calling test on a recorded device: `what` needs tensors there."""
        if self.recorded is not None:
            pytest.skip(f"{self.backend_name} is a recording ({self.recorded}); no tensor "
                        f"can be placed on it: {what}")

    def without_device_passes(self, backend: torchbridge.Backend) -> torchbridge.Backend:
        """`backend` itself on a real device; on a recorded one, the same backend with the
        passes in `passes_needing_the_device` disabled."""
        if self.recorded is None:
            return backend
        config = backend.config.model_copy(deep=True)
        disabled = config.optimization.disabled_passes
        disabled.extend(p for p in self.passes_needing_the_device if p not in disabled)
        return torchbridge.get_backend(backend.name, config=config)

    def make_model(self) -> tuple[nn.Module, Any]:
        """(model in eval mode, sample input on the CPU: a tensor, or a tuple of positional
        arguments). Override with your own; its output must be a tensor."""
        return small_mlp(), torch.randn(8, 64)

    def make_unavailable(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Patch your probe seam so that your hardware looks absent. Override it; the
        default skips the test that needs it."""
        pytest.skip("make_unavailable not overridden: the unavailable path is not tested")

    @pytest.fixture
    def backend(self, monkeypatch: pytest.MonkeyPatch) -> torchbridge.Backend:
        if self.recorded is None:
            return torchbridge.get_backend(self.backend_name)
        self.record(monkeypatch)
        backend = torchbridge.get_backend(self.backend_name)
        self._record_device_module_calls(monkeypatch, backend.device)
        return backend

    def _record_device_module_calls(self, monkeypatch: pytest.MonkeyPatch,
                                    device: torch.device) -> None:
        """There is no device behind a recording: the device calls that reach torch's own
        device module are logged in `self.device_module_calls` instead of run."""
        self.device_module_calls: list[tuple[str, tuple[Any, ...]]] = []
        module = device_module(device)
        for name in _DEVICE_MODULE_CALLS:
            if module is not None and hasattr(module, name):
                monkeypatch.setattr(module, name, lambda *args, name=name:
                                    self.device_module_calls.append((name, args)))

    def test_identity(self, backend: torchbridge.Backend) -> None:
        assert backend.name == self.backend_name
        assert backend.is_available
        assert backend.device_count >= 1
        assert len(backend.devices) == backend.device_count
        assert isinstance(backend.device, torch.device)
        assert backend.device.type == backend.status.device_type
        if self.recorded is None:
            torch.zeros(1, device=backend.device)  # the device is usable

    def test_fallbacks_are_declared(self, backend: torchbridge.Backend) -> None:
        assert backend.plugin, "a backend is reported by a plugin"
        assert backend.status.fallbacks is not None, (
            f"plugin {backend.plugin} leans on the core's fallbacks without opting in: set "
            "Detection(fallbacks=...) to the ones it uses, or () to answer every hook itself")

    @pytest.mark.parametrize("hook", list(DEVICE_HOOKS))
    def test_hooks_are_answered_by_the_plugin_or_a_named_fallback(
            self, backend: torchbridge.Backend, hook: str) -> None:
        _answer(backend, hook)
        who = backend.answered_by.get(hook)
        allowed = {backend.plugin} | {f"{name} (fallback)"
                                      for name in backend.status.fallbacks or ()}
        assert who in allowed, (f"{hook} of {backend.name} was answered by {who}; expected "
                                f"plugin {backend.plugin} or an opted-in fallback")

    def test_a_fallback_answer_says_so(self, backend: torchbridge.Backend) -> None:
        info = backend.get_device_info()
        if "(fallback)" in backend.answered_by["torchbridge_device_info"]:
            assert info.notes and "fallback" in info.notes
        stats = backend.get_memory_stats()
        if "(fallback)" in backend.answered_by["torchbridge_memory_stats"]:
            assert stats.notes and "fallback" in stats.notes

    def test_device_info(self, backend: torchbridge.Backend) -> None:
        info = backend.get_device_info()
        assert isinstance(info, DeviceInfo)
        assert info.backend == backend.name
        assert info.name
        assert "float32" in info.supported_dtypes
        for dtype in info.supported_dtypes:
            assert isinstance(getattr(torch, dtype), torch.dtype)
        if info.preferred_low_precision_dtype is not None:
            assert info.preferred_low_precision_dtype in info.supported_dtypes
        for gb in (info.memory_total_gb, info.memory_available_gb):
            assert gb is None or gb > 0
        if info.memory_total_gb is not None and info.memory_available_gb is not None:
            assert info.memory_available_gb <= info.memory_total_gb

    def test_every_device_index_reaches_the_hooks(self, backend: torchbridge.Backend) -> None:
        for index in range(backend.device_count):
            expected = backend.hook_device(index)
            info = backend.get_device_info(index)
            assert torch.device(info.device) == expected, (
                f"get_device_info({index}) described {info.device}, expected {expected}: "
                "set DeviceInfo.device to str(device) of the device the hook received")
            stats = backend.get_memory_stats(index)
            assert torch.device(stats.device) in (expected, backend.device_at(index))

    def test_bad_device_index_is_a_device_error(self, backend: torchbridge.Backend) -> None:
        with pytest.raises(DeviceError, match="does not exist"):
            backend.get_device_info(backend.device_count)

    def test_unavailable_path_gives_a_reason(self, backend: torchbridge.Backend,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
        self.make_unavailable(monkeypatch)
        try:
            status = next(s for s in torchbridge.list_backends(rescan=True)
                          if s.name == self.backend_name)
            assert not status.available
            assert status.reason, "an unavailable backend says why"
            with pytest.raises(torchbridge.BackendUnavailableError, match="unavailable"):
                torchbridge.get_backend(self.backend_name)
        finally:
            monkeypatch.undo()
            torchbridge.list_backends(rescan=True)

    def test_config_section_has_defaults_and_rejects_bad_values(
            self, backend: torchbridge.Backend) -> None:
        name = next((n for n, plugin in hardware_sections().owners.items()
                     if plugin == backend.plugin), None)
        if name is None:
            pytest.skip(f"plugin {backend.plugin} contributes no config section")
        section = backend.hardware_config
        assert section is not None
        type(section)()  # every field has a default
        with pytest.raises(ConfigurationError, match=rf"hardware\.{name}\.no_such_setting"):
            torchbridge.TorchBridgeConfig(hardware={name: {"no_such_setting": 1}})
        typed = [f for f, info in type(section).model_fields.items()
                 if info.annotation is not Any]
        if typed:
            with pytest.raises(ConfigurationError, match=rf"hardware\.{name}\.{typed[0]}"):
                setattr(section, typed[0], object())

    def test_memory_stats_are_bytes_or_none(self, backend: torchbridge.Backend) -> None:
        stats = backend.get_memory_stats()
        assert isinstance(stats, MemoryStats)
        for name in ("allocated", "reserved", "peak_allocated", "free", "total"):
            value = getattr(stats, f"{name}_bytes")
            assert value is None or (isinstance(value, int) and value >= 0), (name, value)
            mb = stats[name]
            assert (mb is None) if value is None else mb == pytest.approx(value / 2**20)
        if None in (stats.allocated_bytes, stats.free_bytes):
            assert stats.notes, "a figure the backend cannot know needs a note saying why"
        if stats.free_bytes is not None and stats.total_bytes is not None:
            assert stats.free_bytes <= stats.total_bytes

    def test_allocation_shows_in_memory_stats(self, backend: torchbridge.Backend) -> None:
        self.needs_the_device("allocating a block to see it counted")
        before = backend.get_memory_stats().allocated_bytes
        if before is None:
            pytest.skip("this backend cannot count allocated bytes")
        block = torch.empty(4 * 2**20, dtype=torch.uint8, device=backend.device)
        backend.synchronize()
        after = backend.get_memory_stats()
        assert after.allocated_bytes is not None
        assert after.allocated_bytes - before >= block.numel()
        peak = after.peak_allocated_bytes
        assert peak is None or peak >= after.allocated_bytes

    def test_device_calls(self, backend: torchbridge.Backend) -> None:
        backend.synchronize()
        backend.empty_cache()
        backend.reset_peak_memory_stats()
        assert isinstance(backend.distributed_backend, str)
        if self.recorded is not None:  # the calls that reached torch got the right device
            for name, args in self.device_module_calls:
                assert all(torch.device(a) == backend.hook_device() for a in args), \
                    f"torch's {name} was called with {args}, expected {backend.hook_device()}"

    def test_autocast_computes_in_low_precision(self, backend: torchbridge.Backend) -> None:
        dtype = backend.low_precision_dtype()
        if self.recorded is not None:  # what can be checked without tensors: the target
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch: "CUDA is not available. Disabling"
                context = backend.autocast()
            assert isinstance(context, torch.autocast)
            assert context.device == backend.device.type
            if dtype is not None:
                assert context.fast_dtype == dtype
        self.needs_the_device("a matmul under autocast")
        a = torch.randn(16, 16, device=backend.device)
        with backend.autocast():
            out = a @ a
        assert out.dtype == (dtype or torch.float32)

    @pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
    def test_prepare_model_matches_reference(self, backend: torchbridge.Backend,
                                             level: str) -> None:
        if level not in self.levels:
            pytest.skip(f"{level} not claimed by this backend's contract run")
        if self.recorded is not None:
            self._prepare_model_report_on_a_recording(backend, level)
            return
        model, x = self.make_model()
        original = copy.deepcopy(model.state_dict())
        with torch.no_grad():
            expected = model(*_args(x))
        result = backend.optimize(model, level, sample_input=x)
        assert result.level == OptimizationLevel(level)
        assert result.backend == backend.name
        assert torchbridge.optimization_result(result.model) is result
        with torch.no_grad():
            out = result.model(*backend.to_device(_args(x)))
        got = out.float().cpu()
        rel = ((got - expected).abs().max() / expected.abs().max()).item()
        assert rel <= LEVEL_TOLERANCE[level], f"{level}: relative drift {rel:.3g}"
        assert result.max_rel_diff is not None
        assert result.max_rel_diff <= LEVEL_TOLERANCE[level]
        # the user's model is untouched
        for key, value in model.state_dict().items():
            assert value.device.type == "cpu"
            assert torch.equal(value, original[key])
        names = [p.name for p in result.passes]
        assert "device_placement" in result.optimizations_applied
        assert len(names) == len(set(names))
        assert not result.failed, f"passes failed: {result.failed}"

    def _prepare_model_report_on_a_recording(self, backend: torchbridge.Backend,
                                             level: str) -> None:
        """What a recording can show of test_prepare_model_matches_reference: every pass
        the plugin offers at `level` checks and applies cleanly and the report is whole.
        The outputs are not compared: the sample input cannot go to the device."""
        model, _ = self.make_model()
        original = copy.deepcopy(model.state_dict())
        result = self.without_device_passes(backend).optimize(model, level)
        assert result.level == OptimizationLevel(level)
        assert result.backend == backend.name
        assert torchbridge.optimization_result(result.model) is result
        for key, value in model.state_dict().items():
            assert value.device.type == "cpu"
            assert torch.equal(value, original[key])
        names = [p.name for p in result.passes]
        assert len(names) == len(set(names))
        assert not result.failed, f"passes failed: {result.failed}"
        for record in result.passes:
            if record.status == "skipped":
                assert record.detail, f"pass {record.name} is skipped without saying why"
            if record.name in self.passes_needing_the_device:
                assert record.status == "skipped", record

    def test_compiled_model_runs_inside_the_pipeline(self, backend: torchbridge.Backend) -> None:
        """At O2 with a sample input, compilation happens inside prepare_model (where a
        failure is rolled back), not at the user's first call."""
        from torch._dynamo.utils import counters

        self.needs_the_device("compiling runs the sample input on the device")

        config = backend.config.model_copy(deep=True)
        config.optimization.disabled_passes = ["compile_value_check"]
        forced = torchbridge.get_backend(backend.name, config=config)
        model, x = self.make_model()
        before = counters["stats"]["unique_graphs"]
        result = forced.optimize(model, "O2", sample_input=x)
        record = next(p for p in result.passes if p.name == "compile")
        if record.status == "skipped":
            pytest.skip(f"compile skipped on {backend.name}: {record.detail}")
        assert record.status == "applied", record
        assert counters["stats"]["unique_graphs"] > before, \
            "the compiled model did not run inside the pipeline"
        compiled_graphs = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            result.model(*backend.to_device(_args(x)))
        assert counters["stats"]["unique_graphs"] == compiled_graphs, "recompiled at first call"

    def test_prepare_model_returns_model_with_report(self, backend: torchbridge.Backend) -> None:
        model, _ = self.make_model()
        prepared = self.without_device_passes(backend).prepare_model(model, level="O1")
        report = torchbridge.optimization_result(prepared)
        assert report is not None and report.backend == backend.name
        param = next(prepared.parameters())
        if self.recorded is None:
            assert param.device.type == backend.device.type
        else:  # placement disabled: the model stays where it was, and the report says so
            assert param.device.type == "cpu"
            placement = [p for p in report.passes if p.name == "device_placement"]
            assert all(p.status == "skipped" for p in placement), placement

    def test_prepare_model_rejects_non_modules(self, backend: torchbridge.Backend) -> None:
        with pytest.raises(torchbridge.ModelOptimizationError, match=r"nn\.Module"):
            backend.prepare_model(lambda x: x)  # type: ignore[arg-type]
