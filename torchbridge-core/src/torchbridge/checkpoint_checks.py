"""Checks that decide whether a torch.save file may be handed to torch.load.

Integrity. A file written by `save_checkpoint` ends with a SHA-256 footer: the zip
archive's comment (which torch.load and every zip reader skip) holds
`torchbridge-sha256:<hex>`, the digest of every byte before it, the end-of-central-directory
record included (with the comment's length set). Every byte of the file is therefore
either hashed or part of the footer, so no change to the file can alter what is loaded
without failing the check; a damaged footer fails the check too, or (its prefix
destroyed) leaves a file whose every other byte is as written, which the structural
checks below then vouch for.

A zip file without the footer (plain torch.save) is checked structurally: every record
stored uncompressed and not encrypted, named once, no directory entries or directory
attribute bits (the bit that made torch read uninitialized memory), the central directory
matching each record's local header and data descriptor (flags, method, name, CRC, sizes),
records laid out without overlap before the central directory, and every record's CRC-32.
torch's legacy (pre-1.6, non-zip) format has no checksums at all: it is bounded but cannot
be verified.

Bounds. Before torch.load runs, the pickle is replayed by a dry-run unpickler that builds
only plain containers and inert stand-ins for every global (nothing is imported or
called): it yields each storage's declared dtype and element count, which must match the
record's size in the file, and the structure's object count and nesting depth, both
bounded. Everything torch.load then allocates is backed by bytes of the file.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import pickle
import struct
import warnings
import zipfile
from dataclasses import dataclass, field
from typing import IO, Any

import torch

FOOTER_PREFIX = b"torchbridge-sha256:"
FOOTER_LEN = len(FOOTER_PREFIX) + 64
_EOCD_LEN = 22
_EOCD_SIG = b"PK\x05\x06"
_LOCAL_SIG = b"PK\x03\x04"
_DESCRIPTOR_SIG = b"PK\x07\x08"
_ALLOWED_FLAGS = 0x0808  # bit 3: sizes in a data descriptor; bit 11: UTF-8 names

# Bounds on the pickled structure: far above any state dict or optimizer state (a large
# model's is under a million objects and ten levels deep), far below what hangs a process.
MAX_OBJECTS = 50_000_000
MAX_DEPTH = 1000


class Damaged(Exception):
    """What is wrong with a file, in words."""


# -- writing the footer ---------------------------------------------------------------------

class HashingWriter:
    """A file object for torch.save that passes everything on to `out` while hashing it,
    holding back the last 22 bytes (the end-of-central-directory record torch writes last)
    so `finish` can give the archive a comment holding the digest."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.sha = hashlib.sha256()
        self.tail = b""

    def write(self, data: Any) -> int:
        chunk = memoryview(data).cast("B")
        size = chunk.nbytes
        if size >= _EOCD_LEN:
            if self.tail:
                self._emit(self.tail)
            self._emit(chunk[:size - _EOCD_LEN])
            self.tail = bytes(chunk[size - _EOCD_LEN:])
        else:
            joined = self.tail + bytes(chunk)
            if len(joined) > _EOCD_LEN:
                self._emit(joined[:len(joined) - _EOCD_LEN])
            self.tail = joined[-_EOCD_LEN:]
        return size

    def _emit(self, data: Any) -> None:
        if len(data):
            self.sha.update(data)
            self.out.write(data)

    def flush(self) -> None:
        """Nothing is buffered beyond the held-back record."""

    def finish(self) -> None:
        eocd = bytearray(self.tail)
        if len(eocd) != _EOCD_LEN or eocd[:4] != _EOCD_SIG or eocd[20:22] != b"\0\0":
            raise RuntimeError("torch.save did not end with a plain end-of-central-directory "
                               "record")
        eocd[20:22] = struct.pack("<H", FOOTER_LEN)
        self._emit(bytes(eocd))
        self.out.write(FOOTER_PREFIX + self.sha.hexdigest().encode())


# -- reading ----------------------------------------------------------------------------------

def _read_at(f: IO[bytes], offset: int, size: int) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise Damaged(f"the file ends inside a record at byte {offset}")
    return data


def has_footer(f: IO[bytes], size: int) -> bool:
    if size < FOOTER_LEN + _EOCD_LEN:
        return False
    if _read_at(f, size - FOOTER_LEN, len(FOOTER_PREFIX)) == FOOTER_PREFIX:
        return True
    eocd = _read_at(f, size - FOOTER_LEN - _EOCD_LEN, _EOCD_LEN)  # a damaged prefix
    return eocd[:4] == _EOCD_SIG and struct.unpack("<H", eocd[20:22])[0] == FOOTER_LEN


def verify_footer(f: IO[bytes], size: int) -> None:
    """Raise Damaged unless the bytes before the footer hash to the digest in it."""
    footer = _read_at(f, size - FOOTER_LEN, FOOTER_LEN)
    eocd = _read_at(f, size - FOOTER_LEN - _EOCD_LEN, _EOCD_LEN)
    if eocd[:4] != _EOCD_SIG or struct.unpack("<H", eocd[20:22])[0] != FOOTER_LEN:
        raise Damaged("its end-of-central-directory record is damaged")
    if not footer.startswith(FOOTER_PREFIX):
        raise Damaged("its SHA-256 footer is damaged")
    try:
        expected = bytes.fromhex(footer[len(FOOTER_PREFIX):].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise Damaged("its SHA-256 footer is damaged") from None
    sha = hashlib.sha256()
    f.seek(0)
    left = size - FOOTER_LEN
    while left:
        chunk = f.read(min(left, 1 << 24))
        if not chunk:
            raise Damaged("the file shrank while it was read")
        sha.update(chunk)
        left -= len(chunk)
    if sha.digest() != expected:
        raise Damaged("its content does not match the SHA-256 written with it (a byte was "
                      "changed after the save)")


@dataclass
class ZipLayout:
    prefix: str                     # the archive's top folder, "archive/" for torch.save
    sizes: dict[str, int] = field(default_factory=dict)  # record name -> bytes


def check_zip(f: IO[bytes], size: int, *, crc: bool = True) -> ZipLayout:
    """The structural and CRC checks described in the module docstring (the CRCs are
    skipped with crc=False, after the SHA-256 footer has vouched for every byte)."""
    tail_start = max(0, size - (1 << 16) - _EOCD_LEN)
    tail = _read_at(f, tail_start, size - tail_start)
    where = tail.rfind(_EOCD_SIG)
    if where < 0 or where + _EOCD_LEN > len(tail):
        raise Damaged("no end-of-central-directory record (truncated?)")
    comment = tail[where + _EOCD_LEN:]
    if struct.unpack("<H", tail[where + 20:where + 22])[0] != len(comment):
        raise Damaged("its end-of-central-directory record or footer is damaged (truncated?)")
    try:
        archive = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error) as exc:
        raise Damaged(f"not a readable zip archive ({exc})") from None
    with archive:
        infos = archive.infolist()
        if not infos:
            raise Damaged("an empty zip archive")
        names = [info.filename for info in infos]
        if len(set(names)) != len(names):
            raise Damaged("a zip archive naming one record twice")
        pickles = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pickles) != 1:
            raise Damaged("a zip archive without torch's data.pkl record")
        prefix = pickles[0][:-len("data.pkl")]
        layout = ZipLayout(prefix)
        spans = []
        for info in infos:
            what = f"record {info.filename!r}"
            if not info.filename.startswith(prefix) or info.filename.endswith("/"):
                raise Damaged(f"{what} is outside torch's layout")
            if info.compress_type != zipfile.ZIP_STORED:
                raise Damaged(f"{what} is compressed, which torch.save never does")
            if info.flag_bits & ~_ALLOWED_FLAGS:
                raise Damaged(f"{what} has flags {info.flag_bits:#x} torch.save never sets")
            if info.external_attr & 0x10 or (info.external_attr >> 16) & 0o170000 not in (
                    0, 0o100000):
                raise Damaged(f"{what} is marked as a directory or special file")
            if info.file_size != info.compress_size:
                raise Damaged(f"{what} has inconsistent sizes")
            end = _check_local(f, info, size)
            spans.append((info.header_offset, end, info.filename))
            layout.sizes[info.filename] = info.file_size
        spans.sort()
        for (_, end, name), (start, _, _) in itertools.pairwise(spans):
            if end > start:
                raise Damaged(f"record {name!r} overlaps the next one")
        if spans[-1][1] > archive.start_dir:
            raise Damaged("the records overlap the central directory")
        if not crc:
            return layout
        try:
            bad = archive.testzip()
        except Exception as exc:  # zipfile raises many types on bad input
            raise Damaged(f"{type(exc).__name__}: {exc}") from None
        if bad is not None:
            raise Damaged(f"record {bad} fails its CRC-32 check")
    return layout


def _check_local(f: IO[bytes], info: zipfile.ZipInfo, size: int) -> int:
    """Compare a record's local header (and data descriptor) with its central entry;
    returns where the record ends."""
    what = f"record {info.filename!r}"
    if info.header_offset < 0 or info.header_offset + 30 > size:
        raise Damaged(f"{what} starts outside the file")
    header = _read_at(f, info.header_offset, 30)
    (sig, _version, flags, method, _time, _date, crc, csize, usize, name_len,
     extra_len) = struct.unpack("<4s5H3L2H", header)
    if sig != _LOCAL_SIG:
        raise Damaged(f"{what} has no local header where the directory says")
    if flags != info.flag_bits or method != info.compress_type:
        raise Damaged(f"{what}'s local header disagrees with the central directory")
    name = _read_at(f, info.header_offset + 30, name_len)
    encoding = "utf-8" if flags & 0x800 else "cp437"
    if name.decode(encoding, errors="replace") != info.orig_filename:
        raise Damaged(f"{what}'s local header names another record")
    data_start = info.header_offset + 30 + name_len + extra_len
    end: int = data_start + info.compress_size
    if end > size:
        raise Damaged(f"{what} extends past the end of the file")
    if flags & 0x08:
        if (crc, csize, usize) != (0, 0, 0) and (crc, csize, usize) != (
                info.CRC, info.compress_size, info.file_size):
            raise Damaged(f"{what}'s local header disagrees with the central directory")
        head = _read_at(f, end, 4)
        start = end + 4 if head == _DESCRIPTOR_SIG else end
        for fmt in ("<LLL", "<LQQ"):  # 4- or 8-byte sizes (zip64)
            want = struct.calcsize(fmt)
            if start + want <= size and struct.unpack(fmt, _read_at(f, start, want)) == (
                    info.CRC, info.compress_size, info.file_size):
                end = start + want
                break
        else:
            raise Damaged(f"{what}'s data descriptor disagrees with the central directory")
    elif (crc, csize, usize) != (info.CRC, info.compress_size, info.file_size) and not (
            csize == usize == 0xFFFFFFFF):
        raise Damaged(f"{what}'s local header disagrees with the central directory")
    return end


# -- the dry run ------------------------------------------------------------------------------

class _Inert:
    """Stands for any global and for anything built from one; records what it was given."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        # Parts set here too: NEWOBJ and BUILD (a dataclass, torchao's quantized weights)
        # make the object through __new__ alone, then hand it its state.
        obj = object.__new__(cls)
        obj.parts = [args, kwargs]
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.parts: list[Any] = [args, kwargs]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.parts.append((key, value))

    def append(self, value: Any) -> None:
        self.parts.append(value)

    def extend(self, values: Any) -> None:
        self.parts.extend(values)

    def __setstate__(self, state: Any) -> None:
        self.parts.append(state)


class _DryRun(pickle.Unpickler):
    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file)
        self.storages: list[tuple[Any, ...]] = []
        self.classes: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key not in self.classes:
            self.classes[key] = type("inert", (_Inert,), {"module": module, "name": name})
        return self.classes[key]

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple):
            raise Damaged("a storage reference that is not a tuple")
        self.storages.append(pid)
        return _Inert()


def _storage_itemsize(storage_type: Any) -> int:
    name, module = getattr(storage_type, "name", None), getattr(storage_type, "module", None)
    # torch.save writes the storage of a dtype with no typed storage class of its own
    # (float8, uint16-64, complex32) as torch.storage.UntypedStorage, sized in bytes.
    if (module, name) in (("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage")):
        return 1
    if module != "torch" or not isinstance(name, str):
        raise Damaged("a storage of an unknown type")
    cls = getattr(torch, name, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dtype = getattr(cls, "dtype", None)
    if not isinstance(dtype, torch.dtype) or not name.endswith("Storage"):
        raise Damaged(f"a storage of an unknown type torch.{name}")
    return torch.empty((), dtype=dtype).element_size()


def _measure(root: Any) -> None:
    """Bound the number of objects and the nesting depth; iterative, each object once."""
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    visits = 0
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        obj, done = stack.pop()
        key = id(obj)
        if done:
            on_path.discard(key)
            kids = _children(obj)
            depth[key] = 1 + max((depth.get(id(k), 0) for k in kids if id(k) not in on_path),
                                 default=0)
            if depth[key] > MAX_DEPTH:
                raise Damaged(f"its objects are nested more than {MAX_DEPTH} levels deep")
            continue
        if key in depth or key in on_path:
            continue
        kids = _children(obj)
        visits += 1 + len(kids)
        if visits > MAX_OBJECTS:
            raise Damaged(f"it holds more than {MAX_OBJECTS} objects")
        on_path.add(key)
        stack.append((obj, True))
        stack.extend((kid, False) for kid in kids
                     if isinstance(kid, (list, tuple, dict, set, frozenset, _Inert)))


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, _Inert):
        return obj.parts
    return []


def dry_run(data: IO[bytes]) -> tuple[Any, list[tuple[Any, ...]]]:
    """Replay one pickle without importing or calling anything; bound its structure.
    Returns the inert structure and the storage references it makes."""
    unpickler = _DryRun(data)
    try:
        root = unpickler.load()
    except Damaged:
        raise
    except RecursionError:
        raise Damaged("its pickle is nested too deeply") from None
    except Exception as exc:  # pickle raises many types on bad input
        raise Damaged(f"its pickle is damaged ({type(exc).__name__}: {exc})") from None
    _measure(root)
    return root, unpickler.storages


def check_zip_pickle(f: IO[bytes], layout: ZipLayout) -> None:
    """Every storage the pickle declares matches its record's size."""
    f.seek(0)
    with zipfile.ZipFile(f) as archive:
        data = archive.read(layout.prefix + "data.pkl")
    _, storages = dry_run(io.BytesIO(data))
    for pid in storages:
        if len(pid) != 5 or pid[0] != "storage" or not isinstance(pid[2], str) or \
                not isinstance(pid[4], int) or pid[4] < 0:
            raise Damaged("a malformed storage reference")
        record = f"{layout.prefix}data/{pid[2]}"
        nbytes = pid[4] * _storage_itemsize(pid[1])
        if layout.sizes.get(record) != nbytes:
            raise Damaged(f"storage {pid[2]!r} declares {nbytes} bytes but its record "
                          f"{'is missing' if record not in layout.sizes else 'holds '}"
                          f"{layout.sizes.get(record, '')}"
                          f"{' bytes' if record in layout.sizes else ''}")


def check_legacy(f: IO[bytes], size: int) -> None:
    """torch's legacy format: magic, protocol, system info, the object pickle, the storage
    keys, then each storage as an 8-byte count and raw data. The declared storages must
    fit in what follows the pickles."""
    f.seek(0)
    for _ in range(3):
        dry_run(f)
    _, storages = dry_run(f)
    dry_run(f)  # the storage keys
    declared: dict[Any, int] = {}
    for pid in storages:
        if len(pid) < 5 or pid[0] != "storage" or not isinstance(pid[4], int) or pid[4] < 0:
            raise Damaged("a malformed storage reference")
        declared[pid[2]] = max(declared.get(pid[2], 0), pid[4] * _storage_itemsize(pid[1]))
    if sum(declared.values()) > size - f.tell():
        raise Damaged("its storages declare more bytes than the file holds")


def file_size(f: IO[bytes]) -> int:
    return os.fstat(f.fileno()).st_size
