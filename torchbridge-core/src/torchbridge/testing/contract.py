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

Kernels, ops and module patterns are covered too: every kernel implementation eligible on the
backend matches its op's reference on `op_inputs` (several shapes, more than 64 rows) in
each dtype it declares, without writing into its arguments or returning one
(`kernels_known_wrong` names those expected to differ); the ops
plugins declare are registered as `torch.ops.torchbridge.<name>` with a reference; each
module pattern whose op has an implementation for the backend builds, for a module it
matches (`pattern_modules`), inputs its op accepts and a forward equal to the module's own.
prepare_model also runs without a sample input, and `distributed_backend` must name a
backend torch.distributed knows.
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
from torchbridge.backend import DEVICE_HOOKS, impossible_device_info, impossible_memory_stats
from torchbridge.config import hardware_sections
from torchbridge.devices import device_module
from torchbridge.levels import LEVEL_TOLERANCE, OptimizationLevel


def small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).eval()


def _args(sample: Any) -> tuple[Any, ...]:
    return sample if isinstance(sample, tuple) else (sample,)


def _relative_error(got: Any, expected: Any) -> tuple[float, str | None]:
    """(max |got - expected| / max |expected| over the outputs, what differs in kind: the
    structure, a shape or a dtype; None when they agree in kind)."""
    gots = got if isinstance(got, (tuple, list)) else (got,)
    exps = expected if isinstance(expected, (tuple, list)) else (expected,)
    if len(gots) != len(exps):
        return float("inf"), f"{len(gots)} outputs, the reference gives {len(exps)}"
    worst = 0.0
    for g, e in zip(gots, exps, strict=True):
        if not isinstance(g, torch.Tensor) or not isinstance(e, torch.Tensor):
            return float("inf"), f"returned {type(g).__name__}, expected a tensor"
        if g.dtype != e.dtype:
            return float("inf"), f"wrong dtype: {g.dtype}, the reference gives {e.dtype}"
        if g.shape != e.shape:
            return float("inf"), f"wrong shape: {tuple(g.shape)}, expected {tuple(e.shape)}"
        scale = e.detach().abs().max().float().item() if e.numel() else 0.0
        diff = (g.detach().float() - e.detach().float()).abs().max().item() if e.numel() else 0.0
        error = diff / (scale or 1.0)
        worst = max(worst, error if error == error else float("inf"))
    return worst, None


def _schema_inputs(op: str, dtype: torch.dtype, device: torch.device, rows: int, width: int
                   ) -> tuple[Any, ...] | None:
    """Inputs for an op the contract has no recipe for, from its schema: each tensor
    (rows, width), an optional one None, other arguments their defaults; None when an
    argument has no default and is not a tensor."""
    from torchbridge.kernels.ops import arguments

    out: list[Any] = []
    for argument in arguments(op):
        kind = str(argument.type)
        if kind == "Tensor":
            out.append(torch.randn(rows, width, dtype=dtype, device=device))
        elif argument.has_default_value():
            out.append(argument.default_value)
        elif kind.startswith("Optional["):
            out.append(None)
        else:
            return None
    return tuple(out)


def core_op_inputs(op: str, dtype: torch.dtype, device: torch.device
                   ) -> list[tuple[Any, ...]] | None:
    """Probe inputs of the core's ops: a small call and one with more than 64 rows and an
    odd width; None for an op that is not the core's."""
    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device)

    out: list[tuple[Any, ...]] = []
    for rows, width in ((4, 64), (130, 96)):
        if op == "rms_norm":
            out += [(t(rows, width) + 3.0, t(width), 1e-6), (t(2, rows, width), None, 1e-5)]
        elif op == "add_rms_norm":
            out.append((t(rows, width), t(rows, width), t(width), 1e-6))
        elif op == "silu_mul":
            out.append((t(rows, width), t(rows, width)))
        elif op == "rotary_embedding":
            out.append((t(2, 4, rows, width), t(rows, width), t(rows, width)))
        elif op == "scaled_dot_product_attention":
            q = (t(2, 4, rows, 32), t(2, 4, rows, 32), t(2, 4, rows, 32))
            out += [(*q, None, False, None, False), (*q, None, True, None, False)]
        elif op == "linear":
            out.append((t(rows, width), t(48, width), t(48)))
        else:
            return None
    return out


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

    kernels_known_wrong: ClassVar[tuple[str, ...]] = ()
    """Names of kernel implementations known to differ from their reference (kept to show
    that the gate refuses them): the kernel test asserts that they do differ."""

    def op_inputs(self, op: str, dtype: torch.dtype, device: torch.device
                  ) -> list[tuple[Any, ...]]:
        """Positional arguments to check implementations of `op` on: the core's ops have
        recipes (`core_op_inputs`); another op gets, from its schema, tensors of (4, 64) and
        (130, 96) (every tensor the same shape). Override for an op of yours whose tensors
        differ in shape; [] leaves the op's kernels unchecked (the test says so)."""
        core = core_op_inputs(op, dtype, device)
        if core is not None:
            return core
        found = [_schema_inputs(op, dtype, device, rows, width)
                 for rows, width in ((4, 64), (130, 96))]
        return [args for args in found if args is not None]

    def pattern_modules(self) -> list[nn.Module]:
        """Modules for the module-pattern test to match patterns against: the submodules of
        `make_model`'s model and a few stock ones (nn.RMSNorm, nn.MultiheadAttention).
        Add a module of each kind your plugin's patterns recognise."""
        model, _ = self.make_model()
        stock: list[nn.Module] = [nn.MultiheadAttention(32, 4, batch_first=True).eval()]
        if hasattr(nn, "RMSNorm"):
            stock.append(nn.RMSNorm(64).eval())
        return [*model.modules(), *stock]

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
        # What no device can report (dtype names torch lacks, a preferred dtype it does not
        # list, more available than total): the check every answer gets at run time.
        problem = impossible_device_info(info)
        assert problem is None, problem
        for gb in (info.memory_total_gb, info.memory_available_gb):
            assert gb is None or gb > 0

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
            from torchbridge.plugins import plugin_records

            record = next((r for r in plugin_records() if r.name == backend.plugin), None)
            rejected = [e for e in (record.errors if record else [])
                        if e.startswith("in torchbridge_config_section")]
            assert not rejected, f"the config section was rejected: {rejected[0]}"
            pytest.skip(f"plugin {backend.plugin} contributes no config section")
        section = backend.hardware_config
        assert section is not None
        defaults = type(section)()  # every field has a default
        # ... that its own constraints accept: pydantic does not check defaults, and a
        # bad one failed only later, where the config was pickled for a worker.
        type(section).model_validate(defaults.model_dump(by_alias=True))
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
        # An answer no device can give (negative or non-integer bytes, free over total) is
        # refused at run time as the plugin's error, and the stats come back unanswered,
        # their notes saying why.
        assert backend.answered_by.get("torchbridge_memory_stats"), stats.notes
        problem = impossible_memory_stats(stats)
        assert problem is None, problem
        for name in ("allocated", "reserved", "peak_allocated", "free", "total"):
            value = getattr(stats, f"{name}_bytes")
            mb = stats[name]
            assert (mb is None) if value is None else mb == pytest.approx(value / 2**20)
        if None in (stats.allocated_bytes, stats.free_bytes):
            assert stats.notes, "a figure the backend cannot know needs a note saying why"

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
                try:
                    context = backend.autocast()
                except RuntimeError as exc:  # a CUDA build asks the (absent) device
                    pytest.skip(f"{self.recorded}: this torch checks the device when an "
                                f"autocast context is made ({exc})")
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

        from torchbridge.optimize.pipeline import run_pipeline

        self.needs_the_device("compiling runs the sample input on the device")

        def prepared_is_fastest(label: str, call: Callable[[], Any]) -> float:
            """The keep-the-fastest timer, answering that the prepared (compiled) model is
            fastest: on the wall clock, whether compile is kept would depend on the
            machine's speed and load, and this test would skip or run by chance."""
            call()
            return 1.0 if label == "prepared" else 2.0

        model, x = self.make_model()
        before = counters["stats"]["unique_graphs"]
        result = run_pipeline(backend, model, "O2", sample_input=x, timer=prepared_is_fastest)
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

    # --- kernels, ops, module patterns -----------------------------------------------------

    def test_declared_ops_are_registered_with_references(
            self, backend: torchbridge.Backend) -> None:
        """Each op a plugin declares (`torchbridge_ops`) is `torch.ops.torchbridge.<name>`
        with a callable reference, and its implementations can name it."""
        import torchbridge.kernels.ops as ops_module
        from torchbridge.kernels import reference
        from torchbridge.kernels.choice import known_ops
        from torchbridge.plugins import get_plugin_host

        known = known_ops()
        declared = [(plugin, d) for plugin, definitions in get_plugin_host().call_each(
            "torchbridge_ops") for d in definitions
            if isinstance(d, ops_module.OpDefinition)]
        for plugin, definition in declared:
            name = definition.name
            assert name in known, (f"op {name!r} declared by plugin {plugin} is not "
                                   f"registered: see doctor for the plugin's error")
            assert hasattr(getattr(torch.ops, ops_module.NAMESPACE), name), name
            assert callable(reference(name))
            assert ops_module.schema(name).startswith("(")
        for op in known:
            assert callable(reference(op)), op

    def test_kernels_match_their_references(self, backend: torchbridge.Backend) -> None:
        """Every implementation eligible on this backend, in each dtype it declares (none
        declared: float32 and the backend's low-precision dtype), gives the reference's
        dtype, shape and numbers (the kernel gate's tolerance) on `op_inputs`, leaves its
        arguments unchanged and returns none of them (nor a view of one)."""
        from torchbridge.kernels import reference as op_reference
        from torchbridge.kernels.choice import choose, known_ops
        from torchbridge.kernels.implementations import (
            TOLERANCES,
            snapshot_inputs,
            write_problem,
        )

        self.needs_the_device("kernels run on the device")
        info = backend.get_device_info()
        supported = {getattr(torch, d) for d in info.supported_dtypes}
        failures, unchecked, checked, known_wrong_ok = [], [], 0, set()
        for op in known_ops():
            for candidate in choose(op, backend, info=info).candidates:
                impl = candidate.implementation
                if candidate.reason is not None:
                    continue  # not eligible here: doctor and `torchbridge kernels` say why
                low = backend.low_precision_dtype(info)
                dtypes = impl.dtypes or (torch.float32, *((low,) if low is not None else ()))
                kernel = choose(op, backend, info=info).bound(candidate)
                reference = op_reference(op)
                label = f"{impl.name} (plugin {candidate.provider}) for {op}"
                for dtype in (d for d in dtypes if d in supported):
                    calls = self.op_inputs(op, dtype, backend.device)
                    if not calls:
                        unchecked.append(f"{label} in {dtype}")
                    for args in calls:
                        torch.manual_seed(0)
                        with torch.no_grad():
                            expected = reference(*args)  # before the kernel can write
                            before = snapshot_inputs(op, args)
                            try:
                                got = kernel(*args)
                            except Exception as exc:
                                failures.append(f"{label} in {dtype} raised "
                                                f"{type(exc).__name__}: {exc}")
                                continue
                        error, misfit = _relative_error(got, expected)
                        misfit = write_problem(got, before) or misfit
                        checked += 1
                        tol = TOLERANCES.get(dtype, 1e-4)
                        if impl.name in self.kernels_known_wrong:
                            if misfit or not error <= tol:
                                known_wrong_ok.add(impl.name)
                        elif misfit:
                            failures.append(f"{label} in {dtype}: {misfit}")
                        elif not error <= tol:
                            shape = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
                            failures.append(f"{label} in {dtype} on {shape}: differs from "
                                            f"the reference by {error:.3g} (tolerance {tol:g})")
        missing = set(self.kernels_known_wrong) - known_wrong_ok
        assert not missing, f"kernels_known_wrong {sorted(missing)} matched their reference"
        assert not failures, "\n".join(failures)
        if unchecked and not checked:
            pytest.skip("no probe inputs for: " + "; ".join(unchecked) + " (override op_inputs)")

    def test_module_patterns_build_inputs_their_op_accepts(
            self, backend: torchbridge.Backend) -> None:
        """Each module pattern whose op has an implementation for this backend: for a module
        it matches (`pattern_modules`), `example_input` builds arguments the pattern's
        forward passes to the op (torch.ops.torchbridge.<op>, which checks them against its
        schema), and that forward computes what the module itself does."""
        from torchbridge.kernels.choice import contributed
        from torchbridge.optimize.kernel_patterns import ModulePattern
        from torchbridge.plugins import get_plugin_host

        patterns = [(plugin, p) for plugin, found in get_plugin_host().call_each(
            "torchbridge_module_patterns", backend=backend) if isinstance(found, (list, tuple))
            for p in found if isinstance(p, ModulePattern)]
        relevant = [(plugin, p) for plugin, p in patterns if any(
            impl.backends is None or backend.name in impl.backends
            for _, impl in contributed(p.op, backend))]
        if not relevant:
            pytest.skip(f"no module pattern has an op with an implementation for {backend.name}")
        modules = self.pattern_modules()
        problems = []
        for plugin, pattern in relevant:
            op = getattr(torch.ops.torchbridge, pattern.op)
            matched = [(m, f) for m in modules for f in [pattern.match(m)] if f is not None]
            if not matched:
                problems.append(f"pattern {pattern.name} (plugin {plugin}) matches none of "
                                "pattern_modules(): add a module it recognises")
                continue
            module, facts = matched[0]
            dtype = next((p.dtype for p in module.parameters()), torch.float32)
            calls: list[tuple[Any, ...]] = []

            def the_op(*args: Any, _calls: list[tuple[Any, ...]] = calls, _op: Any = op,
                       **kwargs: Any) -> Any:
                _calls.append(args)
                return _op(*args, **kwargs)

            try:
                torch.manual_seed(0)
                args = pattern.example_input(module, facts, dtype)
                with torch.no_grad():
                    out = pattern.forward(module, the_op, facts, *args)
                    own = module(*args)
            except Exception as exc:
                problems.append(f"pattern {pattern.name} (plugin {plugin}): "
                                f"{type(exc).__name__}: {exc}")
                continue
            if not calls:
                problems.append(f"pattern {pattern.name}: its forward never called {pattern.op}")
                continue
            compare = pattern.compared or (lambda o: o)
            error, misfit = _relative_error(compare(out), compare(own))
            if misfit or not error <= 1e-4:
                problems.append(f"pattern {pattern.name} (plugin {plugin}): its forward with "
                                f"the op differs from the module's own: {misfit or error}")
        assert not problems, "\n".join(problems)

    # --- prepare_model without a sample input, distributed backend ------------------------

    @pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
    def test_prepare_model_without_a_sample_input(self, backend: torchbridge.Backend,
                                                  level: str) -> None:
        """What most users do: no sample input. The passes check themselves on synthetic
        inputs; the prepared model then runs and matches the original."""
        if level not in self.levels:
            pytest.skip(f"{level} not claimed by this backend's contract run")
        self.needs_the_device("the prepared model runs on the device (the recording's "
                              "report without a sample input is test_prepare_model_matches_"
                              "reference)")
        model, x = self.make_model()
        with torch.no_grad():
            expected = model(*_args(x))
        result = backend.optimize(model, level)
        assert not result.failed, f"passes failed: {result.failed}"
        with torch.no_grad():
            got = result.model(*backend.to_device(_args(x))).float().cpu()
        rel = ((got - expected).abs().max() / expected.abs().max()).item()
        assert rel <= LEVEL_TOLERANCE[level], f"{level} without a sample input: drift {rel:.3g}"

    def test_distributed_backend_is_known_to_torch(self, backend: torchbridge.Backend) -> None:
        """`distributed_backend` names a backend torch.distributed has: built in
        (dist.Backend.backend_list) or registered with dist.Backend.register_backend."""
        import torch.distributed as dist

        name = backend.distributed_backend
        if name is None:
            pytest.skip(f"{backend.name} names no distributed backend on this torch")
        assert isinstance(name, str) and name
        if not dist.is_available():
            pytest.skip("this torch is built without torch.distributed")
        known = [b for b in dist.Backend.backend_list if b != "undefined"]
        assert name.lower() in known, (
            f"{backend.name}'s distributed_backend {name!r} is not a torch.distributed "
            f"backend (known: {', '.join(known)}); register it with "
            "dist.Backend.register_backend before returning it")
