"""Checkpoints that move between backends.

A checkpoint is a plain `torch.save`d state dict with every tensor on the CPU, so torch.load
reads it anywhere, with or without TorchBridge. Saving is atomic: the file is written next
to its destination, flushed to disk and renamed over it, so a crash mid-save leaves the old
checkpoint (or none), never a truncated one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchbridge import trees
from torchbridge.backend import get_backend
from torchbridge.errors import CheckpointError

logger = logging.getLogger(__name__)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside prepare_model's wrappers (torch.compile, autocast), so a
    prepared model saves under the same keys as the original."""
    while True:  # the core's passes change forward in place; plugins may wrap
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def save_checkpoint(model_or_state: nn.Module | dict[str, Any], path: str | os.PathLike[str]
                    ) -> Path:
    """Save a model's state dict (or any dict of tensors) with every tensor on the CPU.
    Device tensors (XLA, CUDA, ...) are copied to the host first. Returns the path."""
    if isinstance(model_or_state, nn.Module):
        state: Any = unwrap(model_or_state).state_dict()
    elif isinstance(model_or_state, dict):
        state = model_or_state
    else:
        raise CheckpointError(f"save_checkpoint takes an nn.Module or a dict, got "
                              f"{type(model_or_state).__name__}")
    cpu_state = trees.map_tensors(lambda t: t.detach().cpu(), state)
    path = Path(path)
    if not path.parent.is_dir():
        raise CheckpointError(f"cannot save {path}: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(cpu_state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    logger.info("checkpoint saved to %s", path)
    return path


def load_checkpoint(path: str | os.PathLike[str], backend: Any = None,
                    dtype: torch.dtype | None = None, *, weights_only: bool = True) -> Any:
    """Load a checkpoint onto `backend` (a Backend or a name such as "tpu"; None: the CPU),
    casting floating-point tensors to `dtype` if given.

    weights_only=True (the default) reads tensors and plain containers only and refuses
    anything else; a file that needs more says so, and weights_only=False loads it by
    running the code pickled in it: do that only for files you trust."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise CheckpointError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        if weights_only:
            first = str(exc).strip().splitlines()[0]
            raise CheckpointError(
                f"{path} holds objects other than tensors and plain containers, so the safe "
                f"loader refused it ({first}). If you trust this file, load it with "
                "load_checkpoint(path, weights_only=False), which runs code stored in it"
            ) from exc
        raise CheckpointError(f"{path} is not a readable checkpoint: {exc}") from exc
    except (RuntimeError, EOFError) as exc:
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or not "
                              f"written by torch.save): {exc}") from exc
    device = None
    if backend is not None:
        if isinstance(backend, str):
            backend = get_backend(backend)
        device = backend.device

    def place(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        return t.to(device) if device is not None else t

    return trees.map_tensors(place, state)
