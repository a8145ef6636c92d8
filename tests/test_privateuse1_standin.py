"""A PrivateUse1 (out-of-tree C++ device) backend under the contract suite, without C++: a
pure-Python stand-in for the vendor's extension. `torch.utils.rename_privateuse1_backend`
names the device type and `torch._register_device_module` installs a Python module as
`torch.<name>` (is_available, device_count, current_device, set_device, synchronize,
empty_cache, memory counters, and get_amp_supported_dtype, which torch.autocast requires of
a PrivateUse1 module). That is what the suite needs from the extension for every test
except those that place tensors on the device: allocating a tensor needs the
extension's C++ allocator and kernels (aten::empty.memory_format registered for
PrivateUse1), which Python cannot provide, so the stand-in runs as a recording (`recorded`
set) and those tests skip, naming why. The rename is once per process: a fresh pytest
process runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hang_bounds import HANG_S

STANDIN_TEST = '''
import types

import torch
import torchbridge
from torchbridge.devices import declare_device_type
from torchbridge.testing import BackendContract

torch.utils.rename_privateuse1_backend("npu")
npu = types.ModuleType("torch_npu_standin")
npu.is_available = lambda: True
npu.device_count = lambda: 2
npu.current_device = lambda: 0
npu.set_device = lambda device: None
npu.synchronize = lambda device=None: None
npu.empty_cache = lambda: None
npu.memory_allocated = lambda device=None: 0
npu.max_memory_allocated = lambda device=None: 0
npu.reset_peak_memory_stats = lambda device=None: None
npu.get_amp_supported_dtype = lambda: [torch.bfloat16]  # torch.autocast asks for it
torch._register_device_module("npu", npu)


class NPU:
    @torchbridge.hookimpl
    def torchbridge_detect(self):
        return torchbridge.Detection("npu", True, -10, "npu", npu.device_count(), "Stand-in",
                                     "standin", fallbacks=())

    @torchbridge.hookimpl
    def torchbridge_device_info(self, backend_name, device):
        if backend_name == "npu":
            return torchbridge.DeviceInfo("Stand-in NPU", "npu", 16.0, 15.0, None,
                                          ["float32", "bfloat16"], device=str(device),
                                          vendor="Stand-in")

    @torchbridge.hookimpl
    def torchbridge_memory_stats(self, backend_name, device):
        if backend_name == "npu":
            return torchbridge.MemoryStats(device=str(device), allocated_bytes=0,
                                           reserved_bytes=0, peak_allocated_bytes=0,
                                           free_bytes=15 * 2**30, total_bytes=16 * 2**30)

    @torchbridge.hookimpl
    def torchbridge_synchronize(self, backend_name, device):
        if backend_name == "npu":
            npu.synchronize(device)
            return True

    @torchbridge.hookimpl
    def torchbridge_empty_cache(self, backend_name):
        if backend_name == "npu":
            npu.empty_cache()
            return True

    @torchbridge.hookimpl
    def torchbridge_reset_peak_memory_stats(self, backend_name, device):
        if backend_name == "npu":
            npu.reset_peak_memory_stats(device)
            return True

    @torchbridge.hookimpl
    def torchbridge_distributed_backend(self, backend_name):
        if backend_name == "npu":
            return "gloo"


torchbridge.register_plugin(NPU(), name="npu_standin")


class TestStandInNPUContract(BackendContract):
    backend_name = "npu"
    recorded = "pure-Python PrivateUse1 stand-in (no C++ allocator: no tensor on npu)"

    def record(self, monkeypatch):
        pass  # the stand-in module is the device
'''


def test_privateuse1_standin_passes_the_contract(tmp_path: Path) -> None:
    test_file = tmp_path / "test_npu_standin.py"
    test_file.write_text(STANDIN_TEST)
    done = subprocess.run([sys.executable, "-m", "pytest", str(test_file), "-q", "-rs",
                           "-p", "no:cacheprovider"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=HANG_S)
    out = done.stdout
    assert done.returncode == 0, out[-6000:]
    assert " passed" in out
    assert "no tensor can be placed on it" in out  # the tests that need the C++ allocator
