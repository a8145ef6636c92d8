"""Checkpoints that move between backends.

A checkpoint is a plain `torch.save`d state dict with every tensor on the CPU, so torch.load
reads it anywhere, with or without TorchBridge. Saving is atomic: the file is written to a
temporary next to its destination, flushed to disk and renamed over it, so a crash at any
point leaves the old checkpoint (or none), never a truncated one. Temporaries are named
`.<name>.tbtmp-<tag>-<pid>-<stamp>-<random>`; a later save or load in the folder removes
those that are old and whose writer provably died (same host, boot and PID namespace),
never one of a live process (see `torchbridge.atomic_file`).

A save never writes through a symlink at the destination: it is refused.

Integrity: a file written here ends with a SHA-256 of all its other bytes, kept in the zip
archive's comment, which torch.load ignores; loading verifies it, so any changed byte is an
error, never different numbers. A plain torch.save file (no footer) is checked
structurally (central directory against local headers, flags, no directory entries, the
CRC-32 of every record). Before torch.load runs, the pickle is replayed without running
anything to check every declared storage size against the file and to bound the object
count and nesting depth; a dtype conversion or device move converts each storage once
(views keep sharing it) after its memory is estimated. See `torchbridge.checkpoint_checks`.
Only a file that is intact is ever said to hold objects other than tensors, so the advice
to load with weights_only=False (which runs code stored in the file) never reaches the
owner of a damaged or foreign file.

`.safetensors` files (and sharded `*.safetensors.index.json` checkpoints) are read and
written too, chosen by the extension or `format=`: see `torchbridge.safetensors_io`.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import pickle
import pickletools
import re
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from torchbridge import checkpoint_checks as checks
from torchbridge import safetensors_io
from torchbridge.atomic_file import describe_os_error, remove_dead_temporaries, write_atomically
from torchbridge.backend import get_backend
from torchbridge.errors import CheckpointError
from torchbridge.wrapped import unwrap

logger = logging.getLogger(__name__)

# The first pickle of torch's legacy (pre-1.6, non-zip) format.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_FORMATS = ("torch", "safetensors")
# A dtype conversion or device move may need at most this many bytes per byte of the file
# (float8 -> float64 is 8x), plus a fixed allowance for tensors not backed by file bytes.
_EXPANSION = 8
_ALLOWANCE = 64 * 1024 * 1024


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


def _format_of(path: Path, format: str | None, loading: bool) -> str:
    if format is not None:
        if format not in _FORMATS:
            raise CheckpointError(f"format must be 'torch' or 'safetensors', got {format!r}")
        return format
    name = path.name.lower()
    if name.endswith(".safetensors") or name.endswith(safetensors_io.INDEX_SUFFIX):
        return "safetensors"
    if loading and path.is_dir():
        try:
            if safetensors_io.find_in_folder(path) is not None:
                return "safetensors"
        except CheckpointError:
            return "safetensors"  # several candidates: let the safetensors loader say so
    return "torch"


def shard_type(obj: Any) -> str | None:
    """"DTensor" or "ShardedTensor" when `obj` holds one rank's part of a sharded tensor
    (FSDP2's, the older FSDP's), else None. By the class's name, so that nothing of
    torch.distributed is imported for a state that has none."""
    for cls in type(obj).__mro__:
        if cls.__name__ in ("DTensor", "ShardedTensor") \
                and cls.__module__.startswith("torch.distributed"):
            return cls.__name__
    return None


def _sharded(state: Any) -> tuple[str, str] | None:
    """(what, type) of the first tensor in `state` that holds one rank's shard, or None;
    `what` is its key in a state dict. Each object looked at once."""
    for tensor in _tensors(state):
        kind = shard_type(tensor)
        if kind is not None:
            key = next((k for k, v in state.items() if v is tensor), None) \
                if isinstance(state, dict) else None
            return ("a tensor in it" if key is None else str(key)), kind
    return None


def _ddp_rank(model: Any) -> int | None:
    """This process's rank when `model` is a DistributedDataParallel model in a group of
    several ranks, else None."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return None
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.get_rank()


# Passes of prepare_model that store the model's parameters in another dtype or form.
_DTYPE_PASSES = ("low_precision_weights", "quantize")


def _warn_if_precision_lowered(model: nn.Module, state: dict[str, Any], path: Any) -> None:
    """Log a warning when prepare_model changed the dtype of `model`'s parameters: the file
    then holds them in that dtype, which is the prepared model's state but not the
    precision of the model it was prepared from."""
    from torchbridge.optimize.report import optimization_result

    report = optimization_result(model) or optimization_result(unwrap(model))
    if report is None:
        return
    # .applied: what still holds (a pass undone after prepare_model returned, the weights
    # back in float32 after training, is not).
    passes = [r.name for r in report.applied if r.name in _DTYPE_PASSES]
    if not passes:
        return
    tensors = [t for t in state.values() if isinstance(t, torch.Tensor)]
    # A quantized weight (torchao's Int8Tensor, ...) is a tensor subclass whose dtype
    # reads as the float dtype it computes in: named by its class, not that dtype.
    quantized = collections.Counter(type(t).__name__ for t in tensors
                                    if type(t) not in (torch.Tensor, nn.Parameter))
    counts = collections.Counter(str(t.dtype).removeprefix("torch.") for t in tensors
                                 if type(t) in (torch.Tensor, nn.Parameter)
                                 and t.is_floating_point() and t.element_size() < 4)
    held = [f"{n} quantized tensors ({kind})" for kind, n in sorted(quantized.items())]
    held += [f"{n} tensors in {dtype}" for dtype, n in sorted(counts.items())]
    logger.warning(
        "save_checkpoint %s: prepare_model applied %s to this model, so its weights and "
        "biases are saved as it stores them (%s), not in the precision of the model it was "
        "prepared from%s; save the model you prepared from to keep that precision",
        path, " and ".join(passes), ", ".join(held) or "another dtype",
        ": the model as built cannot load the quantized ones" if quantized else "")


def save_checkpoint(model_or_state: nn.Module | dict[str, Any], path: str | os.PathLike[str],
                    *, format: str | None = None) -> Path:
    """Save a model's state dict (or any dict of tensors) with every tensor on the CPU.
    Device tensors (XLA, CUDA, ...) are copied to the host first. Returns the path.

    `format` is "torch" (torch.save's zip, with a SHA-256 footer) or "safetensors" (tensors
    only, no code; other entries are refused naming the key); None picks safetensors for a
    path ending in `.safetensors`, else torch. A path that is a symlink is refused (a save
    never follows a link it did not create); an existing file keeps its permissions, a new
    one gets the umask's. Any failure is a CheckpointError naming the file and the cause,
    and leaves the previous file as it was.

    A model whose parameters prepare_model stored in another dtype (O3's
    low_precision_weights: bf16) or quantized is saved as it is, with a warning logged that
    names them: save the model you prepared from to keep its precision.

    A DDP model (prepare_model(distributed="ddp")) on several ranks is written by rank 0
    alone: the other ranks return at once, writing nothing. A state holding one rank's
    shards (FSDP) is refused: save_distributed_checkpoint saves it."""
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
    fmt = _format_of(path, format, loading=False)
    ddp_rank = _ddp_rank(model_or_state)
    if ddp_rank is not None and ddp_rank != 0:
        # Every rank holds the model; rank 0 writes it (with its buffers, which DDP sends
        # to the others at each forward), not whichever rank renamed its file last.
        logger.info("rank %d: save_checkpoint of a DDP model: rank 0 writes %s", ddp_rank,
                    path)
        return path
    sharded = _sharded(state)
    if sharded is not None:
        key, kind = sharded
        raise CheckpointError(
            f"cannot save checkpoint {path}: {key} is a {kind}, this rank's shard of a "
            "sharded model (FSDP), so the file would hold one rank's part of the model. Save "
            "it with torchbridge.distributed.save_distributed_checkpoint(model, folder) on "
            "every rank; torchbridge.distributed.distributed_to_single_file(folder, path) "
            "then writes the single file, in one process")
    if isinstance(model_or_state, nn.Module):
        _warn_if_precision_lowered(model_or_state, state, path)
    try:
        cpu_state = _host_copy(state)
    except Exception as exc:
        raise CheckpointError(f"cannot save checkpoint {path}: copying its tensors to the "
                              f"CPU failed: {type(exc).__name__}: {exc}") from exc
    if fmt == "safetensors":
        target = safetensors_io.save(cpu_state, path)
        logger.info("checkpoint saved to %s", target)
        return path

    def write(file: Any) -> None:
        hashing = checks.HashingWriter(file)
        torch.save(cpu_state, hashing)  # type: ignore[arg-type]
        hashing.finish()

    target = write_atomically(path, write, error=CheckpointError, what="checkpoint")
    logger.info("checkpoint saved to %s", target)
    return path


def _legacy_torch_file(f: IO[bytes]) -> bool:
    """Whether `f` starts like torch's legacy (non-zip) format: a pickled magic number.
    Parsed without unpickling anything."""
    try:
        f.seek(0)
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


def _verify(f: IO[bytes], size: int) -> bool:
    """Run every check before torch.load; raises checks.Damaged. Returns whether the file
    is a zip archive (else torch's legacy format)."""
    f.seek(0)
    if f.read(4) == b"PK\x03\x04":
        footer = checks.has_footer(f, size)
        if footer:
            checks.verify_footer(f, size)
        layout = checks.check_zip(f, size, crc=not footer)
        checks.check_zip_pickle(f, layout)
        return True
    if not _legacy_torch_file(f):
        raise checks.Damaged("not written by torch.save (neither a zip archive nor torch's "
                             "legacy format)")
    checks.check_legacy(f, size)
    return False


def _load_torch(path: Path, weights_only: bool) -> tuple[Any, int]:
    """torch.load of `path` after every check, reading one open file throughout."""
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {describe_os_error(exc)}"
                              ) from None
    with f:
        try:
            size = checks.file_size(f)
            is_zip = _verify(f, size)
        except checks.Damaged as exc:
            raise CheckpointError(f"checkpoint {path} is damaged or not a checkpoint: {exc}"
                                  ) from None
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint {path}: {describe_os_error(exc)}"
                                  ) from None
        except Exception as exc:  # a check tripping over a file nobody foresaw
            raise CheckpointError(f"checkpoint {path} is damaged or not a checkpoint: "
                                  f"{type(exc).__name__}: {exc}") from None
        try:
            f.seek(0)
            state = torch.load(f, map_location="cpu", weights_only=weights_only)
        except Exception as exc:
            # A verified zip is as torch.save wrote it; a legacy file has no checksums, so
            # it counts as intact only when the refusal names a global.
            intact = is_zip or "Unsupported global" in str(exc)
            if weights_only and isinstance(exc, pickle.UnpicklingError) and intact \
                    and "DTensor" in str(exc):
                raise CheckpointError(_shards_in_file(path, "DTensors")) from exc
            if weights_only and isinstance(exc, pickle.UnpicklingError) and intact:
                raise CheckpointError(
                    f"checkpoint {path} is intact but holds objects other than tensors and "
                    f"plain containers ({_refused_object(exc)}), so the safe loader refused "
                    "it. If you trust this file, load it with load_checkpoint(path, "
                    "weights_only=False), which runs code stored in it") from exc
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise CheckpointError(f"checkpoint {path} is damaged or not a checkpoint "
                                  f"(truncated, altered, or not written by torch.save): "
                                  f"{type(exc).__name__}: {first}") from exc
    return state, size


def _shards_in_file(path: Path, what: str) -> str:
    return (f"checkpoint {path} holds {what}: one rank's shards of a sharded model (FSDP), "
            "which save_checkpoint wrote before it refused them; the other ranks' parts are "
            "not in the file. Save the model with "
            "torchbridge.distributed.save_distributed_checkpoint on every rank")


def _containers(obj: Any) -> list[Any] | None:
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple)):
        return list(obj)
    return None


def _rebuild(obj: Any, items: list[Any]) -> Any:
    if isinstance(obj, dict):
        try:
            new: Any = type(obj)(zip(obj.keys(), items, strict=True))
        except Exception:
            new = dict(zip(obj.keys(), items, strict=True))
        metadata = getattr(obj, "_metadata", None)
        if metadata is not None:
            new._metadata = metadata
        return new
    if isinstance(obj, list):
        return items if type(obj) is list else type(obj)(items)
    if hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*items)
    try:
        return type(obj)(items)
    except Exception:
        return tuple(items)


def _map_tensors(root: Any, fn: Any) -> Any:
    """`root` with fn applied to every tensor in its dicts, lists and tuples: iterative,
    each object once (shared children stay shared), containers without a changed tensor
    kept as they are."""
    done: dict[int, Any] = {}
    started: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        obj, expanded = stack.pop()
        key = id(obj)
        if key in done:
            continue
        if isinstance(obj, torch.Tensor):
            done[key] = fn(obj)
            continue
        kids = _containers(obj)
        if kids is None:
            done[key] = obj
            continue
        if not expanded:
            if key in started:
                continue  # a cycle: left as it is
            started.add(key)
            stack.append((obj, True))
            stack.extend((kid, False) for kid in kids if id(kid) not in done)
            continue
        items = [done.get(id(kid), kid) for kid in kids]
        changed = any(a is not b for a, b in zip(items, kids, strict=True))
        done[key] = _rebuild(obj, items) if changed else obj
    return done.get(id(root), root)


def _tensors(root: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def record(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    _map_tensors(root, record)
    return found


# Where a training checkpoint keeps the model's state dict (ours, torch's tutorials',
# Lightning's); `dtype=` casts that entry only.
_MODEL_ENTRIES = ("model", "model_state_dict", "state_dict")


def _model_state(state: Any) -> Any:
    """What `dtype=` casts: a training checkpoint's model entry, else the whole checkpoint
    (a state dict)."""
    if isinstance(state, dict):
        for entry in _MODEL_ENTRIES:
            if isinstance(state.get(entry), dict):
                return state[entry]
    return state


def _path_to(root: Any, target: torch.Tensor) -> str:
    """Where `target` sits in `root` ('model' / '0.weight'), each container looked at once."""
    seen: set[int] = set()
    stack: list[tuple[Any, tuple[Any, ...]]] = [(root, ())]
    while stack:
        obj, keys = stack.pop()
        if obj is target:
            return " / ".join(repr(k) for k in keys) or "the checkpoint"
        if id(obj) in seen or isinstance(obj, torch.Tensor):
            continue
        seen.add(id(obj))
        items = obj.items() if isinstance(obj, dict) else \
            enumerate(obj) if isinstance(obj, (list, tuple)) else ()
        stack.extend((value, (*keys, key)) for key, value in items)
    return "a tensor"


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """The 1-D tensor of `t`'s dtype over all of its storage."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=t.dtype)
    flat.set_(storage, 0, (storage.nbytes() // t.element_size(),), (1,))
    return flat


def _largest_finite(t: torch.Tensor) -> float:
    if t.numel() == 0:
        return 0.0
    magnitude = t.detach().abs()
    magnitude.nan_to_num_(nan=0.0, posinf=0.0)  # infinities stay infinities: not ours
    return float(magnitude.max())


def _check_range(cast: list[torch.Tensor], state: Any, dtype: torch.dtype, path: Path
                 ) -> None:
    """Refuse a cast that would turn a finite value into inf (float16's range ends at
    65504; float8_e4m3fn, which has no inf, would clamp it). Small values rounding to zero
    are ordinary rounding, not refused. Each storage is read once (a view may address far
    more elements than its storage holds); only one holding such a value is looked at again,
    view by view, to name the tensor."""
    info = torch.finfo(dtype)
    # Values under the largest finite one plus half its ulp round down to it.
    limit = info.max + math.ldexp(info.eps, math.frexp(info.max)[1] - 2)
    views: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
    for t in cast:
        if t.numel() and torch.finfo(t.dtype).max >= limit:
            storage = t.untyped_storage()
            views.setdefault((storage.data_ptr(), storage.nbytes(), t.dtype), []).append(t)
    for same_storage in views.values():
        flat = _whole_storage(same_storage[0])
        if _largest_finite(flat) < limit:
            continue
        for t in same_storage:
            span = 1 + sum((n - 1) * step for n, step in zip(t.shape, t.stride(), strict=True))
            largest = _largest_finite(flat[t.storage_offset():t.storage_offset() + span])
            if largest < limit:
                continue
            became = float(torch.tensor(largest, dtype=t.dtype).to(dtype))
            raise CheckpointError(
                f"checkpoint {path}: {_path_to(state, t)} holds a value of magnitude "
                f"{largest:.6g}, beyond {dtype}'s largest value {info.max:.6g}: "
                f"dtype={dtype} would make it {became:g}; nothing was converted. Load it "
                "without dtype= or with a dtype of wider range")


def _place_all(state: Any, path: Path, size: int, device: torch.device | None,
               dtype: torch.dtype | None) -> Any:
    """Cast the model's floating tensors to `dtype` (other state, an optimizer's say, keeps
    its dtypes) and move everything to `device`, one storage at a time (views of one
    storage stay views of one storage), after estimating the memory."""
    if device is None and dtype is None:
        return state
    cast = [t for t in _tensors(_model_state(state)) if t.is_floating_point()] \
        if dtype is not None else []
    cast_ids = {id(t) for t in cast}

    def target_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and id(t) in cast_ids else t.dtype

    def dense(t: torch.Tensor) -> bool:
        return (t.layout == torch.strided and t.device.type == "cpu" and not t.is_quantized
                and type(t) in (torch.Tensor, nn.Parameter))

    need = 0
    storages: set[tuple[int, int, torch.dtype]] = set()
    for t in _tensors(state):
        itemsize = torch.empty(0, dtype=target_dtype(t)).element_size()
        if dense(t):
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes(), target_dtype(t))
            if key not in storages:
                storages.add(key)
                need += storage.nbytes() // max(t.element_size(), 1) * itemsize
        else:
            need += t.numel() * itemsize
    limit = _EXPANSION * size + _ALLOWANCE
    if need > limit:
        raise CheckpointError(
            f"checkpoint {path} is damaged or hostile: converting it would take {need} bytes "
            f"of memory, over {limit} for a {size}-byte file; nothing was converted")
    if dtype is not None:
        _check_range([t for t in cast if dense(t)], state, dtype, path)
    # Keyed by the dtype wanted too: a weight and an optimizer tensor may share a storage.
    converted: dict[tuple[int, int, torch.dtype, torch.dtype], torch.Tensor] = {}

    def place(t: torch.Tensor) -> torch.Tensor:
        want = target_dtype(t)
        if not dense(t):
            moved = t.to(want)
            if moved.dtype != want:  # a quantized weight (torchao's): its dtype is its
                # dequantized values', which .to() leaves as they are
                raise CheckpointError(
                    f"checkpoint {path} holds {type(t).__name__} tensors (quantized weights), "
                    f"which do not convert to {want} (they stay {moved.dtype}): load it "
                    "without dtype=")
            return moved.to(device) if device is not None else moved
        if want == t.dtype and device is None:
            return t
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes(), t.dtype, want)
        base = converted.get(key)
        if base is None:
            base = _whole_storage(t).to(want)
            if device is not None:
                base = base.to(device)
            converted[key] = base
        return base.as_strided(t.size(), t.stride(), t.storage_offset())

    return _map_tensors(state, place)


def load_checkpoint(path: str | os.PathLike[str], backend: Any = None,
                    dtype: torch.dtype | None = None, *, weights_only: bool = True,
                    format: str | None = None) -> Any:
    """Load a checkpoint onto `backend` (a Backend or a name such as "tpu"; None: the CPU),
    casting the model's floating-point tensors to `dtype` if given: those of a training
    checkpoint's "model" ("model_state_dict", "state_dict") entry, else every one in the
    checkpoint (a state dict). Everything else keeps the dtype it was saved in: integer,
    bool and complex tensors, and the optimizer's, scheduler's and other state next to the
    model entry (Adam's float32 step counts).
    A weight holding a finite value beyond `dtype`'s range (float16's 65504) is refused,
    naming it, instead of becoming inf; tiny values rounding to zero are not refused.

    `format` is "torch" or "safetensors"; None picks safetensors for a `.safetensors` file,
    a `*.safetensors.index.json` (a sharded checkpoint) or a folder holding either, else
    torch. weights_only=True (the default) reads tensors and plain containers only and
    refuses anything else; a file that needs more says so, and weights_only=False loads it
    by running the code pickled in it: do that only for files you trust (safetensors files
    never hold code). An empty, truncated, damaged or foreign file, or one whose structure
    or sizes are out of bounds, is a CheckpointError saying so."""
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
    fmt = _format_of(path, format, loading=True)
    if fmt == "safetensors":
        if not path.exists():
            raise CheckpointError(f"checkpoint {path} does not exist")
        state: Any = safetensors_io.load(path)
        size = sum(t.nbytes for t in state.values())
    else:
        _check_file(path)
        remove_dead_temporaries(path.resolve().parent)
        state, size = _load_torch(path, weights_only)
        # weights_only admits DTensors once torch.distributed.tensor is imported. A state
        # dict's own entries only: what a save of a sharded model wrote, without walking
        # every object of a large or deeply shared state again.
        shards = [(key, kind) for key, value in state.items()
                  if (kind := shard_type(value)) is not None] \
            if isinstance(state, dict) else []
        if shards:
            key, kind = shards[0]
            raise CheckpointError(_shards_in_file(path, f"{kind}s ({key} among them)"))
    return _place_all(state, path, size, device, dtype)
