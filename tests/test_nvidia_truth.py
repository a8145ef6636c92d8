"""The NVIDIA plugin says what is true of the device, in every place that answers: the
FlashAttention3 module and the kernel registry agree on which flash-attn can run, a
capability outside the plugin's table is described as such (not as a GPU without FP8), and
hardware.nvidia.architecture reaches DeviceInfo and autocast as well as the passes.
No GPU here: recorded properties at the probe seam, as in test_nvidia.py."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torchbridge
from test_nvidia import (
    GB,
    FakeGPUs,
    gpu_flags,  # noqa: F401  (a fixture, used by name below)
)
from torch import nn
from torchbridge.kernels.choice import choose
from torchbridge_nvidia import attention, kernels
from torchbridge_nvidia.errors import FlashAttentionError, InvalidArchitectureError
from torchbridge_nvidia.probe import CUDAProperties

# Written by hand from NVIDIA's published facts, not captured from a device: Jetson Thor is
# compute capability 10.1 under CUDA 12.x and 11.0 from CUDA 13.0 (CUTLASS 4.2 changelog;
# NVIDIA MathDx release notes), an RTX 5090 is 12.0 (CUDA GPUs list); 13.0 is no GPU yet.
THOR_CUDA12 = CUDAProperties("NVIDIA Thor", 10, 1, 20, 122 * GB)
THOR_CUDA13 = CUDAProperties("NVIDIA Thor", 11, 0, 20, 122 * GB)
RTX_5090 = CUDAProperties("NVIDIA GeForce RTX 5090", 12, 0, 170, 31 * GB)
FUTURE = CUDAProperties("Future GPU", 13, 0, 200, 300 * GB)
NOT_IN_TABLE = ("compute capability 13.0 is not in the NVIDIA plugin's table of "
                "architectures")


def _gpu(monkeypatch: pytest.MonkeyPatch, gpu: str | CUDAProperties) -> FakeGPUs:
    """The probe seam answering for a recorded GPU (a key of test_nvidia.RECORDED) or for
    the given properties; torch.cuda.get_device_capability answers the same."""
    fake = FakeGPUs(monkeypatch, "H100" if isinstance(gpu, CUDAProperties) else gpu)
    if isinstance(gpu, CUDAProperties):
        fake.props = gpu
        fake.free = gpu.total_memory - 2 * GB  # free within its own total
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: (fake.props.major, fake.props.minor))
    return fake


def _report(backend: torchbridge.Backend, model: nn.Module) -> dict[str, tuple[str, str]]:
    return {p.name: (p.status, p.detail) for p in backend.optimize(model, "O3").passes}


def _config(**config: Any) -> torchbridge.TorchBridgeConfig:
    # No GPU to place on or compile for: those two passes are the core's.
    return torchbridge.TorchBridgeConfig.load(
        optimization={"disabled_passes": ["device_placement", "compile"]}, **config)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval()


# -- FlashAttention3 never picks a flash-attn the GPU cannot run ---------------------------
def _module(monkeypatch: pytest.MonkeyPatch, version: str = "auto",
            flash_attn_3: bool = False) -> attention.FlashAttention3:
    monkeypatch.setattr(attention, "_flash_attn_2", lambda: object())  # installed
    monkeypatch.setattr(attention, "_flash_attn_3",
                        lambda: object() if flash_attn_3 else None)
    return attention.FlashAttention3(64, 4, version=version).eval()


# select_path reads only the query's device and dtype; a CUDA tensor cannot be made here.
CUDA_QUERY: Any = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float16,
                                  shape=(2, 10, 4, 16))


def test_auto_on_turing_falls_back_to_sdpa_and_says_why(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    _gpu(monkeypatch, "T4")  # 7.5: flash-attn 2 refuses it ("Ampere GPUs or newer")
    path, reason = _module(monkeypatch).select_path(CUDA_QUERY, has_mask=False)
    assert path == "sdpa"
    assert "flash-attn 2 needs compute capability 8.0 (Ampere) or newer; the device has " \
           "7.5" in reason
    assert "flash-attn 3 (flash_attn_interface) is not installed" in reason


def test_a_named_version_the_gpu_cannot_run_is_an_error_naming_the_capability(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu(monkeypatch, "V100")
    with pytest.raises(FlashAttentionError, match=r"version='2'.*needs compute capability "
                                                  r"8\.0 \(Ampere\) or newer; the device "
                                                  r"has 7\.0"):
        _module(monkeypatch, version="2").select_path(CUDA_QUERY, has_mask=False)
    _gpu(monkeypatch, "B200")
    with pytest.raises(FlashAttentionError, match=r"version='3'.*built for Hopper \(compute "
                                                  r"capability 9\.0\) only; the device has "
                                                  r"10\.0"):
        _module(monkeypatch, version="3", flash_attn_3=True).select_path(CUDA_QUERY, False)


def test_the_module_still_runs_flash_attn_where_it_can(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    _gpu(monkeypatch, "A100")
    assert _module(monkeypatch, flash_attn_3=True).select_path(CUDA_QUERY, False) == (
        "flash_attn_2", "flash-attn 2")
    _gpu(monkeypatch, "H100")
    assert _module(monkeypatch, flash_attn_3=True).select_path(CUDA_QUERY, False) == (
        "flash_attn_3", "flash-attn 3 on Hopper")
    _gpu(monkeypatch, "B200")
    assert _module(monkeypatch, flash_attn_3=True).select_path(CUDA_QUERY, False)[0] == \
        "flash_attn_2"


def test_module_and_kernel_registry_agree_on_every_recorded_gpu(
        monkeypatch: pytest.MonkeyPatch, installed_flash_attn: None) -> None:
    """The module runs flash-attn exactly where the registry calls it eligible."""
    for gpu in ("V100", "T4", "A100", "L4", "H100", "B200"):
        _gpu(monkeypatch, gpu)
        chosen = choose("scaled_dot_product_attention", torchbridge.get_backend("cuda"),
                        dtype=torch.float16).chosen
        registry = chosen.implementation.name if chosen is not None else "sdpa"
        path, _ = _module(monkeypatch, flash_attn_3=True).select_path(CUDA_QUERY, False)
        assert (gpu, path) == (gpu, registry)


# -- flash_attn_3 is not eligible off Hopper, so flash_attn_2 is chosen --------------------
@pytest.fixture
def installed_flash_attn(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(kernels, "_missing", lambda module, package: None)
    kernels.implementations.cache_clear()  # made once per process; remade with the patch
    yield
    kernels.implementations.cache_clear()


def _attention_choice(monkeypatch: pytest.MonkeyPatch, gpu: str | CUDAProperties
                      ) -> tuple[str | None, dict[str, str | None]]:
    _gpu(monkeypatch, gpu)
    choice = choose("scaled_dot_product_attention", torchbridge.get_backend("cuda"),
                    dtype=torch.bfloat16)
    reasons = {c.implementation.name: c.reason for c in choice.candidates
               if c.provider == "nvidia"}
    return (choice.chosen.implementation.name if choice.chosen else None), reasons


@pytest.mark.parametrize("gpu", ["B200", RTX_5090, THOR_CUDA13],
                         ids=["B200", "RTX 5090", "Thor"])
def test_on_blackwell_flash_attn_2_is_chosen_and_the_table_says_why_not_3(
        monkeypatch: pytest.MonkeyPatch, installed_flash_attn: None,
        gpu: str | CUDAProperties) -> None:
    chosen, reasons = _attention_choice(monkeypatch, gpu)
    assert chosen == "flash_attn_2"
    assert reasons == {"flash_attn_3": "built for hopper; the device is blackwell",
                       "flash_attn_2": None}


def test_on_hopper_flash_attn_3_is_still_chosen(monkeypatch: pytest.MonkeyPatch,
                                               installed_flash_attn: None) -> None:
    assert _attention_choice(monkeypatch, "H100")[0] == "flash_attn_3"
    chosen, reasons = _attention_choice(monkeypatch, FUTURE)  # not in the table
    assert chosen == "flash_attn_2"
    assert reasons["flash_attn_3"] == "built for hopper; the device is unknown"


# -- a capability outside the table is said to be outside the table ------------------------
@pytest.mark.parametrize("thor", [THOR_CUDA12, THOR_CUDA13], ids=["10.1", "11.0"])
@pytest.mark.usefixtures("gpu_flags")  # passes set process-wide TF32 flags
def test_thor_under_either_cuda_is_blackwell(monkeypatch: pytest.MonkeyPatch,
                                             thor: CUDAProperties) -> None:
    _gpu(monkeypatch, thor)
    backend = torchbridge.get_backend("cuda", _config())
    info = backend.get_device_info()
    assert (info.architecture, info.preferred_low_precision_dtype, info.notes) == (
        "blackwell", "bfloat16", None)
    assert info.supported_dtypes == ["float32", "float16", "bfloat16", "float8_e4m3fn",
                                     "float8_e5m2"]
    report = _report(backend, _mlp())
    assert report["fp8_linear"][0] == report["tf32"][0] == report["autocast"][0] == "applied"


@pytest.mark.usefixtures("gpu_flags")  # passes set process-wide TF32 flags
def test_an_unknown_capability_is_not_called_a_gpu_without_fp8(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu(monkeypatch, FUTURE)
    backend = torchbridge.get_backend("cuda", _config())
    info = backend.get_device_info()
    assert (info.architecture, info.supported_dtypes) == ("unknown", ["float32"])
    assert info.notes == f"{NOT_IN_TABLE}; no low-precision dtype assumed (set " \
                         "hardware.nvidia.architecture if you know it)"
    report = _report(backend, _mlp())
    assert report["fp8_linear"] == ("skipped", f"{NOT_IN_TABLE}; no FP8 assumed (set "
                                               "hardware.nvidia.architecture if you know it)")
    assert report["tf32"] == ("skipped", f"{NOT_IN_TABLE}; no TF32 assumed (set "
                                         "hardware.nvidia.architecture if you know it)")
    asked = torchbridge.get_backend("cuda", _config(hardware={"nvidia": {"fp8_enabled": True}}))
    assert _report(asked, _mlp())["fp8_linear"][1].startswith(
        f"config hardware.nvidia.fp8_enabled=True, but {NOT_IN_TABLE}")
    strict = torchbridge.get_backend(
        "cuda", _config(strict=True, hardware={"nvidia": {"fp8_enabled": True}}))
    with pytest.raises(InvalidArchitectureError, match="not in the NVIDIA plugin's table"):
        strict.optimize(_mlp(), "O3")


# -- hardware.nvidia.architecture gives DeviceInfo, autocast and passes one answer ---------
@pytest.mark.usefixtures("gpu_flags")  # passes set process-wide TF32 flags
def test_configured_architecture_reaches_device_info_and_autocast(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu(monkeypatch, FUTURE)
    backend = torchbridge.get_backend(
        "cuda", _config(hardware={"nvidia": {"architecture": "blackwell"}}))
    info = backend.get_device_info()
    assert (info.architecture, info.compute_capability) == ("blackwell", "13.0")
    assert info.preferred_low_precision_dtype == "bfloat16"
    assert "float8_e4m3fn" in info.supported_dtypes
    assert info.notes == f"{NOT_IN_TABLE}; treated as blackwell (hardware.nvidia.architecture)"
    assert backend.low_precision_dtype() == torch.bfloat16
    report = _report(backend, _mlp())
    assert report["fp8_linear"][0] == report["tf32"][0] == report["autocast"][0] == "applied"
    # Without the setting the same GPU is unknown, in every place.
    plain = torchbridge.get_backend("cuda", _config())
    assert plain.get_device_info().architecture == "unknown"
    assert plain.low_precision_dtype() is None
    assert _report(plain, _mlp())["autocast"][0] == "skipped"


@pytest.mark.usefixtures("gpu_flags")  # passes set process-wide TF32 flags
def test_configured_architecture_does_not_override_a_known_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu(monkeypatch, "A100")
    backend = torchbridge.get_backend(
        "cuda", _config(hardware={"nvidia": {"architecture": "hopper"}}))
    info = backend.get_device_info()
    assert (info.architecture, info.supported_dtypes) == (
        "ampere", ["float32", "float16", "bfloat16"])
    assert info.notes == "hardware.nvidia.architecture=hopper ignored: the GPU is ampere"
    assert _report(backend, _mlp())["fp8_linear"][0] == "skipped"


def test_the_fp8_linear_kernel_is_not_chosen_on_a_gpu_the_plugin_does_not_know(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 13.0 is described with float32 only, the fp8_linear pass and the quantize gate
    # assume no FP8 there; the kernel choice compared capabilities and chose FP8.
    _gpu(monkeypatch, "H100")
    chosen = choose("linear", torchbridge.get_backend("cuda"), dtype=torch.bfloat16).chosen
    assert chosen is not None and chosen.implementation.name == "cuda_fp8_linear_e4m3"
    _gpu(monkeypatch, FUTURE)
    choice = choose("linear", torchbridge.get_backend("cuda"), dtype=torch.bfloat16)
    assert choice.chosen is None
    reasons = [c.reason for c in choice.candidates
               if c.implementation.name == "cuda_fp8_linear_e4m3"]
    assert reasons and "the device is unknown" in str(reasons[0])


def test_the_transformer_engine_path_keeps_the_models_class(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # It returned a wrapper module, which a pass may not (a prepared model keeps the class
    # and state_dict keys of the model given): fp8_linear would be rolled back wherever
    # Transformer Engine is installed. A recorded stand-in for transformer_engine.pytorch.
    import contextlib
    import copy

    from torchbridge_nvidia import fp8

    entered: list[bool] = []

    class FakeTE:
        class Linear(nn.Linear):
            def __init__(self, n_in: int, n_out: int, bias: bool = True,
                         params_dtype: Any = None, device: Any = None) -> None:
                super().__init__(n_in, n_out, bias=bias, dtype=params_dtype, device=device)

        @staticmethod
        @contextlib.contextmanager
        def fp8_autocast(enabled: bool = True) -> Any:
            entered.append(enabled)
            yield

    monkeypatch.setattr(fp8, "_transformer_engine", lambda: FakeTE)
    monkeypatch.setattr(fp8, "gpu_capability", lambda model: (9, 0))
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32)).eval()
    result = fp8.FP8Compiler().compile_with_fp8(model)
    assert result.model is model and type(model) is nn.Sequential
    assert isinstance(model[0], FakeTE.Linear)
    model(torch.randn(2, 32))
    assert entered == [True]
    copy.deepcopy(model)(torch.randn(2, 32))  # the copy runs under it too
    assert entered == [True, True]
