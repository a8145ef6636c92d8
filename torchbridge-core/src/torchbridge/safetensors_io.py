"""safetensors files for `save_checkpoint` and `load_checkpoint`: a JSON header and raw
tensor bytes, no code in it: what Hugging Face models are published in.

Every file is checked before the safetensors library sees it: the header's declared size
is bounded and inside the file, the header is JSON with no repeated names, every tensor
has a known dtype, a shape whose element count times the item size equals its byte range,
and byte ranges that lie inside the data and do not overlap. Files written by torchbridge
also carry `torchbridge.sha256` in their metadata: a digest of every tensor's name, dtype,
shape and bytes and of the other metadata, so any change to what is loaded fails the check,
and `torchbridge.checksum` (covered by the digest), so that a change to the digest's key
name fails it too (safetensors files from elsewhere have no checksum: they are checked
structurally only).

Only tensors go into a safetensors file: a state with other values (an optimizer's step
counts, nested dicts) is refused naming the key; save it as a torch (.pt) checkpoint.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import struct
from pathlib import Path
from typing import IO, Any

import torch

from torchbridge.atomic_file import describe_os_error, write_atomically
from torchbridge.errors import CheckpointError

HASH_KEY = "torchbridge.sha256"
# Written with the digest, and covered by it: a file that has it and no digest lost its
# digest's key to a changed byte (read as a file from elsewhere, it would have loaded
# unchecked: one flipped bit in the key's name, and any change to the data went through).
CHECKSUM_MARKER = ("torchbridge.checksum", "sha256")
MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
MAX_INDEX = 64 * 1024 * 1024
INDEX_SUFFIX = ".safetensors.index.json"
# The dtypes of the safetensors format that torch has (the safetensors library's own
# table: AMD's float8 variants and the wider unsigned integers included).
_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
                torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
                torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
                torch.complex64: "C64", torch.uint16: "U16", torch.uint32: "U32",
                torch.uint64: "U64"}
_ITEMSIZE = {name: torch.empty((), dtype=dtype).element_size()
             for dtype, name in _DTYPE_NAMES.items()}


class _Damaged(Exception):
    pass


def _library() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise CheckpointError(
            "reading or writing .safetensors checkpoints needs the safetensors package: "
            "pip install safetensors (or pip install 'torchbridge-core[safetensors]')"
        ) from None
    return safetensors.torch


def _digest(entries: list[tuple[str, str, list[int], Any]], metadata: dict[str, str]) -> str:
    sha = hashlib.sha256()
    for name, dtype, shape, data in sorted(entries, key=lambda e: e[0]):
        sha.update(json.dumps([name, dtype, shape]).encode())
        sha.update(data)
    others = {k: v for k, v in metadata.items() if k != HASH_KEY}
    sha.update(json.dumps(others, sort_keys=True).encode())
    return sha.hexdigest()


# -- saving -----------------------------------------------------------------------------------

def save(state: dict[str, Any], path: Path) -> Path:
    """Write `state` (names to tensors, already on the CPU) to `path` atomically."""
    library = _library()
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    entries = []
    for key, value in state.items():
        if not isinstance(key, str):
            raise CheckpointError(f"cannot save checkpoint {path}: key {key!r} is not a "
                                  "string, which safetensors requires")
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"cannot save checkpoint {path}: entry {key!r} is of type {type(value).__name__}, "
                "not a tensor, and a safetensors file holds tensors only; save the state as a "
                "torch checkpoint (.pt) or leave that entry out")
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise CheckpointError(
                f"cannot save checkpoint {path}: tensor {key!r} is a "
                f"{type(value).__name__} (a tensor subclass, such as a quantized weight), "
                "and a safetensors file holds plain tensors only; save it as a torch "
                "checkpoint (.pt)")
        if value.layout != torch.strided or value.dtype not in _DTYPE_NAMES:
            raise CheckpointError(f"cannot save checkpoint {path}: tensor {key!r} "
                                  f"({value.dtype}, {value.layout}) has no safetensors form")
        tensor = value.detach().contiguous()
        storage = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if storage in seen or tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()  # safetensors refuses tensors that share memory
        seen.add((tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
        tensors[key] = tensor
        raw = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""
        entries.append((key, _DTYPE_NAMES[tensor.dtype], list(tensor.shape), raw))
    metadata = {"format": "pt", CHECKSUM_MARKER[0]: CHECKSUM_MARKER[1]}
    metadata[HASH_KEY] = _digest(entries, metadata)
    try:
        data = library.save(tensors, metadata=metadata)
    except Exception as exc:
        raise CheckpointError(f"cannot save checkpoint {path}: {type(exc).__name__}: "
                              f"{exc}") from exc

    def write(file: IO[bytes]) -> None:
        file.write(data)

    return write_atomically(path, write, error=CheckpointError, what="checkpoint")


# -- loading ----------------------------------------------------------------------------------

def _checked_header(data: memoryview) -> tuple[dict[str, Any], int]:
    if len(data) < 8:
        raise _Damaged("the file is shorter than a safetensors header")
    (size,) = struct.unpack("<Q", data[:8])
    if size > MAX_HEADER:
        raise _Damaged(f"its header declares {size} bytes, over the {MAX_HEADER}-byte limit")
    if 8 + size > len(data):
        raise _Damaged(f"its header declares {size} bytes but the file has "
                       f"{len(data) - 8} after the length")

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        names = [k for k, _ in pairs]
        if len(set(names)) != len(names):
            raise _Damaged("its header names a tensor twice")
        return dict(pairs)

    try:
        header = json.loads(bytes(data[8:8 + size]).decode("utf-8"), object_pairs_hook=unique)
    except _Damaged:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _Damaged(f"its header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _Damaged("its header is not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _Damaged("its __metadata__ is not a map of strings to strings")
    start = 8 + size
    room = len(data) - start
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise _Damaged(f"tensor {name!r} has a malformed header entry")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _ITEMSIZE:
            raise _Damaged(f"tensor {name!r} has an unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
                type(d) is int and d >= 0 for d in shape):
            raise _Damaged(f"tensor {name!r} has a malformed shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= room):
            raise _Damaged(f"tensor {name!r} has byte offsets {offsets!r} outside the "
                           f"{room} bytes of data")
        if math.prod(shape) * _ITEMSIZE[dtype] != offsets[1] - offsets[0]:
            raise _Damaged(f"tensor {name!r}: shape {shape} of {dtype} needs "
                           f"{math.prod(shape) * _ITEMSIZE[dtype]} bytes, its range holds "
                           f"{offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (_, end, name), (begin, _, other) in itertools.pairwise(spans):
        if end > begin:
            raise _Damaged(f"tensors {name!r} and {other!r} overlap")
    if HASH_KEY not in metadata and CHECKSUM_MARKER[0] in metadata:
        raise _Damaged(f"its metadata says it carries a SHA-256 ({CHECKSUM_MARKER[0]}) but "
                       f"has no {HASH_KEY} (a byte of its header was changed after the save)")
    if HASH_KEY in metadata:
        entries = [(name, header[name]["dtype"], header[name]["shape"],
                    data[start + b:start + e]) for b, e, name in spans]
        if _digest(entries, metadata) != metadata[HASH_KEY]:
            raise _Damaged("its content does not match the SHA-256 written with it (a byte "
                           "was changed after the save)")
    return header, start


def _read(path: Path, limit: int | None = None) -> bytes:
    if path.exists() and not path.is_file():  # a FIFO would block the open
        raise CheckpointError(f"checkpoint {path} is not a regular file")
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            if limit is not None and info.st_size > limit:
                raise CheckpointError(f"checkpoint index {path} is over {limit} bytes")
            return f.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {describe_os_error(exc)}"
                              ) from None


def load_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, checked first."""
    library = _library()
    data = _read(path)
    try:
        _checked_header(memoryview(data))
    except _Damaged as exc:
        raise CheckpointError(f"checkpoint {path} is damaged or not a safetensors file: "
                              f"{exc}") from None
    try:
        return dict(library.load(data))
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} is damaged or not a safetensors file: "
                              f"{type(exc).__name__}: {exc}") from None


def load_index(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a sharded checkpoint, from its `*.safetensors.index.json`: every
    shard is checked, and must hold exactly the tensors the index assigns to it."""
    try:
        index = json.loads(_read(path, MAX_INDEX).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint index {path} is damaged: not valid JSON ({exc})"
                              ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"checkpoint index {path} is damaged: no weight_map of tensor "
                              "names to shard files")
    shards: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        if shard != os.path.basename(shard) or shard in ("", ".", "..") or "\\" in shard:
            raise CheckpointError(f"checkpoint index {path} names shard {shard!r} outside "
                                  "its folder")
        shards.setdefault(shard, set()).add(name)
    state: dict[str, torch.Tensor] = {}
    for shard, names in sorted(shards.items()):
        tensors = load_file(path.parent / shard)
        if set(tensors) != names:
            missing = sorted(names - set(tensors))[:3]
            extra = sorted(set(tensors) - names)[:3]
            raise CheckpointError(
                f"checkpoint shard {path.parent / shard} does not match index {path}: "
                f"missing {missing}, not listed {extra}")
        state.update(tensors)
    return state


def find_in_folder(folder: Path) -> Path | None:
    """The index or single file a folder of safetensors holds, if any."""
    for name in ("model" + INDEX_SUFFIX, "model.safetensors"):
        if (folder / name).is_file():
            return folder / name
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return None
    for suffix in (INDEX_SUFFIX, ".safetensors"):
        found = [n for n in names if n.endswith(suffix)]
        if len(found) == 1:
            return folder / found[0]
        if found:
            raise CheckpointError(f"checkpoint folder {folder} holds several candidates "
                                  f"({', '.join(found[:4])}); pass the file to load")
    return None


def load(path: Path) -> dict[str, torch.Tensor]:
    """A .safetensors file, a sharded checkpoint's index, or a folder holding either."""
    if path.is_dir():
        found = find_in_folder(path)
        if found is None:
            raise CheckpointError(f"checkpoint folder {path} holds no .safetensors file")
        path = found
    if path.name.endswith(".json"):
        return load_index(path)
    return load_file(path)


__all__: list[str] = ["HASH_KEY", "find_in_folder", "load", "load_file", "load_index",
                      "save"]
