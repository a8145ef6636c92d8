"""Replace a file atomically, and clean up after writers that died.

A write goes to a temporary in the destination's folder, named
`.<name>.tbtmp-<tag>-<pid>-<stamp>-<random>`, created with O_EXCL | O_NOFOLLOW (never
through a planted file or link), flushed to disk and renamed over the destination, so a
reader sees the old file or the new one, never half of one, and a process killed at any
point leaves the old file as it was. A destination that is a symlink is refused: a save
never writes through a link it did not create.

Every later write or read in the folder removes temporaries whose writer is provably dead
and that are old: `<tag>` is a hash of the host name, the boot id and the writer's PID
namespace, so a pid is only ever checked in the namespace it belongs to (a writer in
another container, on another machine sharing the filesystem, or from before a reboot is
never judged by a pid that means something else here); the pid must no longer run (or be
a zombie); and both the lease stamp in the name and the file's last modification must be
older than `STALE_AFTER_S`. A live writer's temporary is never touched; a pid reused by an
unrelated process only delays the cleanup. Names without a tag (older versions) are left
alone.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

TEMP_MARK = ".tbtmp-"
_TEMP_NAME = re.compile(r"^\..*\.tbtmp-(?P<tag>[0-9a-f]{12})-(?P<pid>\d+)-(?P<stamp>\d+)"
                        r"-[0-9a-f]{8}$")
_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_NAME_MAX = 255  # bytes in a file name on every filesystem we run on


# A temporary is removed only when its writer is provably dead AND it is older than this
# (by the stamp in its name and by its modification time): a generous margin for clocks,
# suspended machines and writers whose liveness cannot be seen from here.
STALE_AFTER_S = 3600.0


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _host_tag() -> str:
    """This host, boot and PID namespace: a pid means the same process only under one tag."""
    parts = (socket.gethostname(), _read_text("/proc/sys/kernel/random/boot_id"),
             _pid_namespace())
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:12]


def temp_name(name: str) -> str:
    """The temporary for destination file `name`, from this process."""
    suffix = (f"{TEMP_MARK}{_host_tag()}-{os.getpid()}-{int(time.time())}-"
              f"{secrets.token_hex(4)}")
    room = _NAME_MAX - len(suffix) - 1
    encoded = name.encode(errors="surrogateescape")[:room]
    return "." + encoded.decode(errors="ignore") + suffix


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie. When in doubt, alive."""
    if pid <= 0:
        return True  # 0 and negatives would address process groups; never "dead"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return True
    try:  # Linux: a killed writer whose parent has not reaped it yet is a zombie
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def remove_dead_temporaries(folder: Path, *, min_age_s: float | None = None) -> list[Path]:
    """Remove the temporaries in `folder` left by dead writers in this host's boot and PID
    namespace that are older than `min_age_s` (default `STALE_AFTER_S`) by their name's
    stamp and their modification time. Returns what was removed. Never raises: a folder
    that cannot be listed is left alone."""
    removed: list[Path] = []
    host = _host_tag()
    age = STALE_AFTER_S if min_age_s is None else min_age_s
    now = time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        if TEMP_MARK not in entry.name:
            continue
        match = _TEMP_NAME.match(entry.name)
        if match is None or match["tag"] != host or now - int(match["stamp"]) < age:
            continue
        if pid_alive(int(match["pid"])):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode) or now - info.st_mtime < age:
                continue
            os.unlink(entry.path)
        except OSError:
            continue  # removed by another process meanwhile, or not ours to remove
        removed.append(Path(entry.path))
    if removed:
        logger.info("removed %d temporary file(s) left by dead writers in %s", len(removed),
                    folder)
    return removed


def describe_os_error(exc: BaseException) -> str:
    """The cause of an OSError without the file name (which may be a temporary's)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}"


class _FullWriter:
    """A file object whose write() writes everything or raises. A raw write can be short
    (a file-size limit, a nearly full disk), and torch.save turns a short write into an
    error that no longer says why; this writer raises the OSError and keeps it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.error: OSError | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as exc:
            self.error = self.error or exc
            raise
        return size

    def flush(self) -> None:
        """Nothing is buffered."""


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # makes the rename itself durable
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomically(path: Path, write: Callable[[IO[bytes]], None], *,
                     error: type[Exception], what: str = "file",
                     replace_link: bool = False) -> Path:
    """Write `path` through `write(file)` atomically. A `path` that is a symlink is refused
    (a save never writes through a link it did not create; the folders above it may be
    links), or with `replace_link` replaced by the new file, never followed (a name that
    only this code writes, such as a distributed checkpoint's CURRENT); an existing file
    keeps its permission bits; a new file gets the umask's. Any
    failure raises `error` naming `path` and the cause, with the old file untouched and the
    temporary removed. Returns the file written."""
    def fail(cause: str) -> Exception:
        shown = f"{path}" if target == path else f"{path} (-> {target})"
        return error(f"cannot save {what} {shown}: {cause}; nothing was changed")

    target = path
    try:
        folder = Path(os.path.realpath(path.parent))
        target = folder / path.name
        if not path.name or path.name in (".", ".."):
            raise IsADirectoryError(errno.EISDIR, "it is a directory")
        try:  # lstat: a link is looked at, never followed
            existing: os.stat_result | None = os.lstat(target)
        except FileNotFoundError:
            existing = None
        folder_exists = folder.is_dir()
    except (OSError, ValueError) as exc:  # overlong name, NUL byte, loop of links, ...
        raise fail(describe_os_error(exc)) from exc
    if existing is not None and stat.S_ISLNK(existing.st_mode) and replace_link:
        existing = None  # os.replace below replaces the link itself
    if existing is not None and stat.S_ISLNK(existing.st_mode):
        raise fail("it is a symbolic link, which a save never follows; remove the link or "
                   "save to the file it points to")
    if existing is not None and stat.S_ISDIR(existing.st_mode):
        raise fail("it is a directory")
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        raise fail("it is not a regular file")
    if not folder_exists:
        raise fail(f"directory {folder} does not exist")
    remove_dead_temporaries(folder)
    tmp = folder / temp_name(target.name)
    try:
        # O_EXCL | O_NOFOLLOW: never write through someone else's file or a planted link.
        # Mode 0o666 is narrowed by the umask, as for any new file; an existing file's bits
        # are copied.
        flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_NOFOLLOW", 0))
        fd = os.open(tmp, flags, 0o666)
    except OSError as exc:
        raise fail(describe_os_error(exc)) from exc
    writer = _FullWriter(fd)
    try:
        try:
            if existing is not None:
                os.fchmod(fd, stat.S_IMODE(existing.st_mode))
            write(writer)  # type: ignore[arg-type]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt, SystemExit: not ours to translate
        cause = writer.error or exc  # the OSError a writer may have wrapped in its own error
        if isinstance(cause, OSError) and cause.errno in _DISK_FULL:
            raise fail(f"no space left on the device ({describe_os_error(cause)})") from exc
        raise fail(describe_os_error(cause)) from exc
    _fsync_folder(folder)
    return target
