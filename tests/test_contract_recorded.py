"""The backend contract on recorded devices, in the default session: the cuda, rocm and xpu
backends on an H100, an MI300X and a Data Center GPU Max 1550, each replayed at its plugin's
probe seam by the recordings of test_nvidia, test_amd and test_intel (two devices, so that
every index is routed). What needs tensors on the device skips and says so; the rest of the
contract runs."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist
import torchbridge
from test_amd import FakeGPUs as FakeAMDGPUs
from test_amd import rocm_flags  # noqa: F401  (a fixture, used by name)
from test_intel import FakeXPUs
from test_nvidia import FakeGPUs as FakeNVIDIAGPUs
from test_nvidia import gpu_flags  # noqa: F401  (a fixture, used by name)
from torchbridge.testing import BackendContract


@pytest.fixture
def hipblaslt_env() -> Iterator[None]:
    """The AMD tf32 pass sets HIPBLASLT_ALLOW_TF32 process-wide (os.environ.setdefault),
    which rocm_flags' delenv does not undo where the variable was absent: put it back."""
    before = os.environ.get("HIPBLASLT_ALLOW_TF32")
    yield
    if before is None:
        os.environ.pop("HIPBLASLT_ALLOW_TF32", None)
    else:
        os.environ["HIPBLASLT_ALLOW_TF32"] = before


def built_with_nccl(monkeypatch: pytest.MonkeyPatch, built: bool = True) -> None:
    """The recorded machine's torch: a CUDA or ROCm wheel, built with NCCL (RCCL on ROCm);
    this machine's torch may be a CPU build without it."""
    monkeypatch.setattr(dist, "is_nccl_available", lambda: built)


@pytest.mark.usefixtures("gpu_flags")
class TestRecordedH100Contract(BackendContract):
    backend_name = "cuda"
    recorded = "NVIDIA H100 80GB HBM3 x2 at torchbridge_nvidia.probe"

    def record(self, monkeypatch: pytest.MonkeyPatch) -> None:
        built_with_nccl(monkeypatch)
        FakeNVIDIAGPUs(monkeypatch, "H100", count=2)

    def make_unavailable(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from torchbridge.types import ProbeResult
        from torchbridge_nvidia import probe

        monkeypatch.setattr(probe, "probe",
                            lambda: ProbeResult(False, 0, "no NVIDIA GPU visible"))


@pytest.mark.usefixtures("hipblaslt_env", "rocm_flags")
class TestRecordedMI300XContract(BackendContract):
    backend_name = "rocm"
    recorded = "AMD Instinct MI300X x2 at torchbridge_amd.probe"

    def record(self, monkeypatch: pytest.MonkeyPatch) -> None:
        built_with_nccl(monkeypatch)
        FakeAMDGPUs(monkeypatch, "MI300X", count=2)

    def make_unavailable(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from torchbridge.types import ProbeResult
        from torchbridge_amd import probe

        monkeypatch.setattr(probe, "probe", lambda: ProbeResult(False, 0, "no AMD GPU visible"))


class TestRecordedMax1550Contract(BackendContract):
    backend_name = "xpu"
    recorded = "Intel Data Center GPU Max 1550 x2 at torchbridge_intel.probe"

    def record(self, monkeypatch: pytest.MonkeyPatch) -> None:
        FakeXPUs(monkeypatch, "Max 1550", count=2)

    def make_unavailable(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from torchbridge.types import ProbeResult
        from torchbridge_intel import probe

        monkeypatch.setattr(probe, "probe",
                            lambda: ProbeResult(False, 0, "no Intel GPU visible"))


@pytest.mark.parametrize("backend_name", ["cuda", "rocm"])
def test_no_distributed_backend_on_a_torch_without_nccl(monkeypatch: pytest.MonkeyPatch,
                                                         backend_name: str) -> None:
    """Found by the contract run above: on this machine's CPU torch (no NCCL) the recorded
    cuda backend named no distributed backend, the recorded rocm one named "nccl". A name
    is an answer only where this torch has it built in: init_process_group fails on it
    otherwise."""
    built_with_nccl(monkeypatch, built=False)
    fake = FakeNVIDIAGPUs if backend_name == "cuda" else FakeAMDGPUs
    fake(monkeypatch, "H100" if backend_name == "cuda" else "MI300X")
    assert torchbridge.get_backend(backend_name).distributed_backend is None
