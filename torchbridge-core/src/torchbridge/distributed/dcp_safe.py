"""torch.distributed.checkpoint (DCP) without code from files and without following links.

DCP reads a checkpoint's `.metadata` with `pickle.load` and its non-tensor values with
`torch.load(weights_only=False)`: a crafted file runs code. `SafeReader` reads the metadata
with an unpickler that admits only the types DCP's own format uses (an explicit allow-list,
nothing callable beyond their constructors), checks it against the manifest's SHA-256 when
there is one and refuses storage entries that point outside the checkpoint; the planners
here read non-tensor values with `weights_only=True`. `NoFollowWriter` creates every file
with O_EXCL | O_NOFOLLOW, so a save never writes through a link it did not create.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path, PosixPath, PurePosixPath
from typing import IO, Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.checkpoint.format_utils import (  # type: ignore[attr-defined]
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.serialization import _get_layout

from torchbridge.errors import CheckpointError

METADATA = ".metadata"
MAX_METADATA_BYTES = 256 * 1024 * 1024

_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                 "_MEM_FORMAT_ENCODING")
}
_ALLOWED.update({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("pathlib", "PosixPath"): PosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("collections", "OrderedDict"): dict,
})
_OPEN_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}: not a type of "
                                     "torch.distributed.checkpoint's metadata")


def parse_metadata(data: bytes, path: Path) -> Metadata:
    """The DCP `Metadata` pickled in `data`, admitting only its own types; CheckpointError
    naming `path` for anything else."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise CheckpointError(f"refused distributed checkpoint metadata {path}: "
                              f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"refused distributed checkpoint metadata {path}: it holds "
                              f"{type(metadata).__name__}, not torch's checkpoint Metadata")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"refused distributed checkpoint metadata {path}: no storage "
                              "table")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(name, str) or not name \
                or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise CheckpointError(f"refused distributed checkpoint metadata {path}: a "
                                  f"storage entry names {name!r}, not a file of the "
                                  "checkpoint")
    return metadata


def open_no_follow(path: Path, write: bool) -> IO[bytes]:
    """Open `path` for reading, or create it for writing, never through a symlink; a write
    never reuses an existing file."""
    flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL) if write else os.O_RDONLY
    fd = os.open(path, flags | _OPEN_FLAGS, 0o666)
    return os.fdopen(fd, "wb" if write else "rb")


class _NoFollowFileSystem(FileSystem):
    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str
                      ) -> Iterator[io.IOBase]:
        if mode not in ("rb", "wb"):
            raise CheckpointError(f"unexpected file mode {mode!r} for {path}")
        with open_no_follow(Path(path), write=mode == "wb") as stream:
            yield stream  # type: ignore[misc]


class NoFollowWriter(FileSystemWriter):
    """DCP's file writer into a fresh folder: files are created, never overwritten or
    written through a link."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, overwrite=False)
        self.fs = _NoFollowFileSystem()


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read safely (and checked against `metadata_sha256`
    and the manifest's `files` when given) and data files opened without following links."""

    def __init__(self, path: Path, metadata_sha256: str | None = None,
                 files: frozenset[str] | None = None) -> None:
        super().__init__(path)
        self.fs = _NoFollowFileSystem()
        self.folder = path
        self.metadata_sha256 = metadata_sha256
        self.files = files
        self.refusal: CheckpointError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's retry with a rank's own file: none here
            raise self.refusal or CheckpointError(f"no rank-local metadata in {self.folder}")
        try:
            return self._read_metadata()
        except CheckpointError as exc:
            self.refusal = self.refusal or exc  # DCP rewraps it; the caller reports this
            raise

    def _read_metadata(self) -> Metadata:
        path = self.folder / METADATA
        try:
            with open_no_follow(path, write=False) as file:
                data = file.read(MAX_METADATA_BYTES + 1)
        except OSError as exc:
            raise CheckpointError(f"cannot read distributed checkpoint metadata {path}: "
                                  f"{exc.strerror or exc}") from exc
        if len(data) > MAX_METADATA_BYTES:
            raise CheckpointError(f"refused distributed checkpoint metadata {path}: over "
                                  f"{MAX_METADATA_BYTES} bytes")
        if self.metadata_sha256 is not None \
                and hashlib.sha256(data).hexdigest() != self.metadata_sha256:
            raise CheckpointError(f"distributed checkpoint file {path} is damaged or was "
                                  "replaced: its SHA-256 is not the manifest's")
        metadata = parse_metadata(data, path)
        if self.files is not None:
            for info in metadata.storage_data.values():
                if info.relative_path not in self.files:
                    raise CheckpointError(f"refused distributed checkpoint metadata {path}: "
                                          f"it names {info.relative_path!r}, which the "
                                          "manifest does not list")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata


def _load_bytes(planner: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO) -> None:
    # DefaultLoadPlanner.load_bytes, with weights_only=True where torch has False
    loaded = torch.load(value, weights_only=True)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn],
                    loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor values read by torch's weights-only unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes(self, read_item, value)


class SafeEmptyPlanner(_EmptyStateDictLoadPlanner):
    """DCP's planner that builds the whole state dict from the metadata, reading non-tensor
    values with torch's weights-only unpickler."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes(self, read_item, value)
