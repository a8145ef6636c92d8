"""`initialize()` and `destroy()`: the default process group on whatever backend TorchBridge
selects, started by torchrun (`torchbridge launch`) or as a one-process group without it.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch

from torchbridge.backend import Backend, get_backend
from torchbridge.devices import device_module
from torchbridge.distributed.context import (
    LOCK,
    DistributedContext,
    LaunchEnvironment,
    current_context,
    read_launch_env,
    set_context,
)
from torchbridge.errors import DistributedError

logger = logging.getLogger(__name__)


def _timeout(timeout: Any) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return datetime.timedelta(seconds=timeout)
    raise DistributedError(f"timeout must be a positive number of seconds or a timedelta, "
                           f"got {timeout!r}")


def _rank_backend(backend: Backend | str | None, local_rank: int) -> Backend:
    """The backend on this rank's device: local rank modulo the backend's device count."""
    chosen = backend if isinstance(backend, Backend) else get_backend(backend)
    index = local_rank % max(chosen.device_count, 1)
    if chosen.hook_device() == chosen.hook_device(index):
        return chosen
    return get_backend(f"{chosen.name}:{index}", config=chosen.config)


def bind_device(device: torch.device) -> None:
    """Make `device` this process's current device, so that collectives and kernels
    launched without an explicit device (NCCL's included) use it."""
    module = device_module(device)
    set_device = getattr(module, "set_device", None)
    if set_device is not None and device.index is not None:
        set_device(device.index)


def process_group_spec(pg_backend: str, device_type: str) -> tuple[str, str | None]:
    """(the backend string for init_process_group, the CPU backend added or None).

    A backend that cannot carry CPU tensors (nccl, xccl, xla) gets gloo beside it for them:
    "cuda:nccl,cpu:gloo". torch records which device types a backend serves
    (`Backend.backend_capability`), also for a third-party backend registered with
    `dist.Backend.register_backend(..., devices=[...])`."""
    import torch.distributed as dist

    capability = dist.Backend.backend_capability.get(pg_backend.lower())
    if capability is None:
        raise DistributedError(
            f"torch.distributed knows no process-group backend {pg_backend!r}; the plugin "
            "that names it must register it (dist.Backend.register_backend) before "
            f"answering (known: {', '.join(sorted(dist.Backend.backend_capability))})")
    if device_type not in capability:
        logger.warning("process-group backend %s lists devices %s, not %s", pg_backend,
                       capability, device_type)
    if "cpu" in capability:
        return pg_backend, None
    if not dist.is_gloo_available():
        raise DistributedError(f"{pg_backend} cannot carry CPU tensors and this torch is "
                               "built without gloo to carry them")
    return f"{device_type}:{pg_backend},cpu:gloo", "gloo"


def _start_group(spec: str, launch: LaunchEnvironment | None,
                 timeout: datetime.timedelta | None) -> None:
    import torch.distributed as dist

    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    try:
        if launch is None:  # one process: an in-memory store, no network, no port
            dist.init_process_group(spec, store=dist.HashStore(),  # type: ignore[attr-defined]
                                    rank=0, world_size=1,
                                    **kwargs)
        else:  # torchrun's rendezvous: MASTER_ADDR / MASTER_PORT (or its agent store)
            dist.init_process_group(spec, init_method="env://", rank=launch.rank,
                                    world_size=launch.world_size, **kwargs)
    except DistributedError:
        raise
    except Exception as exc:
        where = "as one process" if launch is None else \
            f"rank {launch.rank} of {launch.world_size} via {launch.master_addr}:" \
            f"{launch.master_port}"
        raise DistributedError(f"init_process_group({spec!r}) failed {where}: "
                               f"{type(exc).__name__}: {exc}") from exc


def _adopt_existing(backend: Backend | str | None, launch: LaunchEnvironment | None
                    ) -> DistributedContext:
    """The process group was started by someone else (the user, Lightning): describe it."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = launch.local_rank if launch is not None else 0
    rank_backend = _rank_backend(backend, local_rank)
    bind_device(rank_backend.device)
    pg = str(dist.get_backend())
    return DistributedContext(rank, local_rank, world_size,
                              launch.local_world_size or world_size if launch else 1,
                              rank_backend.device, rank_backend, pg, None,
                              launched=launch is not None, owns_group=False)


def initialize(backend: Backend | str | None = None, timeout: Any = None
               ) -> DistributedContext:
    """Join (or, without a launcher, create) the default process group on `backend` (a
    Backend or a name; None: the selected one) and return this rank's context.

    Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
    binds this rank's device (local rank modulo the backend's device count), and starts the
    group with the process-group backend the backend's plugin names, plus gloo for CPU
    tensors where that one cannot carry them. Without a launcher it is a one-process group,
    so the same script runs either way. Idempotent: a second call returns the same context
    (a different backend then is an error). `timeout`: seconds or a timedelta."""
    import torch.distributed as dist

    if not dist.is_available():
        raise DistributedError("this torch is built without torch.distributed")
    with LOCK:
        existing = current_context()
        if existing is not None:
            requested = backend.name if isinstance(backend, Backend) else backend
            if requested is not None and requested.split(":")[0] != existing.backend.name:
                raise DistributedError(
                    f"distributed is already initialized on backend {existing.backend.name!r};"
                    f" call torchbridge.distributed.destroy() before initializing on "
                    f"{requested!r}")
            return existing
        delta = _timeout(timeout)
        launch = read_launch_env(os.environ)
        if dist.is_initialized():
            context = _adopt_existing(backend, launch)
        else:
            rank_backend = _rank_backend(backend, launch.local_rank if launch else 0)
            if launch is not None and launch.local_world_size is not None \
                    and launch.local_world_size > rank_backend.device_count > 1:
                logger.warning("%d ranks on this node share %d %s devices", launch.
                               local_world_size, rank_backend.device_count, rank_backend.name)
            pg_backend = rank_backend.distributed_backend
            if not pg_backend:
                raise DistributedError(
                    f"no plugin names a process-group backend for {rank_backend.name!r} "
                    f"(plugin {rank_backend.plugin}: torchbridge_distributed_backend "
                    "answered None)")
            spec, cpu_backend = process_group_spec(pg_backend, rank_backend.device.type)
            bind_device(rank_backend.device)
            _start_group(spec, launch, delta)
            context = DistributedContext(
                rank=launch.rank if launch else 0,
                local_rank=launch.local_rank if launch else 0,
                world_size=launch.world_size if launch else 1,
                local_world_size=(launch.local_world_size or launch.world_size) if launch
                else 1,
                device=rank_backend.device, backend=rank_backend,
                process_group_backend=pg_backend, cpu_process_group_backend=cpu_backend,
                launched=launch is not None, owns_group=True)
        set_context(context)
        logger.info("distributed initialized: %s", context.describe())
        return context


def destroy() -> None:
    """Leave and destroy the process group `initialize()` created, and forget the context.
    Safe to call twice, or without initialize()."""
    import torch.distributed as dist

    with LOCK:
        context = current_context()
        set_context(None)
        if context is not None and context.owns_group and dist.is_available() \
                and dist.is_initialized():
            dist.destroy_process_group()
