"""Answers of a plugin's device hooks that no device can give are the plugin's error, not
figures passed on (free memory over the total, negative bytes, dtype names torch has not)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchbridge
from torchbridge import DeviceInfo, MemoryStats


def _plugin(stats: MemoryStats, info: DeviceInfo) -> Any:
    class Odd:
        @torchbridge.hookimpl
        def torchbridge_detect(self) -> Any:
            return torchbridge.Detection("odd", True, -60, "cpu", 1, "Odd", None, ())

        @torchbridge.hookimpl
        def torchbridge_memory_stats(self, backend_name: str, device: Any) -> Any:
            return stats if backend_name == "odd" else None

        @torchbridge.hookimpl
        def torchbridge_device_info(self, backend_name: str, device: Any) -> Any:
            return info if backend_name == "odd" else None

    return Odd()


GIB = 2**30
GOOD_STATS = MemoryStats(device="cpu", allocated_bytes=0, reserved_bytes=0,
                         peak_allocated_bytes=0, free_bytes=8 * GIB, total_bytes=16 * GIB)
GOOD_INFO = DeviceInfo(name="Odd NPU", backend="odd", memory_total_gb=16.0,
                       memory_available_gb=8.0, compute_capability=None,
                       supported_dtypes=["float32", "bfloat16"],
                       preferred_low_precision_dtype="bfloat16", device="cpu")


@pytest.mark.parametrize(("stats", "why"), [
    (MemoryStats(device="cpu", free_bytes=64 * GIB, total_bytes=16 * GIB), "free_bytes .* > "
     "total_bytes"),
    (MemoryStats(device="cpu", allocated_bytes=-1), "allocated_bytes = -1"),
    (MemoryStats(device="cpu", free_bytes=0.5), r"free_bytes = 0\.5"),  # type: ignore[arg-type]
])
def test_impossible_memory_figures_are_the_plugins_error(reload_plugins: None,
                                                         stats: MemoryStats, why: str) -> None:
    import re

    torchbridge.register_plugin(_plugin(stats, GOOD_INFO), name="odd_memory")
    backend = torchbridge.get_backend("odd")
    # Unanswered memory: every figure unknown, and the notes say why (OOM protection then
    # leaves the decision to the allocator instead of trusting an impossible figure).
    answer = backend.get_memory_stats()
    assert (answer.free_bytes, answer.total_bytes, answer.allocated_bytes) == (None,) * 3
    assert answer.notes and re.search(why, answer.notes)
    from torchbridge.plugins import plugin_records

    record = next(r for r in plugin_records() if r.name == "odd_memory")
    assert any("torchbridge_memory_stats" in e for e in record.errors)


@pytest.mark.parametrize(("change", "why"), [
    ({"supported_dtypes": ["float32", "bf16"], "preferred_low_precision_dtype": None},
     r"\['bf16'\] are not torch dtype names"),
    ({"preferred_low_precision_dtype": "float16"}, "is not among its supported_dtypes"),
    ({"memory_available_gb": 32.0}, "memory_available_gb 32.0 > memory_total_gb 16.0"),
])
def test_impossible_descriptions_are_the_plugins_error(reload_plugins: None,
                                                       change: dict[str, Any], why: str) -> None:
    import dataclasses

    info = dataclasses.replace(GOOD_INFO, **change)
    torchbridge.register_plugin(_plugin(GOOD_STATS, info), name="odd_info")
    backend = torchbridge.get_backend("odd")
    with pytest.raises(torchbridge.DeviceError, match=why):
        backend.get_device_info()


def test_possible_answers_pass(reload_plugins: None) -> None:
    torchbridge.register_plugin(_plugin(GOOD_STATS, GOOD_INFO), name="odd_fine")
    backend = torchbridge.get_backend("odd")
    assert backend.get_memory_stats().free_bytes == 8 * GIB
    assert backend.get_device_info().low_precision_dtype == torch.bfloat16


def test_an_answer_of_the_wrong_type_is_refused_before_its_figures_are_read(
        reload_plugins: None) -> None:
    # The impossibility checks ran before the type check: a possible MemoryStats returned
    # by torchbridge_device_info passed as an answer.
    torchbridge.register_plugin(_plugin(GOOD_STATS, GOOD_STATS), name="odd_types")  # type: ignore[arg-type]
    with pytest.raises(torchbridge.DeviceError, match="returned MemoryStats, expected DeviceInfo"):
        torchbridge.get_backend("odd").get_device_info()
