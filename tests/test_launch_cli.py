"""`torchbridge launch` argument checking: every mistake is one line on stderr and exit
status 2, before torchrun starts; arguments that would make torchrun wait for nodes that
cannot arrive are refused; a rendezvous that does start times out with one line; and a
correct launch still starts two gloo ranks with torchrun's options passed through."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
from hang_bounds import HANG_S
from torchbridge.cli import main

SCRIPT = "ok.py"  # written into the working directory (tmp_path) by the fixture below
HANG_BOUND = HANG_S  # only to tell a refusal from torchrun waiting (tests/hang_bounds.py)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")

# (arguments after `torchbridge launch`, what the one line must say)
def _torchrun_has(option: str) -> bool:
    from torch.distributed.run import get_args_parser

    return any(option in action.option_strings for action in get_args_parser()._actions)


_TORCHRUN_HAS_SIGNALS = _torchrun_has("--signals-to-handle")  # torch 2.10+, not 2.9

MISTAKES: list[tuple[list[str], str]] = [
    # parsing
    (["--bogus", SCRIPT], "unrecognized arguments: --bogus"),
    ([], "no training script"),
    (["--nproc-per-node", "2"], "no training script"),
    (["--nproc-per-node"], "expected one argument"),
    (["--max-restarts", "x", SCRIPT], "invalid int value: 'x'"),
    (["--start-method", "thread", SCRIPT], "invalid choice: 'thread'"),
    # the script
    (["missing.py"], "training script 'missing.py' does not exist"),
    (["adir"], "is a directory without __main__.py"),
    (["-m", "--no-python", "x"], "--module and --no-python together"),
    (["-m", "not a module"], "not a module name"),
    (["--no-python", "no-such-program-tb"], "no such executable"),
    # process and node counts
    (["--nproc-per-node", "two", SCRIPT], "--nproc-per-node 'two': expected a positive"),
    (["--nproc-per-node", "0", SCRIPT], "--nproc-per-node 0: expected a positive"),
    (["--nproc-per-node", "-2", SCRIPT], "--nproc-per-node -2: expected a positive"),
    (["--nproc-per-node", "gpu", SCRIPT], "--nproc-per-node gpu: Cuda is not available"),
    (["--nnodes", "0", SCRIPT], "--nnodes '0': expected 0 < MIN <= MAX"),
    (["--nnodes", "-1", SCRIPT], "--nnodes '-1': expected 0 < MIN <= MAX"),
    (["--nnodes", "3:2", SCRIPT], "--nnodes '3:2': expected 0 < MIN <= MAX"),
    (["--nnodes", "1:2:3", SCRIPT], "--nnodes '1:2:3': expected a node count"),
    (["--nnodes", "two", SCRIPT], "--nnodes 'two': expected a node count"),
    (["--nnodes", "", SCRIPT], "--nnodes '': expected a node count"),
    (["--max-restarts", "-1", SCRIPT], "--max-restarts -1: expected 0 or more"),
    (["--monitor-interval", "0", SCRIPT], "--monitor-interval 0.0: expected a positive"),
    (["--node-rank", "-1", SCRIPT], "--node-rank -1: expected 0 to 0"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "localhost", "--master-port",
      "29500", SCRIPT], "--node-rank 2: expected 0 to 1"),
    (["--master-port", "70000", SCRIPT], "--master-port 70000: expected a port"),
    # waiting forever
    (["--standalone", "--nnodes", "2", SCRIPT], "--standalone is one node"),
    (["--standalone", "--nnodes", "1:2", SCRIPT], "--standalone is one node"),
    (["--nnodes", "2", SCRIPT], "--nnodes 2 without a rendezvous endpoint"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", SCRIPT], "and no --rdzv-endpoint"),
    (["--nnodes", "1:4", "--master-port", "29500", SCRIPT],
     "the static rendezvous needs a fixed node count"),
    # the rendezvous
    (["--rdzv-backend", "nosuch", SCRIPT], "--rdzv-backend 'nosuch': unknown"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "host:99999", SCRIPT],
     "a port from 0 to 65535"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "bad host!:29500", SCRIPT],
     "expected HOST or HOST:PORT"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "no-such-host.invalid:29500", SCRIPT],
     "host 'no-such-host.invalid' does not resolve"),
    (["--rdzv-conf", "join_timeout", SCRIPT], "--rdzv-conf 'join_timeout': expected KEY="),
    (["--rdzv-conf", "join_timeout=-5", SCRIPT], "join_timeout=-5: expected a positive"),
    # torchrun's other options
    (["--redirects", "7", SCRIPT], "--redirects '7': expected 0-3"),
    (["--local-ranks-filter", "a,b", SCRIPT], "--local-ranks-filter 'a,b'"),
    (["--signals-to-handle", "SIGNOPE", SCRIPT],
     "not signal names: 'SIGNOPE'" if _TORCHRUN_HAS_SIGNALS else "unrecognized arguments"),
    (["--log-dir", SCRIPT, SCRIPT], "exists and is not a directory"),
    (["--event-log-handler", "nosuch", SCRIPT], "--event-log-handler 'nosuch': unknown"),
    # --backend: a TorchBridge backend, known, available, with a process-group backend
    (["--backend", "nosuch", SCRIPT], "--backend 'nosuch': unknown backend 'nosuch'"),
    (["--backend", "nosuch", "--nproc-per-node", "auto", SCRIPT], "unknown backend 'nosuch'"),
    (["--backend", "gloo", SCRIPT], "'gloo' is a torch.distributed process-group backend"),
    (["--backend", "nccl", SCRIPT], "'nccl' is a torch.distributed process-group backend"),
    (["--backend", "cuda", SCRIPT], "backend 'cuda' is unavailable"),
    (["--backend", "", SCRIPT], "--backend is empty"),
    (["--backend", "cpu:x", SCRIPT], "bad device index 'x'"),
]


@pytest.fixture(autouse=True)
def workdir(tmp_path: Path) -> Path:
    """The conftest already runs each test in tmp_path: a script and a directory there."""
    (tmp_path / SCRIPT).write_text("print('ok')\n")
    (tmp_path / "adir").mkdir()
    return tmp_path


@pytest.fixture
def no_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused launch never reaches torchrun."""
    import torch.distributed.run

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("torchrun ran despite a bad argument")

    monkeypatch.setattr(torch.distributed.run, "run", must_not_run)


@pytest.fixture
def hang_guard() -> Iterator[None]:
    """Fail, instead of waiting, if the command is still running after HANG_BOUND."""
    def expired(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"still running after {HANG_BOUND:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, HANG_BOUND)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def assert_one_line(err: str, problem: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("torchbridge launch: error: ") and problem in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize(("argv", "problem"), MISTAKES,
                         ids=[" ".join(argv) or "(nothing)" for argv, _ in MISTAKES])
@pytest.mark.usefixtures("no_torchrun", "hang_guard")
def test_a_bad_launch_argument_is_one_line_and_exit_status_2(
        argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    assert main(["launch", *argv]) == 2
    assert time.monotonic() - started < HANG_BOUND
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_one_line(captured.err, problem)


@pytest.mark.usefixtures("no_torchrun", "hang_guard")
def test_a_bad_torchbridge_backend_variable_is_checked_too(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TORCHBRIDGE_BACKEND", "nosuch")
    assert main(["launch", SCRIPT]) == 2
    assert_one_line(capsys.readouterr().err, "TORCHBRIDGE_BACKEND 'nosuch': unknown backend")


@pytest.mark.usefixtures("no_torchrun", "hang_guard")
def test_debug_shows_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["launch", "--debug", "--backend", "nosuch", SCRIPT],
                 ["--debug", "launch", "--standalone", "--nnodes", "2", SCRIPT]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and "LaunchError" in err
        assert err.strip().splitlines()[-1].startswith("torchbridge launch: error: ")


# -- help: TorchBridge's own options first, then a pointer to torchrun's ----------------------

@pytest.mark.usefixtures("no_torchrun")
@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--nnodes", "2", "--help"],
                                  ["--nproc-per-node", "auto", "-h", SCRIPT]])
def test_launch_help_shows_torchbridge_options_then_points_to_torchrun(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["launch", *argv])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    options = text.split("options:")[1].split("torchrun's options pass through")[0]
    for own in ("--nproc-per-node N|auto", "--backend NAME", "--debug"):
        assert own in options
    assert "auto, one per device" in options and "TorchBridge backend" in options
    assert "torchrun --help" in text.split("options:")[1]
    # torchrun's full list (about 160 lines, with its own `auto`) is not repeated here
    assert len(text.splitlines()) < 70
    assert "--log-line-prefix-template" not in text and "--local-addr" not in text


@pytest.mark.parametrize(("argv", "ours"), [
    (["--help"], True),
    (["--nnodes", "2", "--help"], True),
    (["--nproc-per-node", "2", "-h", SCRIPT, "--epochs", "3"], True),
    ([SCRIPT, "--help"], False),
    (["--standalone", SCRIPT, "--help"], False),
    (["--nproc-per-node", "2", SCRIPT, "-h"], False),
    (["-m", "mypackage.train", "--help"], False),
    ([SCRIPT, "--epochs", "3"], False),
])
def test_a_help_after_the_script_is_the_scripts(argv: list[str], ours: bool) -> None:
    from torchbridge.cli import _launch_wants_help

    assert _launch_wants_help(argv) is ours


# -- as a command: a real process, bounded ---------------------------------------------------

def command(cwd: Path, *args: str, timeout: float = HANG_BOUND
            ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHBRIDGE_") and k not in LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "torchbridge", "launch", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def own_lines(stderr: str) -> str:
    """stderr without the load warnings of the deliberately broken plugins this test
    environment installs (tests/misbehaving_plugins)."""
    return "\n".join(line for line in stderr.splitlines()
                     if not line.startswith("WARNING torchbridge.plugins: plugin "))


@pytest.mark.parametrize("argv", [["--standalone", "--nnodes", "2", SCRIPT],
                                  ["--backend", "nosuch", SCRIPT],
                                  ["--nnodes", "2", SCRIPT]],
                         ids=["standalone-two-nodes", "backend-nosuch", "two-nodes-no-endpoint"])
def test_the_reported_cases_as_a_command(tmp_path: Path, argv: list[str]) -> None:
    started = time.monotonic()
    done = command(tmp_path, *argv)
    assert time.monotonic() - started < HANG_BOUND
    assert done.returncode == 2 and done.stdout == ""
    assert_one_line(own_lines(done.stderr), "")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_a_rendezvous_nobody_joins_times_out_with_one_line(tmp_path: Path) -> None:
    started = time.monotonic()
    done = command(tmp_path, "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                   f"localhost:{free_port()}", "--rdzv-id", "lonely", "--rdzv-conf",
                   "join_timeout=3", SCRIPT, timeout=HANG_S)
    assert time.monotonic() - started < HANG_S  # gave up on the join timeout, not a hang
    assert done.returncode == 2
    assert_one_line(own_lines(done.stderr), "RendezvousTimeoutError")
    assert "join_timeout" in done.stderr


@pytest.mark.slow
def test_a_correct_launch_still_starts_two_gloo_ranks(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(
        "import json, sys\n"
        "import torch, torch.distributed as dist\n"
        "import torchbridge.distributed as tbd\n"
        "ctx = tbd.initialize()\n"
        "total = torch.tensor([ctx.rank + 1.0])\n"
        "dist.all_reduce(total)\n"
        "json.dump({'rank': ctx.rank, 'world': ctx.world_size, 'sum': total.item(),\n"
        "           'pg': ctx.process_group_backend, 'argv': sys.argv[1:]},\n"
        "          open(f'tiny{ctx.rank}.json', 'w'))\n"
        "tbd.destroy()\n")
    # torchrun's own options pass through: --max-restarts, --monitor-interval, --rdzv-conf,
    # --redirects; so do the script's arguments, options included.
    done = command(tmp_path, "--standalone", "--nproc-per-node", "2", "--backend", "cpu",
                   "--max-restarts", "0", "--monitor-interval", "0.2", "--rdzv-conf",
                   "join_timeout=60", "--redirects", "0", str(script), "--lr", "0.1",
                   timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((tmp_path / f"tiny{r}.json").read_text()) for r in (0, 1)]
    assert results == [{"rank": r, "world": 2, "sum": 3.0, "pg": "gloo",
                        "argv": ["--lr", "0.1"]} for r in (0, 1)]
