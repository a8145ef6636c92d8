"""What a rank knows about itself: the launcher's environment, read and checked, and the
context `initialize()` returns. No torchbridge imports above errors, so the strategies
module (imported by the Backend facade) can read the current context without a cycle.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchbridge.errors import DistributedError

if TYPE_CHECKING:
    from torchbridge.backend import Backend

# Set by torchrun (torch.distributed.run) for every worker it starts. RANK, WORLD_SIZE and
# LOCAL_RANK say that a launcher started us; the rendezvous address is what env:// needs.
LAUNCH_MARKERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchEnvironment:
    """The launcher's variables, checked. `None` from `read_launch_env` means no launcher."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str
    master_port: int


def _integer(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"environment variable {name}={raw!r} is not an integer; "
                               "start the script with `torchbridge launch` or torchrun, "
                               "which set it") from None


def read_launch_env(env: Mapping[str, str]) -> LaunchEnvironment | None:
    """The launcher's environment, or None when the process was not started by one (none of
    RANK, WORLD_SIZE, LOCAL_RANK set). Missing or inconsistent values are a DistributedError
    naming the variables."""
    if not any(name in env for name in LAUNCH_MARKERS):
        return None
    missing = [name for name in REQUIRED if not env.get(name)]
    if missing:
        present = ", ".join(f"{n}={env[n]}" for n in LAUNCH_MARKERS if n in env)
        raise DistributedError(
            f"incomplete launcher environment: {', '.join(missing)} not set (found "
            f"{present}). Start the script with `torchbridge launch --nproc-per-node N "
            "script.py` (or torchrun), or unset RANK, WORLD_SIZE and LOCAL_RANK to run as "
            "one process")
    rank, world_size = _integer(env, "RANK"), _integer(env, "WORLD_SIZE")
    local_rank, port = _integer(env, "LOCAL_RANK"), _integer(env, "MASTER_PORT")
    local_world = _integer(env, "LOCAL_WORLD_SIZE") if env.get("LOCAL_WORLD_SIZE") else None
    problems = []
    if world_size < 1:
        problems.append(f"WORLD_SIZE={world_size} must be at least 1")
    elif not 0 <= rank < world_size:
        problems.append(f"RANK={rank} must be in [0, WORLD_SIZE={world_size})")
    if local_rank < 0:
        problems.append(f"LOCAL_RANK={local_rank} must not be negative")
    if local_world is not None:
        if not 0 <= local_rank < local_world:
            problems.append(f"LOCAL_RANK={local_rank} must be in [0, LOCAL_WORLD_SIZE="
                            f"{local_world})")
        if world_size >= 1 and not 1 <= local_world <= world_size:
            problems.append(f"LOCAL_WORLD_SIZE={local_world} must be in [1, WORLD_SIZE="
                            f"{world_size}]")
    if not 0 < port < 65536:
        problems.append(f"MASTER_PORT={port} is not a TCP port")
    if problems:
        raise DistributedError("inconsistent launcher environment: " + "; ".join(problems))
    return LaunchEnvironment(rank, world_size, local_rank, local_world, env["MASTER_ADDR"],
                             port)


@dataclass(frozen=True)
class DistributedContext:
    """This rank in the default process group, as `torchbridge.distributed.initialize()`
    set it up.

    `backend` is the TorchBridge backend bound to this rank's device (`device`): prepare
    the model through it. `process_group_backend` is what the backend's plugin named
    ("nccl", "gloo", "xccl", ...); `cpu_process_group_backend` is "gloo" where that backend
    cannot carry CPU tensors and gloo was added for them, else None.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: Backend
    process_group_backend: str
    cpu_process_group_backend: str | None
    launched: bool  # started by torchrun / torchbridge launch (False: one-process group)
    owns_group: bool  # initialize() created the process group (destroy() removes it)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, prints and writes single-file outputs."""
        return self.rank == 0

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "local_rank": self.local_rank,
                "world_size": self.world_size, "local_world_size": self.local_world_size,
                "device": str(self.device), "backend": self.backend.name,
                "process_group_backend": self.process_group_backend,
                "cpu_process_group_backend": self.cpu_process_group_backend,
                "launched": self.launched}


# The one context of this process; guarded so that initialize() is idempotent under threads.
LOCK = threading.RLock()
_current: list[DistributedContext] = []


def current_context() -> DistributedContext | None:
    """The context `initialize()` returned, or None before it (or after `destroy()`)."""
    return _current[0] if _current else None


def set_context(context: DistributedContext | None) -> None:
    _current.clear()
    if context is not None:
        _current.append(context)
