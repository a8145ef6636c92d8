"""Distributed checkpoints through `torch.distributed.checkpoint` (DCP).

Every rank writes its own part (FSDP2: its shards; DDP: the replicated tensors once), and
the checkpoint loads on any world size, one process without a process group included: DCP
reshards on load. `distributed_to_single_file` turns one into the single-file state dict
`torchbridge.load_checkpoint` reads, `single_file_to_distributed` the other way.

Layout: {"model": the user's module's state dict, under its own keys (DDP, compile and
autocast wrappers removed), "optimizer": keyed by parameter name (DCP's portable form)}.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from torchbridge.checkpoint import load_checkpoint, save_checkpoint
from torchbridge.distributed.strategies import user_module
from torchbridge.errors import CheckpointError

logger = logging.getLogger(__name__)


def _group_active() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    # Without a process group DCP warns that it "assumes the intent" is one process; here
    # that is the documented behaviour, not a guess.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _state(inner: nn.Module, optimizer: Any) -> dict[str, Any]:
    """What a distributed checkpoint holds: {"model": ...} and, with an optimizer,
    "optimizer": ..., as torch.distributed.checkpoint's state-dict API gives them (saving
    reads them; loading fills them in place)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(inner)}
    model_state, optimizer_state = get_state_dict(inner, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def save_distributed_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike[str],
                                optimizer: Any = None) -> Path:
    """Save `model` (prepared with distributed="ddp" or "fsdp", or a plain module) and
    optionally its optimizer into the folder `checkpoint_dir`. Call it on every rank: it is
    a collective. Returns the folder."""
    from torch.distributed.checkpoint.state_dict_saver import save

    inner = user_module(model)
    state = _state(inner, optimizer)
    path = Path(checkpoint_dir)
    try:
        with _one_process_quietly():
            save(state, checkpoint_id=path, no_dist=not _group_active())
    except Exception as exc:
        raise CheckpointError(f"cannot save distributed checkpoint {path}: "
                              f"{type(exc).__name__}: {exc}") from exc
    logger.info("distributed checkpoint saved to %s", path)
    return path


def load_distributed_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike[str],
                                optimizer: Any = None) -> None:
    """Load a checkpoint saved by `save_distributed_checkpoint` (on any number of ranks)
    into `model` and optionally `optimizer`, in place, resharding to this run's layout.
    Collective when a process group is active; works in one process without one."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    path = Path(checkpoint_dir)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a distributed checkpoint (no .metadata file "
                              "written by torch.distributed.checkpoint)")
    inner = user_module(model)
    state = _state(inner, optimizer)
    try:
        with _one_process_quietly():
            load(state, checkpoint_id=path, no_dist=not _group_active())
    except Exception as exc:
        raise CheckpointError(f"cannot load distributed checkpoint {path} into "
                              f"{type(inner).__name__}: {type(exc).__name__}: {exc}") from exc
    if optimizer is None:
        set_model_state_dict(inner, state["model"])
    else:
        set_state_dict(inner, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])


def distributed_to_single_file(checkpoint_dir: str | os.PathLike[str],
                               path: str | os.PathLike[str]) -> Path:
    """Write the model state of a distributed checkpoint as one file that
    `torchbridge.load_checkpoint` (and `torch.load`) reads: full tensors, on the CPU, under
    the model's own keys. Run it in one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    source = Path(checkpoint_dir)
    if not (source / ".metadata").is_file():
        raise CheckpointError(f"{source} is not a distributed checkpoint (no .metadata file)")
    target = Path(path)
    with tempfile.TemporaryDirectory(dir=target.parent if target.parent.is_dir() else None
                                     ) as tmp:
        full = Path(tmp) / "full.pt"
        with _one_process_quietly():
            dcp_to_torch_save(source, full)
        state = load_checkpoint(full)
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{source} holds no 'model' entry; it was not written by "
                              "save_distributed_checkpoint")
    return save_checkpoint(state["model"], target)


def single_file_to_distributed(path: str | os.PathLike[str],
                               checkpoint_dir: str | os.PathLike[str]) -> Path:
    """Write a single-file checkpoint (`save_checkpoint`'s) as a distributed checkpoint that
    `load_distributed_checkpoint` loads on any world size. Run it in one process."""
    from torch.distributed.checkpoint.state_dict_saver import save

    state = load_checkpoint(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds {type(state).__name__}, not a state dict")
    target = Path(checkpoint_dir)
    try:
        with _one_process_quietly():
            save({"model": state}, checkpoint_id=target, no_dist=True)
    except Exception as exc:
        raise CheckpointError(f"cannot write distributed checkpoint {target}: "
                              f"{type(exc).__name__}: {exc}") from exc
    return target
