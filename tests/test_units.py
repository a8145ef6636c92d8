"""One unit convention: memory is counted in bytes; what people read is binary MiB or GiB,
named so. The seeds' names (`stats["allocated"]`, `_gb`, `memory_total_gb`) keep their
numbers, which were binary all along."""

from __future__ import annotations

import pytest
import torch
import torchbridge
from torchbridge.suggestions import close_matches, did_you_mean
from torchbridge.types import GIB, MIB, MemoryStats

STATS = MemoryStats(device="cuda:0", allocated_bytes=3 * GIB, reserved_bytes=None,
                    peak_allocated_bytes=512 * MIB, free_bytes=GIB // 2, total_bytes=80 * GIB)


def test_memory_stats_answers_in_the_units_its_keys_name() -> None:
    assert STATS["allocated_bytes"] == 3 * GIB
    assert STATS["allocated"] == STATS["allocated_mb"] == STATS["allocated_mib"] == 3072.0
    assert STATS["allocated_gb"] == STATS["allocated_gib"] == 3.0
    assert STATS["peak_allocated_mib"] == 512.0 and STATS["free_gib"] == 0.5
    assert STATS["total"] == 80 * 1024.0
    assert STATS["reserved_mib"] is None  # unknown stays unknown
    with pytest.raises(KeyError, match=r"\(in MiB\), with _mib, _gib or _bytes suffixes"):
        STATS["allocated_kb"]


def test_an_out_of_memory_error_speaks_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = torchbridge.get_backend("cpu")
    monkeypatch.setattr(backend, "get_memory_stats", lambda index=None: MemoryStats(
        device="cpu", allocated_bytes=0, free_bytes=100 * MIB, total_bytes=4 * GIB))
    manager = backend.memory_manager()
    with pytest.raises(torchbridge.OutOfMemoryError) as info:
        manager.check_allocation(90 * MIB, safety_margin=1.2)
    assert str(info.value) == (
        "cannot allocate 90.0 MiB on cpu (not enough free memory): requested 90.0 MiB x "
        "safety margin 1.2 = 108.0 MiB, free 100.0 MiB, total 4096.0 MiB")
    assert isinstance(info.value, torch.OutOfMemoryError)


def test_device_info_memory_is_gib() -> None:
    info = torchbridge.get_backend("cpu").get_device_info()
    stats = torchbridge.get_backend("cpu").get_memory_stats()
    if info.memory_total_gb is None or stats.total_bytes is None:
        pytest.skip("this host does not report its memory")
    assert info.memory_total_gb == pytest.approx(stats.total_bytes / GIB, rel=1e-6)


@pytest.mark.parametrize(("word", "choices", "hint"), [
    ("cdua", ["cuda", "rocm", "cpu"], "; did you mean 'cuda'?"),
    ("DOCTR", ["doctor", "bench"], "; did you mean 'doctor'?"),
    ("mpl", ["mlp", "convnet"], "; did you mean 'mlp'?"),
    ("lots", ["int8", "float8"], ""),  # nothing close: no guess
    ("cuda", ["cuda"], ""),  # the word itself is not a suggestion
])
def test_did_you_mean(word: str, choices: list[str], hint: str) -> None:
    assert did_you_mean(word, choices) == hint
    assert close_matches("Cuda", ["CUDA", "cpu"]) == ["CUDA"]
