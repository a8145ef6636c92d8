"""`torchbridge launch`: torchrun (torch.distributed.run) with the process count taken from
the selected backend. Every torchrun option passes through unchanged, so a multi-node job
is started exactly as torchrun documents it.

Every argument is checked before a process starts: a mistake is a LaunchError naming the
option and the fix (the command line prints it as one line, exit status 2), never
torchrun's traceback, and arguments that would leave torchrun waiting for nodes that can
never arrive (--standalone with several nodes, several nodes with no rendezvous endpoint)
are refused. A rendezvous that does start is bounded by torchrun's timeouts (600 s unless
--rdzv-conf join_timeout=/timeout= says otherwise); when one expires that is a LaunchError
too."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import shutil
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from typing import NoReturn

from torchbridge.errors import DistributedError, TorchBridgeError

logger = logging.getLogger(__name__)

DESCRIPTION = """\
Start SCRIPT on --nproc-per-node processes per node with torchrun (torch.distributed.run).
--nproc-per-node auto starts one process per device of the selected backend (at least 1;
--backend NAME or TORCHBRIDGE_BACKEND picks it; the children see the same choice). In the
script, torchbridge.distributed.initialize() joins the group. Every other option is
torchrun's and passes through unchanged, e.g. on each of two machines:
  torchbridge launch --nnodes 2 --node-rank R --nproc-per-node auto \\
      --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --rdzv-id job1 train.py
Arguments are checked first: a mistake is one line and exit status 2 (--debug: traceback).
Several nodes need a rendezvous endpoint (--rdzv-endpoint, or --master-addr/--master-port
with the static rendezvous); --standalone is one node. Waiting for the other nodes ends
after torchrun's rendezvous timeout (600 s; --rdzv-conf join_timeout=SECONDS for c10d,
timeout=SECONDS for static) with a one-line error.
"""

#: torchrun's --nproc-per-node words besides a number (ours: auto, the backend's count).
TORCHRUN_NPROC_WORDS = ("cpu", "gpu", "xpu")
#: --rdzv-conf keys that are a number of seconds or a count and must be positive.
_POSITIVE_CONF = ("join_timeout", "last_call_timeout", "close_timeout", "timeout",
                  "read_timeout", "heartbeat", "keep_alive_interval",
                  "keep_alive_max_attempt")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_HELP = "see torchbridge launch --help"


class LaunchError(DistributedError):
    """A `torchbridge launch` argument that is wrong, or that would make torchrun wait for
    nodes that cannot arrive; or a rendezvous that timed out. Names the option and the fix."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        if "required: training_script" in message:
            message = "no training script: give SCRIPT [ARGS...] after the options"
        raise LaunchError(f"{message} ({_HELP})")


def parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    launch_parser = _Parser(prog="torchbridge launch", description=DESCRIPTION,
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            parents=[get_args_parser()], add_help=False)
    launch_parser.add_argument("--backend", default=None,
                               help="TorchBridge backend whose device count 'auto' means, "
                               "exported to the workers as TORCHBRIDGE_BACKEND; checked "
                               "first: known, available, with a process-group backend")
    launch_parser.add_argument("--debug", action="store_true",
                               help="show the traceback of an error")
    return launch_parser


def resolve_nproc(nproc_per_node: str, backend: str | None) -> str:
    """`auto`: the backend's device count (at least 1). torchrun's own "auto" would count
    CUDA, then XPU, then CPU cores, whatever backend the script runs on."""
    if nproc_per_node != "auto":
        return nproc_per_node
    from torchbridge.backend import get_backend

    selected = get_backend(backend)
    count = max(1, selected.device_count)
    logger.info("--nproc-per-node auto: %d (%s)", count, selected.name)
    return str(count)


# -- checks ----------------------------------------------------------------------------------

def _int(text: str) -> int | None:
    text = text.strip()
    return int(text) if re.fullmatch(r"[+-]?\d+", text) else None


def parse_nnodes(text: str) -> tuple[int, int]:
    """--nnodes N or MIN:MAX as (min, max), 0 < min <= max; LaunchError otherwise."""
    parts = [_int(part) for part in text.split(":")]
    if not 1 <= len(parts) <= 2 or any(part is None for part in parts):
        raise LaunchError(f"--nnodes {text!r}: expected a node count N or a range MIN:MAX "
                          "of whole numbers, such as 2 or 1:4")
    low, high = parts[0], parts[-1]
    assert low is not None and high is not None
    if low <= 0 or high < low:
        raise LaunchError(f"--nnodes {text!r}: expected 0 < MIN <= MAX, such as 2 or 1:4")
    return low, high


def _check_nproc(text: str) -> None:
    value = _int(text)
    if value is not None:
        if value <= 0:
            raise LaunchError(f"--nproc-per-node {text}: expected a positive number of "
                              "processes")
        return
    if text == "auto":
        return
    if text not in (*TORCHRUN_NPROC_WORDS, _privateuse1()):
        raise LaunchError(f"--nproc-per-node {text!r}: expected a positive number, auto (the "
                          "backend's device count) or torchrun's cpu, gpu, xpu")
    from torch.distributed.run import determine_local_world_size

    try:
        count = determine_local_world_size(text)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise LaunchError(f"--nproc-per-node {text}: {exc}") from exc
    if count <= 0:
        raise LaunchError(f"--nproc-per-node {text}: no {text} devices here")


def _privateuse1() -> str:
    import torch

    return str(torch._C._get_privateuse1_backend_name())


def _check_script(args: argparse.Namespace) -> None:
    script = str(args.training_script)
    if not script.strip():
        raise LaunchError(f"empty training script name ({_HELP})")
    if args.module:
        if args.no_python:
            raise LaunchError("--module and --no-python together: --module runs a Python "
                              "module, --no-python a program; give one")
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", script):
            raise LaunchError(f"--module {script!r}: not a module name such as pkg.train")
        return
    if args.no_python and not args.run_path:
        if shutil.which(script) is None:
            raise LaunchError(f"--no-python {script!r}: no such executable (neither a path "
                              "nor on PATH)")
        return
    if not os.path.exists(script):
        raise LaunchError(f"training script {script!r} does not exist (from {os.getcwd()})")
    if os.path.isdir(script) and not os.path.isfile(os.path.join(script, "__main__.py")):
        raise LaunchError(f"training script {script!r} is a directory without __main__.py")


def _check_counts(args: argparse.Namespace, max_nodes: int) -> None:
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts {args.max_restarts}: expected 0 or more")
    if not (math.isfinite(args.monitor_interval) and args.monitor_interval > 0):
        raise LaunchError(f"--monitor-interval {args.monitor_interval}: expected a positive "
                          "number of seconds")
    # torchrun's options differ between torch versions (2.9 has no --shutdown-timeout or
    # --signals-to-handle): check those this torch has.
    shutdown_timeout = getattr(args, "shutdown_timeout", None)
    if shutdown_timeout is not None and shutdown_timeout < 0:
        raise LaunchError(f"--shutdown-timeout {shutdown_timeout}: expected 0 or more "
                          "seconds")
    if not 0 <= args.node_rank < max_nodes:
        raise LaunchError(f"--node-rank {args.node_rank}: expected 0 to {max_nodes - 1} for "
                          f"--nnodes {args.nnodes}")
    if args.master_port is not None and not 0 < args.master_port < 2**16:
        raise LaunchError(f"--master-port {args.master_port}: expected a port from 1 to "
                          "65535")


def _resolves(host: str, seconds: float = 10.0) -> bool:
    """Whether `host` resolves; True when the lookup takes longer than `seconds` (a slow
    resolver is not this command's to judge)."""
    answer: list[bool] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(host, None)
            answer.append(True)
        except (OSError, UnicodeError):
            answer.append(False)

    thread = threading.Thread(target=lookup, daemon=True)
    thread.start()
    thread.join(seconds)
    return answer[0] if answer else True


def _check_endpoint(option: str, endpoint: str) -> None:
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        host, _ = parse_rendezvous_endpoint(endpoint, default_port=29400)
    except ValueError as exc:
        raise LaunchError(f"{option} {endpoint!r}: expected HOST or HOST:PORT with a port "
                          f"from 0 to 65535 ({exc})") from exc
    if not _resolves(host):
        raise LaunchError(f"{option} {endpoint!r}: host {host!r} does not resolve")


def _rdzv_conf(text: str) -> dict[str, str]:
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    try:
        conf = _parse_rendezvous_config(text)
    except ValueError as exc:
        raise LaunchError(f"--rdzv-conf {text!r}: expected KEY=VALUE,... ({exc})") from exc
    for key in _POSITIVE_CONF:
        if key in conf:
            try:
                value = float(conf[key])
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and value > 0):
                raise LaunchError(f"--rdzv-conf {key}={conf[key]}: expected a positive "
                                  "number")
    return conf


def _check_rendezvous(args: argparse.Namespace, nodes: tuple[int, int]) -> None:
    """Refuse what would wait for nodes that cannot arrive."""
    low, high = nodes
    if args.standalone:
        if high != 1:
            raise LaunchError(f"--standalone is one node, but --nnodes is {args.nnodes}: "
                              "torchrun would wait for nodes that never join; drop "
                              "--standalone and give every node --rdzv-backend c10d "
                              "--rdzv-endpoint HOST:PORT --rdzv-id JOB")
        return
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    known = sorted(getattr(rendezvous_handler_registry, "_registry", {}))
    if known and args.rdzv_backend not in known:
        raise LaunchError(f"--rdzv-backend {args.rdzv_backend!r}: unknown; torch knows "
                          f"{', '.join(known)}")
    if args.rdzv_endpoint:
        _check_endpoint("--rdzv-endpoint", args.rdzv_endpoint)
    if args.rdzv_backend == "static":
        if low != high:
            raise LaunchError(f"--nnodes {args.nnodes}: the static rendezvous needs a fixed "
                              "node count; give --nnodes N, or --rdzv-backend c10d for a "
                              "range")
        given = getattr(args, "given_options", None)
        port_given = "--master-port" in given if given is not None \
            else args.master_port is not None
        explicit = args.rdzv_endpoint or port_given or args.master_addr not in _LOOPBACK
        if high > 1 and not explicit:
            raise LaunchError(f"--nnodes {args.nnodes} without a rendezvous endpoint: "
                              "torchrun would wait on this machine's loopback address for "
                              "nodes that cannot reach it; give --rdzv-endpoint HOST:PORT "
                              "(or --master-addr HOST --master-port PORT)")
        if args.master_addr:
            _check_endpoint("--master-addr", args.master_addr)
    elif high > 1 and not args.rdzv_endpoint:
        raise LaunchError(f"--nnodes {args.nnodes} with --rdzv-backend {args.rdzv_backend} "
                          "and no --rdzv-endpoint: every node must meet at one HOST:PORT; "
                          "give --rdzv-endpoint HOST:PORT")


def _check_torchrun_options(args: argparse.Namespace) -> None:
    """What torch.distributed.run would only reject with a traceback, checked with its own
    parsers where it has them."""
    from torch.distributed.elastic.multiprocessing.api import Std

    for option, value in (("--redirects", args.redirects), ("--tee", args.tee)):
        try:
            Std.from_str(value)
        except ValueError as exc:
            raise LaunchError(f"{option} {value!r}: expected 0-3 (none, stdout, stderr, "
                              f"both) or LOCAL_RANK:N,... ({exc})") from exc
    if args.local_ranks_filter:
        ranks = [_int(part) for part in args.local_ranks_filter.split(",")]
        if any(rank is None or rank < 0 for rank in ranks):
            raise LaunchError(f"--local-ranks-filter {args.local_ranks_filter!r}: expected "
                              "comma-separated local ranks such as 0,1")
    if args.log_dir is not None and os.path.exists(args.log_dir) \
            and not os.path.isdir(args.log_dir):
        raise LaunchError(f"--log-dir {args.log_dir!r} exists and is not a directory")
    signals = getattr(args, "signals_to_handle", None) or ""
    names = [name.strip() for name in signals.split(",")] if signals else []
    bad = [name for name in names if name not in signal.Signals.__members__]
    if bad:
        raise LaunchError(f"--signals-to-handle {args.signals_to_handle!r}: not signal "
                          f"names: {', '.join(map(repr, bad))} (such as SIGTERM,SIGINT)")
    from torch.distributed.elastic.events import handlers

    known = sorted(getattr(handlers, "_log_handlers", {}))
    if known and args.event_log_handler not in known:
        raise LaunchError(f"--event-log-handler {args.event_log_handler!r}: unknown; torch "
                          f"knows {', '.join(known)}")
    if args.logs_specs is not None:
        from torch.distributed.run import _get_logs_specs_class

        try:
            _get_logs_specs_class(args.logs_specs)
        except ValueError as exc:
            raise LaunchError(f"--logs-specs {args.logs_specs!r}: {exc}") from exc


def _pg_available() -> dict[str, Callable[[], bool]]:
    import torch.distributed as dist

    names = ("gloo", "nccl", "mpi", "ucc", "xccl")
    return {name: getattr(dist, f"is_{name}_available") for name in names
            if callable(getattr(dist, f"is_{name}_available", None))}


def check_backend(name: str | None) -> None:
    """--backend (else TORCHBRIDGE_BACKEND, where set): a TorchBridge backend that is known
    and available here and whose plugin names a process-group backend this torch has."""
    import torch.distributed as dist

    from torchbridge.backend import get_backend
    from torchbridge.selection import BACKEND_ENV, list_backends

    option = "--backend"
    if name is None:
        name = os.environ.get(BACKEND_ENV) or None
        option = BACKEND_ENV
        if name is None:
            return
    if not dist.is_available():
        raise LaunchError("this torch is built without torch.distributed")
    known = [status.name for status in list_backends()]
    if not name.strip():
        raise LaunchError(f"{option} is empty; expected one of {', '.join(known)}")
    base = name.split(":")[0].strip().lower()
    if base not in known and base in dist.Backend.backend_capability:
        raise LaunchError(f"{option} {name!r} is a torch.distributed process-group backend; "
                          f"{option} names a TorchBridge backend ({', '.join(known)}) and "
                          "initialize() starts the process-group backend its plugin names "
                          "(cpu: gloo)")
    try:
        backend = get_backend(name)
    except TorchBridgeError as exc:
        raise LaunchError(f"{option} {name!r}: {exc}") from exc
    pg_backend = backend.distributed_backend
    if not pg_backend:
        raise LaunchError(f"{option} {name!r}: plugin {backend.plugin} names no "
                          "process-group backend, so the workers cannot form a group")
    available = _pg_available().get(pg_backend.lower())
    if available is not None and not available():
        raise LaunchError(f"{option} {name!r}: its process-group backend {pg_backend} is "
                          "not built into this torch")


def check(args: argparse.Namespace) -> None:
    """Every parsed argument, before a process starts; LaunchError naming the first
    problem."""
    _check_script(args)
    nodes = parse_nnodes(args.nnodes)
    _check_nproc(args.nproc_per_node)
    _check_counts(args, nodes[1])
    _check_rendezvous(args, nodes)
    _rdzv_conf(args.rdzv_conf)
    _check_torchrun_options(args)
    check_backend(args.backend)


def launch(argv: Sequence[str]) -> None:
    """Parse torchrun's arguments (plus --backend), check them and run them. Raises
    LaunchError for a bad argument or a rendezvous that timed out, torch's ChildFailedError
    when a worker fails."""
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import run

    args = parser().parse_args(list(argv))
    # Which options the user gave (torch 2.9 defaults --master-port to 29500, later ones to
    # None: a default says nothing about where the nodes meet).
    own = list(argv)[:list(argv).index(args.training_script)] \
        if args.training_script in argv else list(argv)
    args.given_options = {a.split("=", 1)[0].replace("_", "-") for a in own
                          if a.startswith("--")}
    check(args)
    if args.backend:
        os.environ["TORCHBRIDGE_BACKEND"] = args.backend
    try:
        args.nproc_per_node = resolve_nproc(args.nproc_per_node, args.backend)
    except TorchBridgeError as exc:
        raise LaunchError(f"--nproc-per-node auto: {exc}") from exc
    try:
        run(args)  # type: ignore[no-untyped-call]
    except RendezvousError as exc:
        where = "" if args.standalone else f" at {args.rdzv_endpoint or args.master_addr}"
        detail = str(exc).strip() or ("the other nodes did not join in time"
                                      if "Timeout" in type(exc).__name__ else "no detail")
        raise LaunchError(f"rendezvous ({args.rdzv_backend}{where}) failed: "
                          f"{type(exc).__name__}: {detail}; check that every "
                          "node runs with the same --nnodes, --rdzv-endpoint and --rdzv-id "
                          "(--rdzv-conf join_timeout=SECONDS bounds the wait)") from exc
