""""Applied" means observed: every built-in pass of every plugin, on every recorded device,
reported applied only where its effect is there to see on the prepared model, its report or
the process. Each pass name has an oracle below, written from outside the pass; a pass
without one fails the walk, so a new pass cannot report applied unchecked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchbridge
from test_amd import RECORDED as AMD_RECORDED
from test_amd import FakeGPUs as FakeAMDGPUs
from test_amd import rocm_flags  # noqa: F401  (a fixture, used by name)
from test_contract_recorded import hipblaslt_env  # noqa: F401  (a fixture, used by name)
from test_intel import RECORDED as INTEL_RECORDED
from test_intel import FakeXPUs
from test_nvidia import RECORDED as NVIDIA_RECORDED
from test_nvidia import FakeGPUs as FakeNVIDIAGPUs
from test_nvidia import gpu_flags  # noqa: F401  (a fixture, used by name)
from torch import nn
from torchbridge.optimize.forward import compile_state
from torchbridge.optimize.report import OptimizationResult
from torchbridge.optimize.transformer import CompositeEncoderLayer

Oracle = Callable[[OptimizationResult, Any], bool]


def _setting(name: str, value: Any) -> Oracle:
    return lambda r, info: any(c.name == name and c.after == value
                               for c in r.process_settings)


def _compiled_with(where: str, option: str) -> Oracle:
    def check(r: OptimizationResult, info: Any) -> bool:
        state = compile_state(r.model)
        return state is not None and bool(getattr(state, where).get(option))
    return check


def _tf32(r: OptimizationResult, info: Any) -> bool:
    """TF32 set for the model's calls, on a device that has it (by the device's own facts:
    Ampere or newer on NVIDIA, gfx94x/gfx95x on AMD, extra["tf32"] on Intel)."""
    if r.backend == "xpu":
        return bool(info.extra.get("tf32")) and _setting(
            "torch.backends.mkldnn.allow_tf32", True)(r, info)
    has = info.extra.get("tf32") if r.backend == "rocm" else \
        info.architecture in ("ampere", "ada", "hopper", "blackwell")
    return bool(has) and _setting("torch.backends.cuda.matmul.allow_tf32", True)(r, info)


ORACLES: dict[str, Oracle] = {
    "device_placement": lambda r, info: all(
        t.device.type == torch.device(info.device).type
        for t in [*r.model.parameters(), *r.model.buffers()]),
    "conv_bn_folding": lambda r, info: not any(
        type(m) is nn.BatchNorm2d for m in r.model.modules()),
    "channels_last": lambda r, info: all(
        m.weight.is_contiguous(memory_format=torch.channels_last)
        for m in r.model.modules() if isinstance(m, nn.Conv2d)),
    "transformer_composite": lambda r, info: any(
        isinstance(m, CompositeEncoderLayer) for m in r.model.modules()),
    "autocast": lambda r, info: "forward" in r.model.__dict__,
    "low_precision_weights": lambda r, info: any(
        isinstance(m, nn.Linear) and m.weight.dtype in (torch.bfloat16, torch.float16)
        for m in r.model.modules()),
    "compile": lambda r, info: compile_state(r.model) is not None,
    "max_autotune": _compiled_with("options", "max_autotune"),
    "inference_freezing": _compiled_with("inductor_config", "freezing"),
    "compile_value_check": lambda r, info: any(
        n.startswith("compile_value_check: measured") for n in r.notes),
    "kernel_substitution": lambda r, info: any(
        s.get("status") == "substituted" for s in r.kernel_substitutions),
    "cudnn_benchmark": _setting("torch.backends.cudnn.benchmark", True),
    "tf32": _tf32,
    "rocm_blas_library": lambda r, info: any(
        c.name == "torch.backends.cuda.preferred_blas_library()"
        for c in r.process_settings),
    "rocm_flash_attention": lambda r, info: any(
        c.name == "torch.backends.cuda.preferred_rocm_fa_library()"
        for c in r.process_settings),
    "fp8_linear": lambda r, info: any("FP8" in type(m).__name__ for m in r.model.modules()),
    "ipex_optimize": lambda r, info: False,  # not installed here: never applied
    "example_tag": lambda r, info: getattr(r.model, "tagged_by_example", False) is True,
}


def models() -> list[tuple[str, nn.Module, Any]]:
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 10)).eval()
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True),
                                    1, enable_nested_tensor=False).eval()
    mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval()
    return [("conv", conv, torch.randn(2, 3, 8, 8)), ("encoder", encoder,
                                                      torch.randn(2, 5, 32)),
            ("mlp", mlp, torch.randn(4, 64))]


def walk(backend: torchbridge.Backend, levels: tuple[str, ...] = ("O1", "O2", "O3"),
         sample: bool = False) -> list[str]:
    """Every applied pass whose effect its oracle does not see, as 'level model pass'."""
    info = backend.get_device_info()
    wrong = []
    for level in levels:
        for name, model, x in models():
            result = backend.optimize(model, level, sample_input=x if sample else None)
            for record in result.applied:
                oracle = ORACLES.get(record.name)
                if oracle is None or not oracle(result, info):
                    wrong.append(f"{level} {name} {record.name} ({record.plugin}): "
                                 f"{'no oracle' if oracle is None else 'no effect seen'}")
    return wrong


def _no_device_passes() -> torchbridge.TorchBridgeConfig:
    # No GPU to place on or compile for: with compile disabled, its options must skip.
    return torchbridge.TorchBridgeConfig.load(
        optimization={"disabled_passes": ["device_placement", "compile"]})


@pytest.mark.usefixtures("gpu_flags")
@pytest.mark.parametrize("gpu", list(NVIDIA_RECORDED))
def test_nvidia_passes_report_applied_only_with_their_effect(
        monkeypatch: pytest.MonkeyPatch, gpu: str) -> None:
    FakeNVIDIAGPUs(monkeypatch, gpu)
    assert walk(torchbridge.get_backend("cuda", _no_device_passes())) == []


@pytest.mark.usefixtures("rocm_flags", "hipblaslt_env")
@pytest.mark.parametrize("gpu", list(AMD_RECORDED))
def test_amd_passes_report_applied_only_with_their_effect(
        monkeypatch: pytest.MonkeyPatch, gpu: str) -> None:
    FakeAMDGPUs(monkeypatch, gpu)
    assert walk(torchbridge.get_backend("rocm", _no_device_passes())) == []


@pytest.mark.parametrize("gpu", list(INTEL_RECORDED))
def test_intel_passes_report_applied_only_with_their_effect(
        monkeypatch: pytest.MonkeyPatch, gpu: str) -> None:
    FakeXPUs(monkeypatch, gpu)
    assert walk(torchbridge.get_backend("xpu", _no_device_passes())) == []


def test_intel_tf32_on_a_torch_that_ignores_it_is_not_applied(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU torch ignores torch.backends.mkldnn.allow_tf32 (no Intel GPU support): a Max
    1550 whose torch does the same gets no TF32, and the report says so."""
    fake = FakeXPUs(monkeypatch, "Max 1550")
    monkeypatch.setattr(fake, "_set_tf32", lambda allowed: None)  # the setter does nothing
    from torchbridge_intel import probe
    monkeypatch.setattr(probe, "enable_tf32", lambda: None)
    result = torchbridge.get_backend("xpu", _no_device_passes()).optimize(
        nn.Linear(8, 8).eval(), "O2")
    record = next(p for p in result.passes if p.name == "tf32")
    assert record.status == "skipped" and "torch did not take" in record.detail


@pytest.mark.slow
def test_cpu_passes_report_applied_only_with_their_effect() -> None:
    # With sample inputs: compile runs (or compile_value_check skips it) for real here.
    assert walk(torchbridge.get_backend("cpu"), levels=("O1", "O3"), sample=True) == []


def test_compile_options_without_compile_are_not_applied() -> None:
    cfg = torchbridge.TorchBridgeConfig.load(optimization={"disabled_passes": ["compile"]})
    result = torchbridge.get_backend("cpu", cfg).optimize(
        nn.Sequential(nn.Linear(8, 8)).eval(), "O3")
    status = {p.name: (p.status, p.detail) for p in result.passes}
    assert status["inference_freezing"] == (
        "skipped", "compile is disabled by config optimization.disabled_passes")
