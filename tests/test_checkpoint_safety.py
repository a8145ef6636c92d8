"""Issue 20 items 3-5 for single-file checkpoints: every deciding byte checked, bounds
before allocation, no raw exception types; safetensors both ways (sharded included); saves
that never follow a planted symlink; temporaries of live writers left alone."""

from __future__ import annotations

import io
import json
import os
import random
import struct
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torchbridge
import torchbridge.checkpoint as checkpoint_module
from test_checkpoint_hardening import dead_pid
from torchbridge import CheckpointError, atomic_file
from torchbridge import checkpoint_checks as checks
from torchbridge.atomic_file import TEMP_MARK, remove_dead_temporaries, temp_name
from torchbridge.checkpoint_checks import FOOTER_PREFIX, MAX_DEPTH

safetensors_torch = pytest.importorskip("safetensors.torch")

if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("POSIX file semantics are tested on Linux")

STATE = {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
         "n": {"i": torch.arange(3), "h": torch.tensor([0.5, -2.0], dtype=torch.float16)},
         "step": 7}


def assert_state(loaded: Any) -> None:
    assert set(loaded) == {"w", "n", "step"} and loaded["step"] == 7
    for got, want in ((loaded["w"], STATE["w"]), (loaded["n"]["i"], STATE["n"]["i"]),
                      (loaded["n"]["h"], STATE["n"]["h"])):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def torch_save_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("saved") / "m.pt"
    torchbridge.save_checkpoint(STATE, path)
    return path.read_bytes()


def load_bytes(folder: Path, data: bytes, name: str = "x.pt", **kwargs: Any) -> Any:
    path = folder / name
    path.write_bytes(data)
    return torchbridge.load_checkpoint(path, **kwargs)


# -- integrity --------------------------------------------------------------------------------

def test_a_saved_file_loads_with_plain_torch_and_carries_its_footer(tmp_path: Path,
                                                                      saved: bytes) -> None:
    assert FOOTER_PREFIX in saved[-100:]
    assert_state(torch.load(io.BytesIO(saved), weights_only=True))
    assert_state(load_bytes(tmp_path, saved))


def central_directory_bit_flipped(data: bytes) -> bytes:
    """Set the MS-DOS directory bit in a tensor record's central-directory entry: outside
    every CRC, and torch then reads uninitialized memory for the tensor."""
    archive = zipfile.ZipFile(io.BytesIO(data))
    start = data.index(b"PK\x01\x02")  # the first central-directory entry
    damaged = bytearray(data)
    for info in archive.infolist():
        offset = data.index(b"PK\x01\x02" + data[start + 4:start + 8], start)
        name_len = struct.unpack("<H", data[offset + 28:offset + 30])[0]
        name = data[offset + 46:offset + 46 + name_len].decode()
        if "/data/" in name:
            damaged[offset + 38] |= 0x10  # external attributes, low byte
            return bytes(damaged)
        start = offset + 46 + name_len + struct.unpack("<H", data[offset + 30:offset + 32])[0] \
            + struct.unpack("<H", data[offset + 32:offset + 34])[0]
        del info
    raise AssertionError("no tensor record")


@pytest.mark.parametrize("writer", ["torchbridge", "torch.save"])
def test_the_central_directory_bit_flip_is_refused(tmp_path: Path, saved: bytes,
                                                   writer: str) -> None:
    data = saved if writer == "torchbridge" else torch_save_bytes(STATE)
    with pytest.raises(CheckpointError, match="damaged or not a checkpoint") as info:
        load_bytes(tmp_path, central_directory_bit_flipped(data))
    assert str(tmp_path / "x.pt") in str(info.value)


@pytest.mark.parametrize(("writer", "flips"), [("torchbridge", 400), ("torch.save", 250)])
def test_single_byte_flips_load_identically_or_are_checkpoint_errors(
        tmp_path: Path, saved: bytes, writer: str, flips: int) -> None:
    data = saved if writer == "torchbridge" else torch_save_bytes(STATE)
    rng = random.Random(20)
    outcomes = {"identical": 0, "refused": 0}
    for _ in range(flips):
        damaged = bytearray(data)
        damaged[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        try:
            loaded = load_bytes(tmp_path, bytes(damaged))
        except CheckpointError as exc:
            assert "weights_only=False" not in str(exc)
            outcomes["refused"] += 1
            continue
        assert_state(loaded)  # never different data
        outcomes["identical"] += 1
    if writer == "torchbridge":  # the footer covers every byte: nothing slips through
        assert outcomes["identical"] == 0, outcomes


def test_truncations_and_garbage_are_checkpoint_errors(tmp_path: Path, saved: bytes) -> None:
    rng = random.Random(3)
    for cut in [0, 1, 4, 30, len(saved) // 2, len(saved) - 1, *rng.sample(range(len(saved)),
                                                                            40)]:
        with pytest.raises(CheckpointError):
            load_bytes(tmp_path, saved[:cut])
    for blob in (b"PK\x03\x04" + os.urandom(300), saved[:-83] + b"x" * 83, saved + b"\0"):
        with pytest.raises(CheckpointError):
            load_bytes(tmp_path, blob)


# -- resource bounds --------------------------------------------------------------------------

def count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, limit: int
                ) -> list[int]:
    """Count the calls of `module.name`, failing the test the moment there are more than
    `limit`: work that grows with the paths through a structure (rather than its objects)
    fails at once instead of running for ever, whatever the machine's speed. The count is
    returned in a one-element list."""
    original: Callable[..., Any] = getattr(module, name)
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > limit:  # pytest.fail is a BaseException: no `except Exception` eats it
            pytest.fail(f"{module.__name__}.{name} called more than {limit} times")
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_nested_lists_sharing_one_child_load_quickly(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    nested: Any = [torch.ones(1)]
    for _ in range(40):
        nested = [nested] * 50  # 50**40 paths through 41 objects
    data = torch_save_bytes({"a": nested})
    assert len(data) < 8000
    for kwargs in ({}, {"dtype": torch.float16}):
        # Quick by construction, not by the clock: the structure checks and the dtype cast
        # look at each of the ~50 objects a few times, never once per path.
        measured = count_calls(monkeypatch, checks, "_children", 500)
        walked = count_calls(monkeypatch, checkpoint_module, "_containers", 500)
        loaded = load_bytes(tmp_path, data, **kwargs)
        assert measured[0] > 41 and (walked[0] > 41) == ("dtype" in kwargs)
        monkeypatch.undo()
        leaf = loaded["a"]
        for _ in range(40):
            assert leaf[0] is leaf[49]  # still shared, not copied 50**40 times
            leaf = leaf[0]
        assert leaf[0].dtype == kwargs.get("dtype", torch.float32)


def zip_with_pickle(pickled: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickled)
        archive.writestr("archive/version", "3\n")
    return buffer.getvalue()


def test_structures_nested_too_deeply_are_refused_before_loading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    depth = MAX_DEPTH + 50  # built through the memo: constant pickle stack, any depth
    ops = [b"\x80\x02", b"]r" + struct.pack("<I", 0)]
    for i in range(1, depth):
        ops.append(b"]r" + struct.pack("<I", i) + b"a0j" + struct.pack("<I", i))
    ops.append(b"0j" + struct.pack("<I", 0) + b".")

    def torch_load(*args: Any, **kwargs: Any) -> Any:
        pytest.fail("torch.load ran: the structure was not refused before loading")

    monkeypatch.setattr(checkpoint_module.torch, "load", torch_load)
    # Linear in the depth (each list looked at twice), not quadratic: bounded by count.
    measured = count_calls(monkeypatch, checks, "_children", 4 * depth)
    with pytest.raises(CheckpointError, match="nested more than"):
        load_bytes(tmp_path, zip_with_pickle(b"".join(ops)))
    assert measured[0] > MAX_DEPTH


def test_a_storage_declaring_more_than_its_record_is_refused(tmp_path: Path) -> None:
    data = torch_save_bytes({"w": torch.ones(2)})
    archive = zipfile.ZipFile(io.BytesIO(data))
    pickled = archive.read("archive/data.pkl")
    assert b"K\x02t" in pickled  # numel 2, then TUPLE
    forged = pickled.replace(b"K\x02t", b"J\x00\x00\x00\x40t")  # numel 2**30: 4 GiB
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as out:
        for info in archive.infolist():
            out.writestr(info.filename, forged if info.filename.endswith("data.pkl")
                         else archive.read(info.filename))
    with pytest.raises(CheckpointError, match="declares 4294967296 bytes"):
        load_bytes(tmp_path, buffer.getvalue())


def test_a_dtype_conversion_never_inflates_a_tiny_file(tmp_path: Path) -> None:
    # A 1.6 KB file: a 2**30-element view of one float. Converted per storage, it stays a
    # view of 8 bytes; a non-strided tensor that would need GBs is refused before converting.
    data = torch_save_bytes({"e": torch.ones(1).expand(2 ** 30)})
    loaded = load_bytes(tmp_path, data, dtype=torch.float64)["e"]
    assert loaded.dtype == torch.float64 and loaded.shape == (2 ** 30,)
    assert loaded.untyped_storage().nbytes() == 8
    sparse = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (2 ** 31,))
    data = torch_save_bytes({"s": sparse})
    with pytest.raises(CheckpointError, match=r"memory.*nothing was converted"):
        load_bytes(tmp_path, data, dtype=torch.float64)


def test_views_of_one_storage_stay_shared_after_a_dtype_conversion(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32)
    loaded = load_bytes(tmp_path, torch_save_bytes({"a": base, "t": base.view(3, 4).t()}),
                        dtype=torch.bfloat16)
    assert torch.equal(loaded["t"], base.view(3, 4).t().to(torch.bfloat16))
    assert loaded["a"].untyped_storage().data_ptr() == loaded["t"].untyped_storage().data_ptr()


# -- safetensors ------------------------------------------------------------------------------

TENSORS = {"w": torch.randn(5, 3), "b": torch.arange(4, dtype=torch.int32),
           "h": torch.randn(2, 2).to(torch.bfloat16), "m": torch.tensor([True, False])}


def assert_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_torchbridge_safetensors_load_with_the_safetensors_library(tmp_path: Path) -> None:
    path = torchbridge.save_checkpoint(TENSORS, tmp_path / "m.safetensors")
    assert_tensors(safetensors_torch.load_file(path), TENSORS)
    assert_tensors(torchbridge.load_checkpoint(path), TENSORS)
    other = torchbridge.save_checkpoint(TENSORS, tmp_path / "m.bin", format="safetensors")
    assert_tensors(torchbridge.load_checkpoint(other, format="safetensors"), TENSORS)
    half = torchbridge.load_checkpoint(path, dtype=torch.float16)
    assert half["w"].dtype == torch.float16 and half["b"].dtype == torch.int32


def test_safetensors_files_load_with_torchbridge(tmp_path: Path) -> None:
    safetensors_torch.save_file(TENSORS, tmp_path / "x.safetensors", metadata={"a": "b"})
    assert_tensors(torchbridge.load_checkpoint(tmp_path / "x.safetensors"), TENSORS)


def test_tied_weights_and_non_tensor_entries(tmp_path: Path) -> None:
    shared = torch.randn(3, 3)
    path = torchbridge.save_checkpoint({"a": shared, "b": shared, "c": shared[1]},
                                       tmp_path / "t.safetensors")
    loaded = safetensors_torch.load_file(path)
    assert torch.equal(loaded["b"], shared) and torch.equal(loaded["c"], shared[1])
    with pytest.raises(CheckpointError, match=r"'step' is of type int.*tensors only"):
        torchbridge.save_checkpoint({"w": torch.ones(1), "step": 3}, tmp_path / "o.safetensors")
    with pytest.raises(CheckpointError, match="'n' is of type dict"):
        torchbridge.save_checkpoint({"n": {"w": torch.ones(1)}}, tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


def test_transformers_sharded_save_pretrained_loads_with_torchbridge(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128,
                                     n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    index = tmp_path / "hf" / "model.safetensors.index.json"
    assert index.exists() and len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    expected = {k: v for k, v in model.state_dict().items()}
    for source in (index, tmp_path / "hf"):
        loaded = torchbridge.load_checkpoint(source)
        assert loaded and set(loaded) <= set(expected)
        for key, value in loaded.items():
            assert torch.equal(value, expected[key]), key
    weight_map = json.loads(index.read_text())["weight_map"]
    weight_map[next(iter(weight_map))] = "../elsewhere.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="outside its folder"):
        torchbridge.load_checkpoint(index)


def safetensors_bytes(header: dict[str, Any], data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(("blob", "says"), [
    (b"\x01", "shorter than"),
    (struct.pack("<Q", 2 ** 40) + b"{}", "over the"),
    (struct.pack("<Q", 500) + b"{}", "declares 500 bytes"),
    (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    (safetensors_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                       b"\0" * 4), "outside"),
    (safetensors_bytes({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
                       b"\0" * 8), "needs 12 bytes"),
    (safetensors_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                        "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
                       b"\0" * 8), "overlap"),
    (safetensors_bytes({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}},
                       b"\0"), "unknown dtype"),
])
def test_damaged_safetensors_are_refused(tmp_path: Path, blob: bytes, says: str) -> None:
    with pytest.raises(CheckpointError, match=says) as info:
        load_bytes(tmp_path, blob, name="d.safetensors")
    assert str(tmp_path / "d.safetensors") in str(info.value)


def test_flipped_bytes_in_a_torchbridge_safetensors_file_are_refused(tmp_path: Path) -> None:
    path = torchbridge.save_checkpoint(TENSORS, tmp_path / "m.safetensors")
    data = path.read_bytes()
    rng = random.Random(5)
    for _ in range(150):
        damaged = bytearray(data)
        damaged[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        try:
            loaded = load_bytes(tmp_path, bytes(damaged), name="f.safetensors")
        except CheckpointError:
            continue
        assert_tensors(loaded, TENSORS)  # header padding: never different data


def test_a_missing_safetensors_package_names_the_install(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(CheckpointError, match="pip install safetensors"):
        torchbridge.save_checkpoint(TENSORS, tmp_path / "m.safetensors")


# -- files ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["m.pt", "m.safetensors"])
def test_a_planted_symlink_at_the_target_is_not_followed(tmp_path: Path, name: str) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / name).symlink_to(victim)
    with pytest.raises(CheckpointError, match="symbolic link"):
        torchbridge.save_checkpoint(TENSORS, tmp_path / "ckpt" / name)
    assert victim.read_text() == "precious"


def test_a_symlink_planted_at_the_temporary_name_is_not_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    monkeypatch.setattr(atomic_file.secrets, "token_hex", lambda n: "0" * (2 * n))
    monkeypatch.setattr(atomic_file.time, "time", lambda: 1_700_000_000.0)
    (tmp_path / temp_name("m.pt")).symlink_to(victim)
    with pytest.raises(CheckpointError, match="File exists"):
        torchbridge.save_checkpoint(TENSORS, tmp_path / "m.pt")
    assert victim.read_text() == "precious" and not (tmp_path / "m.pt").exists()


def test_temporaries_of_live_or_foreign_writers_are_not_removed(tmp_path: Path) -> None:
    pid = dead_pid()
    old = time.time() - 10 * atomic_file.STALE_AFTER_S
    mine = temp_name("m.pt")

    def planted(name: str, age: float) -> Path:
        path = tmp_path / name
        path.write_bytes(b"partial")
        os.utime(path, (age, age))
        return path

    def named(tag: str, writer: int, stamp: float) -> str:
        return f".m.pt{TEMP_MARK}{tag}-{writer}-{int(stamp)}-0123abcd"

    tag = mine.split(TEMP_MARK)[1].split("-")[0]
    # Another PID namespace (container) or host: its pid means nothing here.
    foreign = planted(named("0" * 12, pid, old), old)
    # This namespace, dead pid, but recent: a writer may still be starting or suspended.
    recent = planted(named(tag, pid, time.time()), time.time())
    # This namespace, old, pid alive.
    live = planted(named(tag, os.getpid(), old), old)
    # An old name format without a namespace tag.
    legacy = planted(f".m.pt{TEMP_MARK}{tag[:8]}-{pid}-0123abcd", old)
    # This namespace, dead pid, old by name and by modification time: removed.
    stale = planted(named(tag, pid, old), old)
    assert remove_dead_temporaries(tmp_path) == [stale]
    torchbridge.load_checkpoint(torchbridge.save_checkpoint(TENSORS, tmp_path / "m.pt"))
    assert all(p.exists() for p in (foreign, recent, live, legacy)) and not stale.exists()
