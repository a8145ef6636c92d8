"""Versions, manifests and the CURRENT pointer of a distributed checkpoint folder.

    ckpt/
      CURRENT                   "v000002-1a2b3c4d <SHA-256 of its MANIFEST.json>"
      v000001-9f8e7d6c/         a complete earlier version (kept with keep_last > 1)
      v000002-1a2b3c4d/
        __0_0.distcp ...        each rank's data, written by torch.distributed.checkpoint
        .metadata               DCP's metadata
        MANIFEST.json           every other file's size and SHA-256, written last

A save writes a fresh version folder; rank 0 writes its manifest after every rank has
finished and then replaces CURRENT atomically. A reader follows CURRENT and refuses a
version whose files are not exactly the manifest's (missing, extra, resized, changed).
Files are created with O_EXCL | O_NOFOLLOW and replaced by rename: no planted link is
followed. A folder written by the previous release (a bare `.metadata`, no manifest) loads
unverified, with a warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from torchbridge.atomic_file import write_atomically
from torchbridge.distributed.dcp_safe import METADATA, open_no_follow
from torchbridge.errors import CheckpointError

logger = logging.getLogger(__name__)

POINTER = "CURRENT"
MANIFEST = "MANIFEST.json"
FORMAT = "torchbridge.distributed-checkpoint"
_VERSION = re.compile(r"^v(?P<seq>\d{6,12})-[0-9a-f]{8}$")
_SHA = re.compile(r"^[0-9a-f]{64}$")
_SMALL = 1 << 20  # CURRENT and MANIFEST.json are far smaller
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Located:
    """The folder DCP reads, and what its metadata and file names must be (None: a
    previous release's checkpoint, unverified)."""

    folder: Path
    metadata_sha256: str | None
    files: frozenset[str] | None


def _read_small(path: Path) -> bytes:
    with open_no_follow(path, write=False) as file:
        data = file.read(_SMALL + 1)
    if len(data) > _SMALL:
        raise CheckpointError(f"distributed checkpoint file {path} is damaged: too large")
    return data


def _digest(path: Path) -> tuple[int, str]:
    """Size and SHA-256 of the regular file `path` (never through a link)."""
    digest = hashlib.sha256()
    with open_no_follow(path, write=False) as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise CheckpointError(f"distributed checkpoint file {path} is not a regular file")
        size = 0
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _write_file(folder: Path, name: str, data: bytes) -> None:
    """Create `folder/name` atomically (a new temporary, never through a link, fsynced,
    renamed over the name): a link planted at the name is replaced, not followed. Raises
    OSError naming the file and the cause."""
    def put(file: IO[bytes]) -> None:
        file.write(data)

    write_atomically(folder / name, put, error=OSError, what="distributed checkpoint file",
                     replace_link=True)


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _versions(root: Path) -> list[tuple[int, str]]:
    """The version folders in `root` (real folders, not links), oldest first."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            match = _VERSION.match(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                found.append((int(match["seq"]), entry.name))
    return sorted(found)


def begin(root: Path) -> Path:
    """Create and return a fresh, empty version folder in `root` (created if missing)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not root.is_dir():
            raise CheckpointError(f"distributed checkpoint {root} is not a directory")
        if os.path.lexists(root / MANIFEST):
            raise CheckpointError(f"{root} is one version of a distributed checkpoint; "
                                  f"save into {root.parent} instead")
        for _ in range(8):
            seq = max((s for s, _ in _versions(root)), default=0) + 1
            folder = root / f"v{seq:06d}-{secrets.token_hex(4)}"
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder)  # never an existing folder or a planted link
                return folder
    except OSError as exc:
        raise CheckpointError(f"cannot create a version folder in distributed checkpoint "
                              f"{root}: {exc.strerror or exc}") from exc
    raise CheckpointError(f"cannot create a version folder in {root}: names keep clashing")


def publish(folder: Path, keep_last: int | None) -> None:
    """Rank 0, after every rank finished writing `folder`: write its manifest, point
    CURRENT at it, then remove versions beyond the newest `keep_last` (None: keep all)."""
    root = folder.parent
    files: dict[str, dict[str, Any]] = {}
    try:
        for name in sorted(os.listdir(folder)):
            size, sha = _digest(folder / name)
            files[name] = {"size": size, "sha256": sha}
        if METADATA not in files:
            raise CheckpointError(f"distributed checkpoint {folder} has no {METADATA}: "
                                  "the save did not finish")
        manifest = json.dumps({"format": FORMAT, "format_version": 1, "version": folder.name,
                               "files": files}, indent=1, sort_keys=True).encode()
        _write_file(folder, MANIFEST, manifest)
        _write_file(root, POINTER,
                    f"{folder.name} {hashlib.sha256(manifest).hexdigest()}\n".encode())
    except OSError as exc:
        raise CheckpointError(f"cannot publish distributed checkpoint {folder}: "
                              f"{exc.strerror or exc}; the previous version is still "
                              "current") from exc
    if keep_last is not None:
        _prune(root, folder.name, keep_last)


def _prune(root: Path, current: str, keep_last: int) -> None:
    seq = int(_VERSION.match(current)["seq"])  # type: ignore[index]
    kept = 1
    for other_seq, name in reversed(_versions(root)):
        if other_seq >= seq:
            continue  # the current one, or a newer save still being written
        if kept < keep_last and os.path.isfile(root / name / MANIFEST):
            kept += 1
            continue
        shutil.rmtree(root / name, ignore_errors=True)
        logger.info("removed old distributed checkpoint version %s", root / name)


def discard(folder: Path) -> None:
    """Remove an unpublished version folder after a failed save (best effort)."""
    if _is_real_dir(folder):
        shutil.rmtree(folder, ignore_errors=True)


def _verify(folder: Path, manifest: bytes) -> Located:
    path = folder / MANIFEST
    try:
        body = json.loads(manifest)
        files = body["files"]
        ok = body["format"] == FORMAT and body["format_version"] == 1 \
            and isinstance(files, dict) and all(
                isinstance(v, dict) and isinstance(v.get("size"), int)
                and isinstance(v.get("sha256"), str) and _SHA.match(v["sha256"])
                for v in files.values())
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"distributed checkpoint file {path} is damaged: "
                              f"{type(exc).__name__}") from exc
    if not ok or METADATA not in files:
        raise CheckpointError(f"distributed checkpoint file {path} is damaged: not a "
                              "torchbridge manifest")
    if body.get("version") != folder.name:
        raise CheckpointError(f"distributed checkpoint file {path} belongs to version "
                              f"{body.get('version')!r}, not {folder.name}: files of two "
                              "versions are mixed")
    present = set(os.listdir(folder)) - {MANIFEST}
    for name in sorted(present - set(files)):
        raise CheckpointError(f"distributed checkpoint {folder} holds {folder / name}, "
                              "which its manifest does not list (mixed or planted)")
    for name, want in sorted(files.items()):
        if name not in present:
            raise CheckpointError(f"distributed checkpoint file {folder / name} is missing")
        try:
            size, sha = _digest(folder / name)
        except OSError as exc:
            raise CheckpointError(f"cannot read distributed checkpoint file {folder / name}"
                                  f": {exc.strerror or exc}") from exc
        if (size, sha) != (want["size"], want["sha256"]):
            raise CheckpointError(f"distributed checkpoint file {folder / name} is damaged "
                                  "or from another version: its size or SHA-256 is not the "
                                  "manifest's")
    return Located(folder, files[METADATA]["sha256"], frozenset(files))


def locate(root: Path) -> Located:
    """The verified current version of the checkpoint `root` (a checkpoint folder or one
    version folder), or a previous release's unverified layout. CheckpointError naming the
    file for anything damaged, missing, extra or mixed."""
    pointer = root / POINTER
    try:
        if os.path.lexists(pointer):
            line = _read_small(pointer).decode("ascii", "replace").split()
            if len(line) != 2 or not _VERSION.match(line[0]) or not _SHA.match(line[1]):
                raise CheckpointError(f"distributed checkpoint file {pointer} is damaged")
            folder = root / line[0]
            if not _is_real_dir(folder):
                raise CheckpointError(f"distributed checkpoint {root}: {pointer} names "
                                      f"{folder}, which is missing or not a folder")
            manifest = _read_small(folder / MANIFEST)
            if hashlib.sha256(manifest).hexdigest() != line[1]:
                raise CheckpointError(f"distributed checkpoint file {folder / MANIFEST} is "
                                      f"damaged or replaced: its SHA-256 is not {pointer}'s")
            return _verify(folder, manifest)
        if os.path.lexists(root / MANIFEST):
            return _verify(root, _read_small(root / MANIFEST))
    except OSError as exc:
        raise CheckpointError(f"cannot read distributed checkpoint {root}: "
                              f"{exc.filename or root}: {exc.strerror or exc}") from exc
    if (root / METADATA).is_file():
        logger.warning("distributed checkpoint %s has no manifest (written by an earlier "
                       "torchbridge): its files are not verified; save it again to get "
                       "checksums", root)
        return Located(root, None, None)
    raise CheckpointError(f"{root} is not a distributed checkpoint (no {POINTER}, "
                          f"{MANIFEST} or {METADATA} file)")
