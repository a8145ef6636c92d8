from __future__ import annotations

import pytest
import torch
import torchbridge
from torchbridge import MemoryStats, OptimizationLevel


def test_error_hierarchy() -> None:
    for cls in (torchbridge.ConfigurationError, torchbridge.BackendUnavailableError,
                torchbridge.DeviceError, torchbridge.OutOfMemoryError, torchbridge.KernelError,
                torchbridge.KernelCompilationError, torchbridge.ModelOptimizationError,
                torchbridge.PluginError):
        assert issubclass(cls, torchbridge.TorchBridgeError)
    assert issubclass(torchbridge.KernelCompilationError, torchbridge.KernelError)


def test_out_of_memory_is_caught_by_torch_handlers() -> None:
    with pytest.raises(torch.OutOfMemoryError):
        raise torchbridge.OutOfMemoryError("requested 2 GiB, free 1 GiB of 8 GiB")


def test_memory_stats_seed_keys_in_mb_gb_bytes() -> None:
    stats = MemoryStats(device="cuda:0", allocated_bytes=3 * 2**20, reserved_bytes=2**30,
                        free_bytes=None, total_bytes=8 * 2**30, notes="free unknown")
    assert stats["allocated"] == 3.0
    assert stats["reserved_gb"] == 1.0
    assert stats["total_bytes"] == 8 * 2**30
    assert stats["free"] is None  # unknowable stays None, never 0
    with pytest.raises(KeyError, match="memory stats have"):
        stats["bogus"]


def test_levels_and_aliases() -> None:
    assert OptimizationLevel.parse("balanced") is OptimizationLevel.O2
    assert OptimizationLevel.parse("conservative") is OptimizationLevel.O1
    assert OptimizationLevel.parse("aggressive") is OptimizationLevel.O3
    assert OptimizationLevel.parse("o3") is OptimizationLevel.O3
    assert OptimizationLevel.parse(0) is OptimizationLevel.O0
    assert OptimizationLevel.O2 > "O1"
    with pytest.raises(torchbridge.ConfigurationError, match="unknown optimization level 'O7'"):
        OptimizationLevel.parse("O7")


@pytest.mark.parametrize("step", ["import torchbridge",
                                  "import torchbridge; torchbridge.detect_best_backend()"])
def test_import_and_discovery_stay_cheap(step: str) -> None:
    """Neither importing nor discovery (every installed plugin loaded, the example plugin
    included) pulls in pydantic or a vendor SDK: pydantic alone costs about 160 ms."""
    import subprocess
    import sys

    code = (f"import sys; {step}; "
            "print(sorted(m for m in ('pydantic', 'torchbridge.config', 'torch_xla', 'pynvml', "
            "'amdsmi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out.splitlines()[-1] == "[]"
