"""Checkpoints under crashes and bad input: saves killed with SIGKILL, concurrent writers,
temporaries of dead writers, permissions and symlinks, every way a save can fail, and
damaged, foreign and hostile files on load (property-based: any truncation, any flipped
byte, any bytes at all)."""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import pickle
import random
import signal
import stat
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torchbridge
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchbridge import CheckpointError, atomic_file
from torchbridge.atomic_file import TEMP_MARK, pid_alive, temp_name

posix_only = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def temporaries(folder: Path) -> list[str]:
    return [n for n in os.listdir(folder) if TEMP_MARK in n]


def in_child(fn: Callable[[], object]) -> str:
    """Run `fn` in a forked child; its result (or exception) as text."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            result = repr(fn())
        except BaseException as exc:
            result = f"{type(exc).__name__}: {exc}"
        os.write(write, result.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


def dead_pid() -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def state_of(value: float, n: int = 1 << 20) -> dict[str, torch.Tensor]:
    return {"a": torch.full((n,), value), "b": torch.full((n // 2,), value),
            "step": torch.tensor(int(value))}


def uniform_value(state: dict[str, torch.Tensor]) -> float:
    """The value every tensor holds; fails unless the checkpoint is one complete save."""
    assert set(state) == {"a", "b", "step"}
    value = float(state["a"][0])
    assert state["a"].numel() == 1 << 20 and state["b"].numel() == 1 << 19
    assert bool((state["a"] == value).all()) and bool((state["b"] == value).all())
    assert int(state["step"]) == int(value)
    return value


# -- crashes and concurrency ---------------------------------------------------------------

# What a save does to the file system while its temporary exists: each write of data, and
# the rename that publishes it. Killing a writer just before one of them is killing it at
# that point of the save, chosen without racing a timer against the writer.
SAVE_STEPS = ("write", "replace")


def steps_of_one_save(state: dict[str, torch.Tensor], path: Path) -> int:
    calls = [0]
    originals = {name: getattr(os, name) for name in SAVE_STEPS}

    def counted(name: str) -> Callable[..., object]:
        def step(*args: object) -> object:
            calls[0] += 1
            return originals[name](*args)
        return step

    with pytest.MonkeyPatch.context() as mp:
        for name in SAVE_STEPS:
            mp.setattr(os, name, counted(name))
        torchbridge.save_checkpoint(state, path)
    return calls[0]


def die_at_step(step: int) -> None:
    """In a forked child: SIGKILL this process just before its `step`-th save step."""
    calls = [0]

    def wrap(original: Callable[..., object]) -> Callable[..., object]:
        def step_or_die(*args: object) -> object:
            calls[0] += 1
            if calls[0] == step:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args)
        return step_or_die

    for name in SAVE_STEPS:
        setattr(os, name, wrap(getattr(os, name)))


@posix_only
def test_saves_killed_at_random_points_keep_the_previous_file_and_leave_no_temporaries(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(atomic_file, "STALE_AFTER_S", 0.0)  # no grace period for the test
    path = tmp_path / "ckpt.pt"
    states = [state_of(float(v)) for v in (1, 2, 3)]
    torchbridge.save_checkpoint(states[0], path)
    probe = tmp_path / "probe"
    probe.mkdir()
    steps = steps_of_one_save(states[0], probe / "ckpt.pt")
    assert steps >= 4  # writes, then the rename
    rng = random.Random(0)
    # Points in the child's first three saves, the first and last steps of one always among
    # them, the rest at random.
    for kill_at in [1, steps, steps + 1, *rng.sample(range(2, 3 * steps + 1), 9)]:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child saves until it is killed
            try:
                die_at_step(kill_at)
                i = 0
                while True:
                    torchbridge.save_checkpoint(states[i % 3], path)
                    i += 1
            finally:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        assert len(temporaries(tmp_path)) == 1, "killed mid-save: its temporary is left"
        # The file holds one complete save, whatever the save in flight had written.
        assert uniform_value(torch.load(path, weights_only=True)) in (1.0, 2.0, 3.0)
        before = path.read_bytes()
        uniform_value(torchbridge.load_checkpoint(path))  # a load cleans the folder...
        assert temporaries(tmp_path) == []                # ...of the dead save's temporary
        assert path.read_bytes() == before
    torchbridge.save_checkpoint(states[1], path)
    assert temporaries(tmp_path) == [] and sorted(os.listdir(tmp_path)) == ["ckpt.pt", "probe"]


@posix_only
def test_two_processes_saving_to_one_path_leave_one_complete_checkpoint(tmp_path: Path
                                                                        ) -> None:
    path = tmp_path / "shared.pt"
    torchbridge.save_checkpoint(state_of(0.0, 1 << 16), path)
    children = []
    # States are built before forking: torch's OpenMP pool must not run in a forked child.
    for state in (state_of(1.0, 1 << 16), state_of(2.0, 1 << 16)):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the writers
            code = 0
            try:
                for _ in range(15):
                    torchbridge.save_checkpoint(state, path)
            except BaseException:
                code = 1
            os._exit(code)
        children.append(pid)
    running, codes = set(children), []
    while running:
        state = torchbridge.load_checkpoint(path)  # a reader never sees a partial file
        assert state["a"].numel() == 1 << 16 and bool((state["a"] == state["a"][0]).all())
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                codes.append(os.waitstatus_to_exitcode(status))
    assert codes == [0, 0]
    final = torchbridge.load_checkpoint(path)
    assert float(final["a"][0]) in (1.0, 2.0) and bool((final["a"] == final["a"][0]).all())
    assert temporaries(tmp_path) == []


@posix_only
def test_only_temporaries_of_dead_writers_on_this_host_are_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(atomic_file, "STALE_AFTER_S", 0.0)  # no grace period for the test
    dead = tmp_path / temp_name("m.pt").replace(f"-{os.getpid()}-", f"-{dead_pid()}-")
    live = tmp_path / temp_name("m.pt")                        # ours: this process is alive
    other_host = tmp_path / f".m.pt{TEMP_MARK}00000000-{dead_pid()}-0123abcd"
    unrelated = tmp_path / ".m.pt.tmp"
    for f in (dead, live, other_host, unrelated):
        f.write_bytes(b"partial")
    torchbridge.save_checkpoint({"w": torch.ones(2)}, tmp_path / "m.pt")
    assert not dead.exists()
    assert live.exists() and other_host.exists() and unrelated.exists()
    assert pid_alive(os.getpid()) and not pid_alive(dead_pid())


@pytest.mark.skipif(sys.platform != "linux", reason="zombies are seen through /proc")
def test_a_killed_unreaped_writer_counts_as_dead(tmp_path: Path) -> None:
    pid = os.fork()
    if pid == 0:  # pragma: no cover
        time.sleep(3600)  # killed long before
        os._exit(0)
    os.kill(pid, signal.SIGKILL)
    # Waits until it has died, without reaping it: now a zombie, which exists until reaped.
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    try:
        assert not pid_alive(pid)
    finally:
        os.waitpid(pid, 0)


def test_a_temporary_name_fits_the_filesystem_for_any_target_name(tmp_path: Path) -> None:
    name = "x" * 250
    torchbridge.save_checkpoint({"w": torch.ones(1)}, tmp_path / name)
    assert torchbridge.load_checkpoint(tmp_path / name)["w"].item() == 1.0
    assert len(temp_name(name).encode()) <= 255


# -- permissions, symlinks ----------------------------------------------------------------

@posix_only
def test_a_replaced_file_keeps_its_mode_and_a_new_one_gets_the_umasks(tmp_path: Path
                                                                      ) -> None:
    path = tmp_path / "m.pt"
    torchbridge.save_checkpoint({"w": torch.ones(2)}, path)
    os.chmod(path, 0o640)
    torchbridge.save_checkpoint({"w": torch.zeros(2)}, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    old = os.umask(0o027)
    try:
        torchbridge.save_checkpoint({"w": torch.ones(2)}, tmp_path / "new.pt")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.pt").stat().st_mode) == 0o640
    os.umask(old)
    torchbridge.save_checkpoint({"w": torch.ones(2)}, tmp_path / "new2.pt")
    assert stat.S_IMODE((tmp_path / "new2.pt").stat().st_mode) == 0o666 & ~old


@posix_only
def test_a_symlinked_path_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    # A save never writes through a link it did not create (issue 20): it refuses.
    real = tmp_path / "store" / "real.pt"
    real.parent.mkdir()
    torchbridge.save_checkpoint({"w": torch.ones(2)}, real)
    before = real.read_bytes()
    link = tmp_path / "latest.pt"
    link.symlink_to(real)
    with pytest.raises(CheckpointError, match="symbolic link"):
        torchbridge.save_checkpoint({"w": torch.full((2,), 7.0)}, link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_bytes() == before
    assert temporaries(tmp_path) == [] and temporaries(real.parent) == []


# -- every way a save can fail ------------------------------------------------------------

def assert_failed_cleanly(info: pytest.ExceptionInfo[CheckpointError], path: Path,
                          cause: str, before: bytes | None) -> None:
    message = str(info.value)
    assert str(path) in message and cause in message, message
    assert TEMP_MARK not in message  # names the target, never the temporary
    if before is not None:
        assert path.read_bytes() == before
    assert temporaries(path.parent) == []


@pytest.fixture
def previous(tmp_path: Path) -> tuple[Path, bytes]:
    path = tmp_path / "m.pt"
    torchbridge.save_checkpoint({"w": torch.ones(4)}, path)
    return path, path.read_bytes()


def test_an_unpicklable_value_fails_naming_the_file(previous: tuple[Path, bytes]) -> None:
    path, before = previous
    with pytest.raises(CheckpointError) as info:
        torchbridge.save_checkpoint({"w": torch.ones(2), "f": lambda: 0}, path)
    assert_failed_cleanly(info, path, "pickle", before)


def test_a_defaultdict_is_saved_as_a_plain_dict(tmp_path: Path) -> None:
    state = collections.defaultdict(list, {"w": torch.ones(2),
                                           "inner": collections.defaultdict(int, x=torch.ones(1))})
    torchbridge.save_checkpoint(state, tmp_path / "d.pt")
    loaded = torchbridge.load_checkpoint(tmp_path / "d.pt")  # weights_only: no factory code
    assert type(loaded) is dict and type(loaded["inner"]) is dict
    assert loaded["w"].tolist() == [1.0, 1.0]


def test_a_directory_or_missing_folder_as_target_fails_naming_it(tmp_path: Path) -> None:
    (tmp_path / "d.pt").mkdir()
    with pytest.raises(CheckpointError) as info:
        torchbridge.save_checkpoint({"w": torch.ones(1)}, tmp_path / "d.pt")
    assert_failed_cleanly(info, tmp_path / "d.pt", "is a directory", None)
    with pytest.raises(CheckpointError, match=r"directory .* does not exist"):
        torchbridge.save_checkpoint({}, tmp_path / "no" / "dir.pt")
    with pytest.raises(CheckpointError, match="File name too long"):
        torchbridge.save_checkpoint({}, tmp_path / ("x" * 300))


def test_a_full_disk_fails_naming_the_file(previous: tuple[Path, bytes],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path, before = previous
    real_save = torch.save

    def out_of_space(obj: object, f: object) -> None:
        real_save(obj, f)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/the/temporary")

    monkeypatch.setattr(torch, "save", out_of_space)
    with pytest.raises(CheckpointError) as info:
        torchbridge.save_checkpoint({"w": torch.zeros(4)}, path)
    assert_failed_cleanly(info, path, "no space left", before)
    assert "/the/temporary" not in str(info.value)


@posix_only
def test_a_write_the_system_refuses_fails_naming_the_file(previous: tuple[Path, bytes]
                                                          ) -> None:
    """A file-size limit makes the kernel refuse the write (EFBIG), as a full disk would."""
    import resource

    path, before = previous

    state = {"w": torch.zeros(1 << 18)}

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        torchbridge.save_checkpoint(state, path)

    outcome = in_child(limited)
    assert outcome.startswith("CheckpointError") and str(path) in outcome, outcome
    assert "File too large" in outcome
    assert path.read_bytes() == before and temporaries(path.parent) == []


@posix_only
def test_a_read_only_folder_fails_naming_the_file() -> None:
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        os.chmod(folder, 0o755)
        path = folder / "m.pt"
        torchbridge.save_checkpoint({"w": torch.ones(4)}, path)
        before = path.read_bytes()
        if os.geteuid() != 0:
            os.chmod(folder, 0o555)

        def save_as_someone_else() -> None:
            if os.geteuid() == 0:  # root writes anywhere: become nobody first
                os.setgid(65534)
                os.setuid(65534)
            torchbridge.save_checkpoint({"w": torch.zeros(4)}, path)

        outcome = in_child(save_as_someone_else)
        assert outcome.startswith("CheckpointError") and str(path) in outcome, outcome
        assert "Permission denied" in outcome
        assert path.read_bytes() == before and temporaries(folder) == []
    finally:
        os.chmod(folder, 0o755)
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()


# -- loading damaged, foreign and hostile files -------------------------------------------

@pytest.fixture(scope="module")
def good_bytes() -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save({"w": torch.arange(64, dtype=torch.float32), "n": {"i": torch.arange(3)}},
               buffer)
    return buffer.getvalue()


def load_bytes(folder: Path, data: bytes) -> object:
    path = folder / "x.pt"
    path.write_bytes(data)
    return torchbridge.load_checkpoint(path)


def assert_damaged(info: pytest.ExceptionInfo[CheckpointError], path: Path) -> None:
    message = str(info.value)
    assert str(path) in message and "damaged or not a checkpoint" in message, message
    assert "weights_only=False" not in message


def test_empty_truncated_flipped_and_foreign_files_are_named_as_damaged(
        tmp_path: Path, good_bytes: bytes) -> None:
    path = tmp_path / "x.pt"
    flipped = bytearray(good_bytes)
    flipped[len(good_bytes) // 2] ^= 0x01  # inside the tensor data: torch.load would not see
    foreign_zip = tmp_path / "foreign.zip"
    with zipfile.ZipFile(foreign_zip, "w") as archive:
        archive.writestr("readme.txt", "hello")
    hostile = b"cos\nsystem\n(S'echo pwned'\ntR."  # a pickle that would run a command
    for data in (b"", good_bytes[:100], good_bytes[:-10], bytes(flipped), b"not a checkpoint",
                 foreign_zip.read_bytes(), pickle.dumps({"w": [1.0]}), hostile,
                 os.urandom(4096)):
        with pytest.raises(CheckpointError) as info:
            load_bytes(tmp_path, data)
        assert_damaged(info, path)


def test_an_intact_file_with_other_objects_suggests_weights_only_false(tmp_path: Path
                                                                       ) -> None:
    path = tmp_path / "obj.pt"
    torch.save({"w": torch.ones(2), "when": Path("/tmp")}, path)
    with pytest.raises(CheckpointError, match=r"intact.*PosixPath.*weights_only=False.*runs "
                       "code"):
        torchbridge.load_checkpoint(path)
    assert torchbridge.load_checkpoint(path, weights_only=False)["when"] == Path("/tmp")
    legacy = tmp_path / "legacy.pt"
    torch.save({"when": Path("/tmp")}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match=r"intact.*weights_only=False"):
        torchbridge.load_checkpoint(legacy)


@dataclasses.dataclass
class RunMeta:  # a module-level dataclass: pickled with NEWOBJ and BUILD
    epoch: int = 3


def test_an_object_pickled_through_new_and_build_is_not_called_damaged(tmp_path: Path
                                                                       ) -> None:
    # The dry run's stand-in object lacked its record when pickle made it through __new__
    # alone (a dataclass; torchao's int8 weights hold one): intact files were "damaged".
    path = tmp_path / "meta.pt"
    torch.save({"w": torch.ones(2), "meta": RunMeta()}, path)
    with pytest.raises(CheckpointError, match=r"intact.*RunMeta.*weights_only=False"):
        torchbridge.load_checkpoint(path)
    assert torchbridge.load_checkpoint(path, weights_only=False)["meta"] == RunMeta()


def test_a_tensor_subclass_in_safetensors_is_a_checkpoint_error(tmp_path: Path) -> None:
    class Tagged(torch.Tensor):  # stands for a quantized weight (torchao's Int8Tensor)
        pass

    path = tmp_path / "tagged.safetensors"
    with pytest.raises(CheckpointError, match=r"'w' is a Tagged \(a tensor subclass.*\.pt"):
        torchbridge.save_checkpoint({"w": torch.ones(2).as_subclass(Tagged)}, path)
    assert not path.exists()


@posix_only
def test_a_directory_or_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is a directory"):
        torchbridge.load_checkpoint(tmp_path)
    os.mkfifo(tmp_path / "pipe.pt")
    with pytest.raises(CheckpointError, match="not a regular file"):
        torchbridge.load_checkpoint(tmp_path / "pipe.pt")


def test_integer_bool_and_complex_tensors_keep_their_dtype(tmp_path: Path) -> None:
    state = {"f": torch.ones(2), "i": torch.arange(3), "b": torch.tensor([True, False]),
             "c": torch.ones(2, dtype=torch.complex64), "h": torch.ones(2, dtype=torch.half)}
    torchbridge.save_checkpoint(state, tmp_path / "m.pt")
    loaded = torchbridge.load_checkpoint(tmp_path / "m.pt", dtype=torch.bfloat16)
    assert {k: v.dtype for k, v in loaded.items()} == {
        "f": torch.bfloat16, "i": torch.int64, "b": torch.bool, "c": torch.complex64,
        "h": torch.bfloat16}
    assert torch.equal(loaded["i"], state["i"]) and torch.equal(loaded["b"], state["b"])


def test_a_state_dicts_module_versions_survive(tmp_path: Path) -> None:
    bn = torch.nn.BatchNorm1d(3)
    torchbridge.save_checkpoint(bn, tmp_path / "bn.pt")
    loaded = torchbridge.load_checkpoint(tmp_path / "bn.pt")
    assert loaded._metadata == bn.state_dict()._metadata


FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.data())
def test_any_truncation_or_flipped_byte_loads_identically_or_is_a_checkpoint_error(
        tmp_path: Path, good_bytes: bytes, data: st.DataObject) -> None:
    damaged = bytearray(good_bytes)
    if data.draw(st.booleans(), label="truncate"):
        damaged = damaged[:data.draw(st.integers(0, len(good_bytes) - 1), label="cut")]
    else:
        where = data.draw(st.integers(0, len(good_bytes) - 1), label="at")
        damaged[where] ^= data.draw(st.integers(1, 255), label="mask")
    try:
        loaded = load_bytes(tmp_path, bytes(damaged))
    except CheckpointError as exc:
        assert "weights_only=False" not in str(exc)
        return
    # A change the format cannot see (zip padding, a flag byte) must not change the data.
    assert torch.equal(loaded["w"], torch.arange(64, dtype=torch.float32))  # type: ignore[index]
    assert torch.equal(loaded["n"]["i"], torch.arange(3))  # type: ignore[index]


@FUZZ
@given(blob=st.binary(max_size=2048))
def test_arbitrary_bytes_are_a_checkpoint_error_never_advice_to_run_them(
        tmp_path: Path, blob: bytes) -> None:
    with pytest.raises(CheckpointError) as info:
        load_bytes(tmp_path, blob)
    assert "weights_only=False" not in str(info.value)


def test_arguments_of_the_wrong_type_are_checkpoint_errors(tmp_path: Path) -> None:
    torchbridge.save_checkpoint({"w": torch.ones(1)}, tmp_path / "m.pt")
    with pytest.raises(CheckpointError, match="backend must be a Backend"):
        torchbridge.load_checkpoint(tmp_path / "m.pt", backend=3)
    with pytest.raises(CheckpointError, match="path must be"):
        torchbridge.load_checkpoint(3)  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="path must be"):
        torchbridge.save_checkpoint({}, None)  # type: ignore[arg-type]


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("POSIX file semantics are tested on Linux")
