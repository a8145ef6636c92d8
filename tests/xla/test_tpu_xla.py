"""The TPU plugin against the real XLA runtime, on the CPU (PJRT_DEVICE=CPU): the same
runtime, compiler and device API as on a TPU. Run by `nox -s tests_xla`; skipped elsewhere."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Checked before importing torch_xla: its import sets PJRT_DEVICE for the whole process.
if os.environ.get("PJRT_DEVICE") != "CPU":
    pytest.skip("needs torch_xla and PJRT_DEVICE=CPU: run `nox -s tests_xla`",
                allow_module_level=True)
pytest.importorskip("torch_xla", reason="needs torch_xla: run `nox -s tests_xla`")

import torch
import torchbridge
from torch import nn
from torchbridge.testing import BackendContract


class TestXLABackendContract(BackendContract):
    backend_name = "tpu"

    def make_unavailable(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from torchbridge_tpu import probe

        monkeypatch.setattr(probe, "probe", lambda: probe.XlaIndication(False, None, None, True))


@pytest.fixture(scope="module")
def tpu() -> torchbridge.Backend:
    return torchbridge.get_backend("tpu")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))


def test_xla_on_cpu_is_available_below_plain_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    status = {s.name: s for s in torchbridge.list_backends()}["tpu"]
    assert status.available and status.device_count >= 1
    assert "XLA on CPU" in (status.reason or "")
    assert status.priority < {s.name: s for s in torchbridge.list_backends()}["cpu"].priority
    assert torchbridge.detect_best_backend() == "cpu"
    monkeypatch.setenv("TORCHBRIDGE_BACKEND", "tpu")
    assert torchbridge.get_backend().name == "tpu"


def test_device_info_and_memory_say_what_xla_on_cpu_is(tpu: torchbridge.Backend) -> None:
    info = tpu.get_device_info()
    assert info.name == "XLA:CPU" and info.extra["device_kind"] == "CPU"
    assert info.extra["device_count"] == tpu.device_count
    assert info.extra["world_size"] == 1 and info.extra["tpu_version"] is None
    assert info.extra["topology"] == "single" and info.architecture == "xla-cpu"
    assert info.preferred_low_precision_dtype == "bfloat16"
    stats = tpu.get_memory_stats()
    assert stats.allocated_bytes is None and stats.total_bytes is None  # unknown, not 0
    assert "UNIMPLEMENTED" in (stats.notes or "")
    assert tpu.distributed_backend == "xla"


def test_the_device_kind_is_read_from_torch_xlas_api(monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    """The PJRT device attributes hold no kind (on XLA:CPU only the device's name);
    xm.xla_device_kind() is where torch_xla reports it, and what names a TPU's generation."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torchbridge_tpu import probe

    assert not any("device_kind" in a for a in xr.global_runtime_device_attributes())
    # The real runtime, its kind answered as a v5e's: the generation follows the kind.
    with monkeypatch.context() as patched:
        patched.setattr(xm, "xla_device_hw", lambda device: "TPU")
        patched.setattr(xm, "xla_device_kind", lambda device=None: "TPU v5 lite")
        probe.xla_runtime.cache_clear()
        try:
            torchbridge.list_backends(rescan=True)
            info = torchbridge.get_backend("tpu").get_device_info()
            assert (info.name, info.architecture) == ("TPU v5 lite", "v5e")
            assert "int8" in info.supported_dtypes
        finally:
            probe.xla_runtime.cache_clear()
    torchbridge.list_backends(rescan=True)
    assert probe.xla_runtime().pjrt_device_kind == xm.xla_device_kind() == "cpu"
    assert torchbridge.get_backend("tpu").get_device_info().extra["pjrt_device_kind"] == "cpu"


def test_one_host_under_xmp_spawn_is_single_not_pod(tmp_path: Path) -> None:
    """torch_xla's multiprocessing on one machine: xr.world_size() counts the devices (2
    here), the host is still one."""
    code = """if True:
        import sys
        import torch_xla.distributed.xla_multiprocessing as xmp

        def run(index):
            import torch_xla.runtime as xr
            import torchbridge
            info = torchbridge.get_backend("tpu").get_device_info()
            # one write per line: on XLA:CPU the workers are threads of one process
            sys.stdout.write(f"{index} {xr.world_size()} {info.extra['topology']} "
                             f"{info.extra.get('host_count')}\\n")

        if __name__ == "__main__":
            xmp.spawn(run, args=())
    """
    script = tmp_path / "spawned.py"  # xmp.spawn's workers import `run` from a file
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env={**os.environ, "CPU_NUM_DEVICES": "2"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = sorted(line for line in out.stdout.splitlines() if line[:1].isdigit())
    assert lines == ["0 2 single 1", "1 2 single 1"], out.stdout


def test_graph_check_leaves_the_users_xla_counters_alone(tpu: torchbridge.Backend) -> None:
    import torch_xla.debug.metrics as met

    w = torch.randn(16, 16, device=tpu.device)
    for n in (3, 5, 7):  # the user's own work: new shapes, each compiled
        (torch.randn(n, 16, device=tpu.device) @ w).sum().item()
    compiles = met.counter_value("UncachedCompile")
    executions = met.metric_data("ExecuteTime")[0]
    result = tpu.optimize(mlp().eval(), "O1", sample_input=torch.randn(4, 32))
    assert "static graph" in " ".join(result.notes)  # judged on its own calls only
    assert met.counter_value("UncachedCompile") >= compiles
    assert met.metric_data("ExecuteTime")[0] >= executions


def test_the_compile_note_says_new_shapes_compile_again(tpu: torchbridge.Backend) -> None:
    import torch._dynamo
    import torch_xla.debug.metrics as met

    # config.patch, not monkeypatch: undoing monkeypatch's setattr on a torch config module
    # deletes the setting
    with torch._dynamo.config.patch(recompile_limit=2):
        model = tpu.prepare_model(mlp().eval(), "O2", sample_input=torch.randn(4, 32))
        report = torchbridge.optimization_result(model)
        assert report is not None
        note = next(n for n in report.notes if n.startswith("compile:"))
        assert "each new input shape" in note and "recompile_limit (2)" in note
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        compiles = met.counter_value("UncachedCompile") or 0
        with torch.no_grad():
            for batch in (1, 2, 3, 5):  # new shapes; the sample's (4) compiled already
                model(torch.randn(batch, 32).to(tpu.device)).cpu()
    # each new shape compiled; torch.compile took only those up to its limit of 2 graphs
    assert (met.counter_value("UncachedCompile") or 0) - compiles >= 4
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs <= 1


def test_levels_report_the_xla_passes(tpu: torchbridge.Backend) -> None:
    x = torch.randn(4, 32)
    o1 = tpu.optimize(mlp().eval(), "O1", sample_input=x)
    assert "static graph" in " ".join(o1.notes)
    o2 = tpu.optimize(mlp().eval(), "O2", sample_input=x)
    assert {"autocast", "compile"} <= set(o2.optimizations_applied)
    assert "openxla" in " ".join(o2.notes)
    assert o2.max_rel_diff is not None and o2.max_rel_diff < 3e-2


def test_graph_check_warns_about_host_round_trips_and_fallbacks(tpu: torchbridge.Backend
                                                               ) -> None:
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear(x)
            if y.sum().item() > 0:  # a host round trip on every call
                y = y * 2
            return y[torch.nonzero(y > 0, as_tuple=True)]  # a dynamic shape

    result = tpu.optimize(DataDependent().eval(), "O1", sample_input=torch.randn(4, 8))
    warnings = " ".join(result.notes)
    assert "transfer(s) from the device" in warnings
    assert "aten::nonzero" in warnings


def test_config_turns_xla_passes_off(tpu: torchbridge.Backend) -> None:
    config = torchbridge.TorchBridgeConfig.load(
        hardware={"tpu": {"compilation_mode": "torch_xla", "mixed_precision": False}})
    backend = torchbridge.get_backend("tpu", config)
    result = backend.optimize(mlp().eval(), "O3")
    detail = {p.name: p.detail for p in result.skipped}
    assert "compilation_mode is lazy" in detail["compile"]
    assert "mixed_precision is off" in detail["autocast"]


def test_training_on_xla_reduces_the_loss(tpu: torchbridge.Backend) -> None:
    import torch_xla

    for level in ("O0", "O2"):
        torch.manual_seed(0)
        x = torch.randn(64, 32)
        y = x @ torch.randn(32, 8)  # a target the model can learn
        model = tpu.prepare_model(mlp().train(), level)
        opt = torch.optim.Adam(model.parameters(), lr=3e-2)
        xd, yd = tpu.to_device((x, y))
        losses = []
        for _ in range(20):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(xd), yd)
            loss.backward()
            opt.step()
            torch_xla.sync()
            losses.append(loss.item())
        assert losses[-1] < 0.5 * losses[0], (level, losses)


def test_checkpoint_cpu_to_xla_to_cpu_is_identical(tpu: torchbridge.Backend,
                                                   tmp_path: Path) -> None:
    cpu_model = mlp()
    first = torchbridge.save_checkpoint(cpu_model, tmp_path / "cpu.pt")
    on_xla = torchbridge.load_checkpoint(first, backend="tpu")
    assert {t.device.type for t in on_xla.values()} == {"xla"}
    xla_model = copy.deepcopy(mlp()).to(tpu.device)
    xla_model.load_state_dict(on_xla)
    second = torchbridge.save_checkpoint(xla_model, tmp_path / "xla.pt")  # from XLA tensors
    back = torchbridge.load_checkpoint(second)
    for key, value in cpu_model.state_dict().items():
        assert back[key].device.type == "cpu"
        assert torch.equal(back[key], value)
    bf16 = torchbridge.load_checkpoint(second, backend=tpu, dtype=torch.bfloat16)
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}


def test_validate_cpu_against_xla() -> None:
    x = torch.randn(4, 32)
    report = torchbridge.validate(mlp().eval(), x, backends=["cpu", "tpu"])
    assert report.passed, report.summary()
    rel = report.results[1].outputs[0].max_rel_diff
    assert rel <= report.tolerance
    o2 = torchbridge.validate(mlp().eval(), x, backends=["cpu", "tpu"], level="O2")
    assert o2.passed and o2.tolerance == 3e-2, o2.summary()


def test_validate_cli_compares_cpu_with_xla() -> None:
    out = subprocess.run([sys.executable, "-m", "torchbridge", "validate", "--model",
                          "convnet", "--backends", "cpu,tpu"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS tpu (xla:0)" in out.stdout


def test_persistent_compilation_cache_fills_its_directory(tmp_path: Path) -> None:
    # XLA takes its cache directory once per process, before the first compilation: a
    # fresh process.
    code = """if True:
        import sys, torch, torchbridge
        from torch import nn
        config = torchbridge.TorchBridgeConfig.load(
            hardware={"tpu": {"enable_xla_cache": True, "cache_dir": sys.argv[1]}})
        backend = torchbridge.get_backend("tpu", config)
        result = backend.optimize(nn.Linear(16, 4).eval(), "O2")
        print({p.name: p.status for p in result.passes}["xla_compilation_cache"])
        with torch.no_grad():
            result.model(torch.randn(2, 16).to(backend.device)).cpu()
    """
    cache = tmp_path / "xla-cache"
    out = subprocess.run([sys.executable, "-c", code, str(cache)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("applied")
    assert any(cache.iterdir())  # compiled programs were written


def test_check_compatibility_runs_the_model_on_xla_for_real() -> None:
    """A host round trip (.item()) in forward: XLA's own counters see the graph break."""

    class HostSync(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear(x)
            return y * float(y.abs().max().item())

    report = torchbridge.check_compatibility(HostSync(), torch.randn(4, 8), "tpu")
    assert any(i.what == "XLA graph" for i in report.issues) or \
        any(n.startswith("ran on XLA") for n in report.notes), report.summary()
    assert "torch_xla is not installed" not in " ".join(report.notes)


def test_the_compiled_model_on_xla_is_the_users_own(tpu: torchbridge.Backend) -> None:
    model = mlp()
    model.label = "mine"  # type: ignore[assignment]
    x = torch.randn(4, 32)
    prepared = tpu.prepare_model(model, "O2", sample_input=x)
    report = torchbridge.optimization_result(prepared)
    assert report is not None and "compile" in report.optimizations_applied
    assert type(prepared) is type(model) and prepared.label == "mine"
    torch.testing.assert_close(prepared(x.to(tpu.device)).cpu(), model(x), rtol=2e-2,
                               atol=1e-2)  # O2 computes in bf16 on XLA
