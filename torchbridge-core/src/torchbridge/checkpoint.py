"""Checkpoints that move between backends.

A checkpoint is a plain `torch.save`d state dict with every tensor on the CPU, so torch.load
reads it anywhere, with or without TorchBridge. Saving is atomic: the file is written to a
temporary next to its destination, flushed to disk and renamed over it, so a crash at any
point leaves the old checkpoint (or none), never a truncated one. Temporaries are named
`.<name>.tbtmp-<host>-<pid>-<random>`; the next save or load in the folder removes those
whose process is dead, and never one of a live process (see `torchbridge.atomic_file`).

Loading checks the file before trusting it: torch's zip format stores a CRC-32 of every
record, which torch.load itself never checks (a flipped byte in a tensor loads silently as
a different number), so the CRCs are verified first. Only a file that is intact is ever
said to hold objects other than tensors, so the advice to load with weights_only=False
(which runs code stored in the file) never reaches the owner of a damaged or foreign file.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import pickletools
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from torchbridge.atomic_file import describe_os_error, remove_dead_temporaries, write_atomically
from torchbridge.backend import get_backend
from torchbridge.errors import CheckpointError

logger = logging.getLogger(__name__)

# The first pickle of torch's legacy (pre-1.6, non-zip) format.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside prepare_model's wrappers (torch.compile, autocast), so a
    prepared model saves under the same keys as the original."""
    while True:  # the core's passes change forward in place; plugins may wrap
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _host_copy(state: Any) -> Any:
    """`state` with every tensor detached and on the CPU. A defaultdict becomes a dict: its
    default factory is code, which torch.load(weights_only=True) would refuse to rebuild.
    The state dict's `_metadata` (module versions) is kept."""
    def leaf(obj: Any) -> Any:
        if isinstance(obj, collections.defaultdict):
            return {key: _host_copy(value) for key, value in obj.items()}
        if isinstance(obj, torch.Tensor):
            return obj.detach().cpu()
        return obj

    copied = pytree.tree_map(leaf, state,
                             is_leaf=lambda obj: isinstance(obj, collections.defaultdict))
    metadata = getattr(state, "_metadata", None)
    if metadata is not None and isinstance(copied, dict):
        copied._metadata = metadata  # type: ignore[attr-defined]
    return copied


def save_checkpoint(model_or_state: nn.Module | dict[str, Any], path: str | os.PathLike[str]
                    ) -> Path:
    """Save a model's state dict (or any dict of tensors) with every tensor on the CPU.
    Device tensors (XLA, CUDA, ...) are copied to the host first. Returns the path.

    A symlink is written through to its target; an existing file keeps its permissions, a
    new one gets the umask's. Any failure is a CheckpointError naming the file and the
    cause, and leaves the previous file as it was."""
    if isinstance(model_or_state, nn.Module):
        state: Any = unwrap(model_or_state).state_dict()
    elif isinstance(model_or_state, dict):
        state = model_or_state
    else:
        raise CheckpointError(f"save_checkpoint takes an nn.Module or a dict, got "
                              f"{type(model_or_state).__name__}")
    try:
        path = Path(path)
    except TypeError:
        raise CheckpointError(f"checkpoint path must be a str or os.PathLike, got "
                              f"{type(path).__name__}") from None
    try:
        cpu_state = _host_copy(state)
    except Exception as exc:
        raise CheckpointError(f"cannot save checkpoint {path}: copying its tensors to the "
                              f"CPU failed: {type(exc).__name__}: {exc}") from exc

    def write(file: Any) -> None:
        torch.save(cpu_state, file)

    target = write_atomically(path, write, error=CheckpointError, what="checkpoint")
    logger.info("checkpoint saved to %s", target)
    return path


def _intact_zip(path: Path) -> str | None:
    """None when `path` is a zip archive whose records all match their CRC-32 and whose
    data.pkl is a complete pickle; else what is wrong with it."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
            if bad is not None:
                return f"record {bad} fails its CRC-32 check"
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")
                       or n == "data.pkl"]
            if len(pickles) != 1:
                return "a zip archive without torch's data.pkl record"
            with archive.open(pickles[0]) as data:
                for _ in pickletools.genops(data):  # parses only; runs nothing
                    pass
    except Exception as exc:  # zipfile and pickletools raise many types on bad input
        return f"{type(exc).__name__}: {exc}"
    return None


def _legacy_torch_file(path: Path) -> bool:
    """Whether `path` starts like torch's legacy (non-zip) format: a pickled magic number.
    Parsed without unpickling anything."""
    try:
        with open(path, "rb") as f:
            for opcode, arg, _ in pickletools.genops(f):
                if opcode.name in ("LONG1", "LONG4", "LONG", "INT") and arg == _LEGACY_MAGIC:
                    return True
                if opcode.name == "STOP":
                    return False
    except Exception:
        return False
    return False


def _refused_object(exc: BaseException) -> str:
    """What torch's safe loader refused, from its long message."""
    text = str(exc)
    match = re.search(r"Unsupported global: GLOBAL (\S+)", text) or \
        re.search(r"WeightsUnpickler error: ([^\n]+)", text)
    return match.group(1).rstrip(".") if match else text.strip().splitlines()[0]


def _check_file(path: Path) -> None:
    try:
        info = path.stat()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {describe_os_error(exc)}"
                              ) from None
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a directory, not a file")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} is not a regular file")
    if info.st_size == 0:
        raise CheckpointError(f"checkpoint {path} is damaged or not a checkpoint: the file "
                              "is empty")


def load_checkpoint(path: str | os.PathLike[str], backend: Any = None,
                    dtype: torch.dtype | None = None, *, weights_only: bool = True) -> Any:
    """Load a checkpoint onto `backend` (a Backend or a name such as "tpu"; None: the CPU),
    casting floating-point tensors to `dtype` if given (integer, bool and complex tensors
    keep their dtype).

    weights_only=True (the default) reads tensors and plain containers only and refuses
    anything else; a file that needs more says so, and weights_only=False loads it by
    running the code pickled in it: do that only for files you trust. An empty, truncated,
    damaged (a record failing its CRC) or foreign file is a CheckpointError saying so."""
    try:
        path = Path(path)
    except TypeError:
        raise CheckpointError(f"checkpoint path must be a str or os.PathLike, got "
                              f"{type(path).__name__}") from None
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise CheckpointError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    device = None
    if isinstance(backend, str):  # before reading: a wrong backend fails fast
        device = get_backend(backend).device
    elif backend is not None:
        device = getattr(backend, "device", None)
        if not isinstance(device, torch.device):
            raise CheckpointError(f"backend must be a Backend or a backend name such as "
                                  f"'tpu', got {type(backend).__name__}")
    _check_file(path)
    remove_dead_temporaries(path.resolve().parent)
    damage = None
    if zipfile.is_zipfile(path):
        damage = _intact_zip(path)
        if damage is not None:
            raise CheckpointError(f"checkpoint {path} is damaged or not a checkpoint: {damage}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as exc:
        # A verified zip is as torch.save wrote it; a legacy file has no checksums, so it
        # counts as intact only when it starts like one and the refusal names a global.
        intact = zipfile.is_zipfile(path) or (
            _legacy_torch_file(path) and "Unsupported global" in str(exc))
        if weights_only and isinstance(exc, pickle.UnpicklingError) and intact:
            raise CheckpointError(
                f"checkpoint {path} is intact but holds objects other than tensors and plain "
                f"containers ({_refused_object(exc)}), so the safe loader refused it. If you "
                "trust this file, load it with load_checkpoint(path, weights_only=False), "
                "which runs code stored in it") from exc
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise CheckpointError(f"checkpoint {path} is damaged or not a checkpoint (truncated, "
                              f"altered, or not written by torch.save): "
                              f"{type(exc).__name__}: {first}") from exc

    def place(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        return t.to(device) if device is not None else t

    placed = pytree.tree_map_only(torch.Tensor, place, state)
    metadata = getattr(state, "_metadata", None)
    if metadata is not None and isinstance(placed, dict):
        placed._metadata = metadata  # type: ignore[attr-defined]
    return placed
