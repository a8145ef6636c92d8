"""Checkpoints of every dtype save_checkpoint writes load back, and no single changed byte of
a safetensors file written by TorchBridge loads unchecked.

Before: a .pt file holding float8, uint16-64 or complex32 tensors (whose storages torch
pickles as torch.storage.UntypedStorage) was refused as "damaged ... a storage of an
unknown type"; safetensors files refused uint16-64 and AMD's float8 variants, which the
safetensors library writes and reads; and one flipped bit in the name of the metadata key
holding the SHA-256 made the file look foreign, loaded without a check (with a changed
data byte too: numbers 1.3e37 off, no error)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchbridge
from torchbridge import CheckpointError

PT_ONLY = [torch.complex32]
BOTH = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
        torch.uint16, torch.uint32, torch.uint64]


def values(dtype: torch.dtype) -> torch.Tensor:
    source = torch.tensor([0.0, 1.0, 2.0, 3.0]).to(torch.complex64 if dtype.is_complex
                                                   else torch.float32)
    return source.to(dtype)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", BOTH + PT_ONLY, ids=str)
def test_a_pt_checkpoint_of_any_dtype_loads_back(tmp_path: Path, dtype: torch.dtype) -> None:
    saved = {"w": values(dtype)}
    torchbridge.save_checkpoint(saved, tmp_path / "m.pt")
    loaded = torchbridge.load_checkpoint(tmp_path / "m.pt")
    assert loaded["w"].dtype == dtype and bits(loaded["w"]) == bits(saved["w"])


@pytest.mark.parametrize("dtype", BOTH, ids=str)
def test_a_safetensors_checkpoint_of_any_safetensors_dtype_loads_back(
        tmp_path: Path, dtype: torch.dtype) -> None:
    library = pytest.importorskip("safetensors.torch")
    saved = {"w": values(dtype)}
    torchbridge.save_checkpoint(saved, tmp_path / "ours.safetensors")
    library.save_file(saved, str(tmp_path / "theirs.safetensors"))
    for name in ("ours", "theirs"):
        loaded = torchbridge.load_checkpoint(tmp_path / f"{name}.safetensors")
        assert loaded["w"].dtype == dtype and bits(loaded["w"]) == bits(saved["w"]), name


def test_no_single_changed_byte_of_the_header_loads_unchecked(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    path = tmp_path / "m.safetensors"
    torchbridge.save_checkpoint(torch.nn.Linear(4, 4), path)
    good = path.read_bytes()
    expected = torchbridge.load_checkpoint(path)
    header_end = 8 + int.from_bytes(good[:8], "little")
    accepted = []
    for where in range(header_end):
        for mask in (0x01, 0x20, 0x80):
            damaged = bytearray(good)
            damaged[where] ^= mask
            path.write_bytes(bytes(damaged))
            try:
                loaded = torchbridge.load_checkpoint(path)
            except CheckpointError:
                continue
            same = loaded.keys() == expected.keys() and all(
                torch.equal(loaded[k], expected[k]) for k in expected)
            accepted.append((where, mask, same))
    # A change the format cannot see (JSON whitespace) may load, as long as it loads the
    # same numbers; none does here: each is named as damage.
    assert accepted == []


def test_the_checksum_keys_name_changed_is_damage_not_a_foreign_file(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    path = tmp_path / "m.safetensors"
    torchbridge.save_checkpoint({"w": torch.arange(8, dtype=torch.float32)}, path)
    data = path.read_bytes().replace(b"torchbridge.sha256", b"torchbridge.sha257")
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=r"has no torchbridge\.sha256"):
        torchbridge.load_checkpoint(path)
