"""The backend contract: what every backend must honour for the facade to mean anything.

Subclass `BackendContract` in a pytest module and set `backend_name`. Each test says what a
user relies on; none needs more than one device.
"""

from __future__ import annotations

import copy
from typing import ClassVar

import pytest
import torch
from torch import nn

import torchbridge
from torchbridge import DeviceError, DeviceInfo, MemoryStats, OptimizationLevel
from torchbridge.levels import LEVEL_TOLERANCE


def small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).eval()


class BackendContract:
    backend_name: ClassVar[str]
    levels: ClassVar[tuple[str, ...]] = ("O0", "O1", "O2", "O3")

    @pytest.fixture
    def backend(self) -> torchbridge.Backend:
        return torchbridge.get_backend(self.backend_name)

    def test_identity(self, backend: torchbridge.Backend) -> None:
        assert backend.name == self.backend_name
        assert backend.is_available
        assert backend.device_count >= 1
        assert len(backend.devices) == backend.device_count
        assert isinstance(backend.device, torch.device)
        torch.zeros(1, device=backend.device)  # the device is usable

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

    def test_bad_device_index_is_a_device_error(self, backend: torchbridge.Backend) -> None:
        with pytest.raises(DeviceError, match="does not exist"):
            backend.get_device_info(backend.device_count)

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

    def test_autocast_computes_in_low_precision(self, backend: torchbridge.Backend) -> None:
        dtype = backend.low_precision_dtype()
        a = torch.randn(16, 16, device=backend.device)
        with backend.autocast():
            out = a @ a
        assert out.dtype == (dtype or torch.float32)

    @pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
    def test_prepare_model_matches_reference(self, backend: torchbridge.Backend,
                                             level: str) -> None:
        if level not in self.levels:
            pytest.skip(f"{level} not claimed by this backend's contract run")
        model = small_mlp()
        original = copy.deepcopy(model.state_dict())
        x = torch.randn(8, 64)
        expected = model(x)
        result = backend.optimize(model, level, sample_input=x)
        assert result.level == OptimizationLevel(level)
        assert result.backend == backend.name
        assert torchbridge.optimization_result(result.model) is result
        out = result.model(x.to(backend.device))
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

    def test_prepare_model_returns_model_with_report(self, backend: torchbridge.Backend) -> None:
        prepared = backend.prepare_model(small_mlp(), level="O1")
        report = torchbridge.optimization_result(prepared)
        assert report is not None and report.backend == backend.name
        param = next(prepared.parameters())
        assert param.device.type == backend.device.type

    def test_prepare_model_rejects_non_modules(self, backend: torchbridge.Backend) -> None:
        with pytest.raises(torchbridge.ModelOptimizationError, match=r"nn\.Module"):
            backend.prepare_model(lambda x: x)  # type: ignore[arg-type]

