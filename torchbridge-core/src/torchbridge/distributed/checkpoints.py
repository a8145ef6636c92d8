"""Distributed checkpoints through `torch.distributed.checkpoint` (DCP).

Every rank writes its own part (FSDP2: its shards; a tensor every rank holds, DDP's and
the buffers: once, by one of the ranks), and the checkpoint loads on any world size, one
process without a process group included: DCP reshards on load. Buffers are the one state
the ranks hold apart (BatchNorm's running statistics follow each rank's own batches until
DDP's next forward sends rank 0's; FSDP2 never does), so rank 0's are broadcast first: the
checkpoint is rank 0's model, not a mix of the ranks'. `distributed_to_single_file` turns
one into the single-file state dict `torchbridge.load_checkpoint` reads,
`single_file_to_distributed` the other way.

Layout: {"model": the user's module's state dict, under its own keys (DDP, compile and
autocast wrappers removed), "optimizer": keyed by parameter name (DCP's portable form)}.

Trust: a save writes a fresh version folder and publishes it (manifest of SHA-256s, then
the CURRENT pointer) only when every rank has finished, so a killed or failed save leaves
the previous checkpoint as it was; a load verifies every file against the manifest and reads
DCP's metadata without running code from it (distributed/manifest.py, dcp_safe.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from torchbridge.checkpoint import load_checkpoint, save_checkpoint, shard_type
from torchbridge.distributed import manifest
from torchbridge.distributed.context import current_context
from torchbridge.distributed.dcp_safe import (
    NoFollowWriter,
    SafeEmptyPlanner,
    SafeLoadPlanner,
    SafeReader,
)
from torchbridge.distributed.strategies import broadcast_from_rank0, user_module
from torchbridge.errors import CheckpointError
from torchbridge.suggestions import shortened

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


def _check_optimizer(inner: nn.Module, optimizer: Any) -> None:
    """Refuse an optimizer holding parameters `inner` does not have (built over another
    instance of the model, say): torch's state-dict helpers fail on it with a bare
    KeyError."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        raise CheckpointError(f"optimizer must be a torch.optim.Optimizer, got "
                              f"{type(optimizer).__name__}")
    own = {id(p) for p in inner.parameters()}
    params = [p for group in groups for p in group["params"]]
    foreign = sum(id(p) not in own for p in params)
    if foreign:
        raise CheckpointError(
            f"{foreign} of the optimizer's {len(params)} parameters are not parameters of "
            f"the model ({type(inner).__name__}): the optimizer was built over another "
            "model's parameters. Build it over this model's (optimizer_class("
            "model.parameters()))")


def _state(inner: nn.Module, optimizer: Any) -> dict[str, Any]:
    """What a distributed checkpoint holds: {"model": ...} and, with an optimizer,
    "optimizer": ..., as torch.distributed.checkpoint's state-dict API gives them (saving
    reads them; loading fills them in place)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(inner)}
    _check_optimizer(inner, optimizer)
    model_state, optimizer_state = get_state_dict(inner, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


_PASS_THROUGH = (KeyboardInterrupt, SystemExit, GeneratorExit)


def _translated(exc: BaseException, what: str, reader: SafeReader | None = None
                ) -> CheckpointError:
    """CheckpointError for anything DCP raised (its CheckpointException is a BaseException
    that `except Exception` misses); a CheckpointError of ours inside it keeps its words."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointError):
        return exc
    if reader is not None and reader.refusal is not None:
        return CheckpointError(str(reader.refusal))
    cause: BaseException = exc
    if isinstance(exc, CheckpointException) and exc.failures:
        causes = [failure[0] for _, failure in sorted(exc.failures.items())]
        ours = [c for c in causes if isinstance(c, CheckpointError)]
        if ours:
            return CheckpointError(str(ours[0]))
        cause = causes[0]
    return CheckpointError(f"{what}: {type(cause).__name__}: {cause}")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if _group_active() else 0


def _from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (itself without a process group)."""
    import torch.distributed as dist

    if not _group_active():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _buffers_from_rank0(inner: nn.Module) -> None:
    """Rank 0's buffers on every rank (FSDP2 leaves buffers whole; one sharded all the
    same is a part of every rank's, left as it is)."""
    buffers = [b for b in inner.buffers() if shard_type(b) is None]
    context = current_context()
    device = context.device if context is not None else None
    broadcast_from_rank0(buffers, device)


def _check_keep_last(keep_last: int | None) -> None:
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                  or keep_last < 1):
        raise CheckpointError(f"keep_last={keep_last!r} must be a positive integer or None "
                              "(keep every version)")


def _save_version(state: dict[str, Any], root: Path, keep_last: int | None,
                  collective: bool) -> Path:
    """Write `state` into a fresh version folder of `root` and publish it once every rank
    has written its part. Returns the version folder."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import save

    first = not collective or _rank() == 0
    made: Path | str = ""
    if first:
        try:
            made = manifest.begin(root)
        except CheckpointError as exc:
            made = str(exc)
    made = _from_rank0(made) if collective else made
    if isinstance(made, str):
        raise CheckpointError(made)
    folder = made
    try:
        with _one_process_quietly():
            save(state, storage_writer=NoFollowWriter(folder), no_dist=not collective)
    except _PASS_THROUGH:
        raise
    except BaseException as exc:
        if first:
            manifest.discard(folder)
        raise _translated(exc, f"cannot save distributed checkpoint {root}; the previous "
                               "version is untouched") from exc
    if collective:
        dist.barrier()  # every rank has written and synced its files
    error: str | None = None
    if first:
        try:
            manifest.publish(folder, keep_last)
        except CheckpointError as exc:
            error = str(exc)
            manifest.discard(folder)
    error = _from_rank0(error) if collective else error
    if error:
        raise CheckpointError(error)
    return folder


def save_distributed_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike[str],
                                optimizer: Any = None, *, keep_last: int | None = 1
                                ) -> Path:
    """Save `model` (prepared with distributed="ddp" or "fsdp", or a plain module) and
    optionally its optimizer into the folder `checkpoint_dir`. Call it on every rank: it is
    a collective. The new version becomes current only when every rank has finished; a
    killed or failed save leaves the previous one as it was. `keep_last`: how many versions
    to keep (older ones are removed after the new one is current; None keeps all). Returns
    the folder."""
    _check_keep_last(keep_last)
    inner = user_module(model)
    if _group_active():
        # DCP saves each replicated tensor from one rank, which one it chooses per tensor:
        # the ranks' differing buffers were saved half from one, half from the other.
        _buffers_from_rank0(inner)
    state = _state(inner, optimizer)
    path = Path(checkpoint_dir)
    folder = _save_version(state, path, keep_last, collective=_group_active())
    logger.info("distributed checkpoint saved to %s (version %s)", path, folder.name)
    return path


def _locate_everywhere(root: Path) -> manifest.Located:
    """Verify `root` on every rank; if any rank refuses it, every rank raises."""
    import torch.distributed as dist

    located: manifest.Located | None = None
    error: str | None = None
    try:
        located = manifest.locate(root)
    except CheckpointError as exc:
        error = str(exc)
    if _group_active():
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error or located is None:
        raise CheckpointError(error or f"cannot load distributed checkpoint {root}")
    return located


def _reader(located: manifest.Located) -> SafeReader:
    return SafeReader(located.folder, located.metadata_sha256, located.files)


def _refuse_unexpected(model_state: dict[str, Any], reader: SafeReader, path: Path,
                       inner: nn.Module) -> None:
    """Refuse a checkpoint holding model entries `inner` lacks, as torch's load_state_dict
    does: DCP loads only the keys asked for, so the rest would be dropped without a word."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    wanted, _ = flatten_state_dict({"model": model_state})  # DCP's own key names
    held = reader.read_metadata().state_dict_metadata
    unexpected = sorted(key.removeprefix("model.") for key in held
                        if key.startswith("model.") and key not in wanted)
    if unexpected:
        shown = shortened(unexpected, 10)
        raise CheckpointError(
            f"cannot load distributed checkpoint {path} into {type(inner).__name__}: the "
            f"checkpoint holds {len(unexpected)} model entries the model lacks ({shown}); "
            "nothing was loaded. Load it into the model it was saved from")


def load_distributed_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike[str],
                                optimizer: Any = None) -> None:
    """Load a checkpoint saved by `save_distributed_checkpoint` (on any number of ranks)
    into `model` and optionally `optimizer`, in place, resharding to this run's layout.
    Every file is checked against the manifest first. Collective when a process group is
    active; works in one process without one.

    Strict, as torch's load_state_dict: an entry of the model missing from the checkpoint,
    or one in the checkpoint that the model lacks, is a CheckpointError naming them, as is
    an optimizer over parameters other than the model's; the model is then left as it was.
    The checkpoint's optimizer state is read only when `optimizer` is given."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    path = Path(checkpoint_dir)
    located = _locate_everywhere(path)
    inner = user_module(model)
    reader = _reader(located)
    try:
        state = _state(inner, optimizer)
        _refuse_unexpected(state["model"], _reader(located), path, inner)
        with _one_process_quietly():
            load(state, storage_reader=reader, planner=SafeLoadPlanner(),
                 no_dist=not _group_active())
    except (*_PASS_THROUGH, CheckpointError):
        raise
    except BaseException as exc:
        raise _translated(exc, f"cannot load distributed checkpoint {path} into "
                               f"{type(inner).__name__}", reader) from exc
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
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    source = Path(checkpoint_dir)
    located = manifest.locate(source)
    state: dict[str, Any] = {}
    reader = _reader(located)
    try:
        with _one_process_quietly():
            _load_state_dict(state, storage_reader=reader, planner=SafeEmptyPlanner(),
                             no_dist=True)
    except _PASS_THROUGH:
        raise
    except BaseException as exc:
        raise _translated(exc, f"cannot read distributed checkpoint {source}", reader) from exc
    if not isinstance(state.get("model"), dict):
        raise CheckpointError(f"{source} holds no 'model' entry; it was not written by "
                              "save_distributed_checkpoint")
    return save_checkpoint(state["model"], Path(path))


def single_file_to_distributed(path: str | os.PathLike[str],
                               checkpoint_dir: str | os.PathLike[str]) -> Path:
    """Write a single-file checkpoint (`save_checkpoint`'s) as a distributed checkpoint that
    `load_distributed_checkpoint` loads on any world size (a new version of
    `checkpoint_dir`, older ones removed). Run it in one process."""
    state = load_checkpoint(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds {type(state).__name__}, not a state dict")
    target = Path(checkpoint_dir)
    _save_version({"model": state}, target, keep_last=1, collective=False)
    return target
