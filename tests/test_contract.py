"""The contract suite proves the plugin itself: the example third-party backend passes it
through its own hooks, and a backend that leans on the CPU fallback without opting in
fails it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from hang_bounds import HANG_S
from torch import nn
from torchbridge.testing import BackendContract


class TestExampleBackendContract(BackendContract):
    """tb_example's pretend NPU: two devices on the host CPU, its own section, its own
    answers for every device-level hook, and its own model."""

    backend_name = "example"
    kernels_known_wrong = ("example_wrong_silu_mul",)  # the gate's example of a wrong kernel

    def pattern_modules(self) -> list[nn.Module]:
        from tb_example.kernels import ScaleShift

        return [*super().pattern_modules(), ScaleShift(16)]

    def make_model(self) -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                              nn.Flatten(), nn.Linear(8 * 8 * 8, 10)).eval()
        return model, torch.randn(2, 3, 8, 8)

    def make_unavailable(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import tb_example.backend

        monkeypatch.setattr(tb_example.backend, "probe", lambda: 0)


LEAN_PLUGIN_TEST = '''
import torchbridge
from torchbridge.testing import BackendContract

class Lean:
    @torchbridge.hookimpl
    def torchbridge_detect(self):
        return torchbridge.Detection("lean", True, -30, "cpu", 1, "Lean", "lean",
                                     fallbacks=FALLBACKS)

torchbridge.register_plugin(Lean(), name="lean")

class TestLeanContract(BackendContract):
    backend_name = "lean"
    levels = ("O0",)
'''


def run_contract(tmp_path: Path, fallbacks: str) -> dict[str, str]:
    """Run the contract suite in a fresh pytest process against a backend that implements
    only torchbridge_detect; {test id: outcome}."""
    test_file = tmp_path / "test_lean_contract.py"
    test_file.write_text(textwrap.dedent(LEAN_PLUGIN_TEST).replace("FALLBACKS", fallbacks))
    out = subprocess.run([sys.executable, "-m", "pytest", str(test_file), "-q", "-rA",
                          "-p", "no:cacheprovider", "-k", "not compiled and not prepare"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=HANG_S).stdout
    outcomes = {}
    for line in out.splitlines():
        for outcome in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
            if line.startswith(outcome + " "):
                test_id = line.split(" ", 1)[1].split(" - ")[0].split("::")[-1]
                outcomes[test_id] = outcome
    assert outcomes, out
    return outcomes


def test_contract_fails_a_backend_leaning_on_the_cpu_fallback(tmp_path: Path) -> None:
    # Written before fallbacks existed: the host CPU still answers (with a deprecation
    # warning), but the contract says the plugin did not.
    outcomes = run_contract(tmp_path, "None")
    assert outcomes["test_fallbacks_are_declared"] == "FAILED"
    assert outcomes["test_hooks_are_answered_by_the_plugin_or_a_named_fallback"
                    "[torchbridge_device_info]"] == "FAILED"
    assert outcomes["test_identity"] == "PASSED"
    # Declaring no fallback: nobody describes the device.
    outcomes = run_contract(tmp_path, "()")
    assert outcomes["test_device_info"] == "FAILED"
    assert outcomes["test_hooks_are_answered_by_the_plugin_or_a_named_fallback"
                    "[torchbridge_memory_stats]"] == "FAILED"
    # Opting in by name is honest: the same hooks pass, answered by the named fallback.
    outcomes = run_contract(tmp_path, "('cpu',)")
    assert outcomes["test_hooks_are_answered_by_the_plugin_or_a_named_fallback"
                    "[torchbridge_device_info]"] == "PASSED"
    assert outcomes["test_a_fallback_answer_says_so"] == "PASSED"


BAD_KERNELS_TEST = '''
import torch
import torchbridge
from torchbridge import KernelImplementation
from torchbridge.testing import BackendContract

def wrong_dtype(gate, up):
    return (gate * torch.sigmoid(gate) * up).double()  # the dtype is wrong

def wrong_above_64_rows(gate, up):
    out = gate * torch.sigmoid(gate) * up
    if out.shape[0] > 64:
        out[64:] = 0
    return out

class Bad:
    @torchbridge.hookimpl
    def torchbridge_detect(self):
        return torchbridge.Detection("bad", True, -30, "cpu", 1, "Bad", "bad",
                                     fallbacks=("cpu",))

    @torchbridge.hookimpl
    def torchbridge_kernel_implementations(self, backend):
        return [KernelImplementation("silu_mul", "KERNEL", KERNEL, backends=("bad",),
                                     dtypes=(torch.float32,))]

torchbridge.register_plugin(Bad(), name="bad")

class TestBadContract(BackendContract):
    backend_name = "bad"
    levels = ("O0",)
'''


@pytest.mark.parametrize(("kernel", "said"), [("wrong_dtype", "wrong dtype: torch.float64"),
                                              ("wrong_above_64_rows", "(130, 96)")])
def test_contract_checks_kernels_in_their_dtype_and_above_64_rows(
        tmp_path: Path, kernel: str, said: str) -> None:
    test_file = tmp_path / "test_bad_kernels.py"
    test_file.write_text(BAD_KERNELS_TEST.replace("KERNEL", kernel))
    out = subprocess.run([sys.executable, "-m", "pytest", str(test_file), "-q",
                          "-p", "no:cacheprovider", "-k", "kernels_match"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=HANG_S).stdout
    assert "1 failed" in out, out
    assert said in out, out
