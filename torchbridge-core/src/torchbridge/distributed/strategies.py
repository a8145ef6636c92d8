"""`prepare_model(..., distributed="ddp" | "fsdp")`: the level's passes, then the wrapper.

Order. The level's passes run first and unchanged (placement, autocast, compile ...); the
distributed wrapper goes outside them. That is the order torch documents: "torch.compile
doesn't handle distributed wrapper modules like DDP or FSDP very well, so consider applying
torch.compile to the inner module passed to the wrapper" (torch.compile docs, "Where to
apply torch.compile?"); with DDP outside, dynamo still sees the active DDP module and splits
the compiled graph at DDP's bucket boundaries (DDPOptimizer), so gradient all-reduce
overlaps the backward. FSDP2 shards the parameters of the modules it is given, in place,
so `fully_shard` goes onto the user's module and its repeated blocks, which sit inside the
compile and autocast wrappers. FSDP2's hooks are excluded from dynamo's tracing
(`torch._dynamo.disable` around them: always in torch 2.13; under
`torch._dynamo.config.skip_fsdp_hooks`, on by default, before), so the compiled model breaks
its graph at each sharded block and the all-gathers and reduce-scatters run eagerly between
compiled regions: the effect torchtitan gets by compiling each block, then sharding it.
Autocast stays inside: FSDP gathers float32 parameters and the ops compute in the autocast
dtype, as without FSDP.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from torchbridge.distributed.context import DistributedContext, current_context
from torchbridge.errors import DistributedError
from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.report import OptimizationResult, PassRecord, attach_result
from torchbridge.wrapped import unwrap

if TYPE_CHECKING:
    from torchbridge.backend import Backend
    from torchbridge.optimize.measure import Timer

logger = logging.getLogger(__name__)

STRATEGIES = {
    "ddp": "DistributedDataParallel: a full replica per rank, gradients all-reduced",
    "fsdp": "FSDP2 (fully_shard): parameters, gradients and optimizer state sharded "
            "across ranks, gathered per block for compute",
}
# Device types FSDP2 cannot shard on, and why.
FSDP_UNSUPPORTED = {
    "xla": "FSDP2 does not run on XLA devices; torch_xla shards through SPMD "
           "(torch_xla.distributed.spmd, its FSDPv2), which TorchBridge does not wrap yet",
    "mps": "torch.distributed has no MPS process-group backend for FSDP2's collectives",
}


def user_module(model: nn.Module) -> nn.Module:
    """The user's module inside the wrappers around it (DDP; torch.compile's when a plugin's
    pass wraps), whose keys a checkpoint saves under (torchbridge.wrapped.unwrap).
    With FSDP2 it is the module `fully_shard` sharded in place."""
    return unwrap(model)


def fully_shard_function() -> Callable[..., Any] | None:
    """torch's `fully_shard` (public from torch 2.6; before that under _composable), or
    None when this torch has no FSDP2."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import (  # type: ignore[attr-defined]
                fully_shard,  # torch 2.4, 2.5
            )
        except ImportError:
            return None
    return fully_shard  # type: ignore[no-any-return]


def unsupported_reason(strategy: str, context: DistributedContext) -> str | None:
    """Why `strategy` cannot run on this rank's device, or None when it can."""
    device_type = context.device.type
    if strategy == "fsdp":
        if device_type in FSDP_UNSUPPORTED:
            return FSDP_UNSUPPORTED[device_type]
        if fully_shard_function() is None:
            return f"torch {torch.__version__} has no FSDP2 (fully_shard needs torch 2.4+)"
    return None


def _ddp(prepared: nn.Module, context: DistributedContext) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device = context.device
    # One device per process: DDP needs its index on an accelerator, none on cpu or xla.
    device_ids = [device.index] if device.index is not None and device.type != "xla" \
        else None
    return DistributedDataParallel(prepared, device_ids=device_ids)


def broadcast_from_rank0(tensors: Iterable[torch.Tensor], device: torch.device | None
                         ) -> None:
    """Rank 0's values into `tensors` on every rank, in place (every rank passes the same
    tensors in the same order). Each goes through `device`, this rank's, which the process
    group serves: a model still on the CPU is sent this way under nccl too (None: each
    tensor's own)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in tensors:
            sent = tensor.data if device is None else tensor.data.to(device)
            dist.broadcast(sent, src=0)
            if sent is not tensor.data:
                tensor.data.copy_(sent)


def _fsdp(prepared: nn.Module, context: DistributedContext) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = fully_shard_function()
    assert fully_shard is not None  # unsupported_reason said so before the passes ran
    inner = user_module(prepared)
    mesh = init_device_mesh(context.device.type, (context.world_size,))
    # The repeated blocks (a model's ModuleLists: transformer layers, stages) are sharded
    # one by one, so that one block's parameters are gathered at a time; the root takes the
    # rest. Children before parents: fully_shard claims every parameter not yet claimed.
    blocks = [block for modules in inner.modules() if isinstance(modules, nn.ModuleList)
              for block in modules if any(True for _ in block.parameters())]
    for block in reversed(blocks):
        fully_shard(block, mesh=mesh)
    fully_shard(inner, mesh=mesh)
    logger.info("fully_shard: %d block(s) and the root over %d rank(s)", len(blocks),
                context.world_size)
    return prepared


_WRAPPERS: dict[str, Callable[[nn.Module, DistributedContext], nn.Module]] = {
    "ddp": _ddp, "fsdp": _fsdp}


def check_strategy(strategy: object) -> str:
    if not isinstance(strategy, str) or strategy.lower() not in STRATEGIES:
        raise DistributedError(f"distributed must be one of {', '.join(STRATEGIES)} (or None),"
                               f" got {strategy!r}")
    return strategy.lower()


class _Rank0Timings:
    """The timer of every rank's keep-the-fastest decision (O2 and O3 with a sample input in
    eval mode): rank 0 times the candidates, every other rank takes rank 0's figures in the
    order they were measured. round_robin decides from the figures alone, so every rank
    keeps what rank 0 kept. Each rank timing for itself kept compile on one rank and O0 on
    the other (a stall of a few ms on one core was enough), and DDP then averaged the
    gradients of a bf16 model with those of a float32 one.

    One collective: rank 0 sends its figures after its run (`exchange`); another rank
    receives them at its first timing, or after its run when it timed nothing."""

    def __init__(self, rank: int, timer: Timer) -> None:
        self.rank, self.timer = rank, timer
        self.figures: dict[str, list[float]] = {}  # rank 0's seconds of each candidate
        self.received = False
        self.used = False  # rank 0's figures were taken here

    def __call__(self, label: str, fn: Callable[[], Any]) -> float:
        if self.rank == 0:
            seconds = self.timer(label, fn)
            self.figures.setdefault(label, []).append(seconds)
            return seconds
        self.exchange()
        queue = self.figures.get(label)
        if queue:
            self.used = True
            return queue.pop(0)
        # Rank 0 timed other candidates: its model differs from this rank's, which the
        # comparison after the run reports.
        logger.info("rank %d: rank 0 has no timing of %r; timed here", self.rank, label)
        return self.timer(label, fn)

    def exchange(self) -> None:
        import torch.distributed as dist

        if self.received:
            return
        box: list[Any] = [self.figures if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        self.figures, self.received = box[0] or {}, True


def _same_tensors(name: str, context: DistributedContext, tensors: list[torch.Tensor]
                  ) -> None:
    """The same DistributedError on every rank unless every rank's model has the same
    parameters and buffers (shapes, dtypes) for rank 0's to be broadcast into."""
    import torch.distributed as dist

    mine = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]
    everyone: list[Any] = [None] * context.world_size
    dist.all_gather_object(everyone, mine)
    rank = next((r for r, theirs in enumerate(everyone) if theirs != everyone[0]), None)
    if rank is None:
        return
    ours, theirs = everyone[0], everyone[rank]
    if len(ours) != len(theirs):
        differ = f"rank 0's has {len(ours)} parameters and buffers, rank {rank}'s {len(theirs)}"
    else:
        i = next(i for i, pair in enumerate(zip(ours, theirs, strict=True))
                 if pair[0] != pair[1])
        differ = f"parameter or buffer #{i} is {' '.join(map(str, ours[i]))} on rank 0, " \
                 f"{' '.join(map(str, theirs[i]))} on rank {rank}"
    raise DistributedError(f"prepare_model(distributed={name!r}): the ranks were given "
                           f"different models ({differ}); build the same model on every "
                           "rank, for rank 0's weights to be broadcast into")


def _outcome(result: OptimizationResult | None, error: Exception | None) -> dict[str, Any]:
    """What a rank tells the others of its run: its error, or the passes it kept, each
    pass's record and its parameters' dtypes."""
    if result is None:
        return {"error": f"{type(error).__name__}: {error}"}
    return {"kept": result.optimizations_applied,
            "passes": {p.name: f"{p.status}: {p.detail}"[:200] for p in result.passes},
            "dtypes": [str(p.dtype).removeprefix("torch.")
                       for p in user_module(result.model).parameters()]}


def _agree(name: str, context: DistributedContext, outcome: dict[str, Any],
           error: Exception | None) -> None:
    """Every rank's outcome to every rank; raises the same DistributedError on every rank
    where one failed or where they kept different models (before the wrapper's
    collectives, where a rank that raised alone left the others with "Connection closed
    by peer", and different models trained together silently)."""
    import torch.distributed as dist

    outcomes: list[Any] = [None] * context.world_size
    dist.all_gather_object(outcomes, outcome)
    failed = "; ".join(f"rank {rank}: {o['error']}" for rank, o in enumerate(outcomes)
                       if "error" in o)
    if failed:
        raise DistributedError(
            f"prepare_model(distributed={name!r}) failed on {failed}; every rank raises "
            "this error, so that no rank goes on alone") from error
    first = outcomes[0]
    if all((o["kept"], o["dtypes"]) == (first["kept"], first["dtypes"]) for o in outcomes):
        return
    kept = "; ".join(f"rank {rank} kept {', '.join(o['kept']) or 'no pass'} (parameters "
                     f"{', '.join(sorted(set(o['dtypes']))) or 'none'})"
                     for rank, o in enumerate(outcomes))
    differing = [p for p in dict.fromkeys(p for o in outcomes for p in o["kept"])
                 if any(p not in o["kept"] for o in outcomes)]
    why = "; ".join(f"{p} on rank {rank}: {o['passes'].get(p, 'not run')}"
                    for p in differing for rank, o in enumerate(outcomes)
                    if p not in o["kept"])
    raise DistributedError(
        f"prepare_model(distributed={name!r}): the ranks prepared different models, which "
        f"cannot train as one: {kept}" + (f". Why: {why}" if why else "") + ". Each rank "
        "runs the level's passes and checks them on its own sample_input, so a sample that "
        "differs per rank (each rank's own batch) can keep a pass on one rank and not on "
        "another: pass the same sample_input on every rank (one batch made with the same "
        "seed everywhere), or none")


class _GivenModel:
    """The caller's model as given (inplace=True), to put back on a DistributedError: its
    modules' tables (classes, forwards, submodules, parameter objects) and a host copy of
    its parameters' and buffers' values: in host memory, not the accelerator's, where
    inplace=True is asked for to spare a copy."""

    def __init__(self, model: nn.Module) -> None:
        from torchbridge.optimize.snapshot import ModelSnapshot

        self.tables = ModelSnapshot(model, tensors=False)
        with torch.no_grad():
            self.values = [(t, t.detach().to("cpu", copy=True))
                           for t in [*model.parameters(), *model.buffers()]]

    @classmethod
    def take(cls, model: nn.Module) -> _GivenModel | None:
        try:
            return cls(model)
        except Exception as exc:  # out of host memory: the run goes on, unprotected
            logger.warning("prepare_model(inplace=True) could not keep a copy of the model "
                           "to put back should the ranks disagree: %s", exc)
            return None

    def restore(self, name: str, rank: int) -> None:
        try:
            self.tables.restore()
            with torch.no_grad():
                for tensor, value in self.values:
                    tensor.data = value.to(tensor.device)
        except Exception as exc:  # the DistributedError is still what every rank raises
            logger.warning("prepare_model(distributed=%r) failed, and rank %d could not put "
                           "its model back as it was given: %s", name, rank, exc)


def _prepare_every_rank(name: str, backend: Backend, model: nn.Module, level: Any,
                        context: DistributedContext, *, sample_input: Any, inplace: bool,
                        strict: bool | None, quantize: str | Literal[False] | None
                        ) -> OptimizationResult:
    """The level's passes on this rank, from rank 0's weights, with rank 0's timings; the
    same outcome on every rank, or a DistributedError on every rank."""
    from torchbridge.optimize import fastest
    from torchbridge.optimize.pipeline import copy_model, run_pipeline

    # The first call is never timed: the wrapper changes the model before it, and each rank
    # would decide on its own timing.
    if context.world_size == 1:
        return run_pipeline(backend, model, level, sample_input=sample_input, inplace=inplace,
                            strict=strict, quantize=quantize, first_call=False)
    # Rank 0's weights before the passes, not only in the wrapper: O3's inference freezing
    # compiles the weights it sees into the graph as constants, so each rank computed with
    # its own weights while its parameters held rank 0's.
    work = model if inplace else copy_model(model, "prepare_model works on a copy")
    # With inplace=True the caller's model is changed by the broadcast and the passes: on a
    # DistributedError it is put back as it was given.
    given = _GivenModel.take(work) if inplace else None
    tensors = [*work.parameters(), *work.buffers()]
    _same_tensors(name, context, tensors)
    broadcast_from_rank0(tensors, context.device)
    timer = _Rank0Timings(context.rank, fastest.default_timer(backend.synchronize))
    result: OptimizationResult | None = None
    error: Exception | None = None
    try:
        result = run_pipeline(backend, work, level, sample_input=sample_input, inplace=True,
                              strict=strict, quantize=quantize, timer=timer,
                              first_call=False)
    except Exception as exc:  # every rank hears of it before anyone raises
        error = exc
    timer.exchange()
    try:
        _agree(name, context, _outcome(result, error), error)
    except DistributedError:
        if given is not None:
            given.restore(name, context.rank)
        if result is None:
            raise
        # This rank's run succeeded and changed process-wide settings for a model that is
        # not returned: put them back, as a failed run's are. The error stays the same on
        # every rank; what could not be put back is this rank's own, so it is logged.
        problems = result.restore_process_settings()
        if problems:
            logger.warning("prepare_model(distributed=%r) failed; rank %d's own run had "
                           "succeeded, and of the process-wide settings it changed these "
                           "stay: %s", name, context.rank, "; ".join(problems))
        raise
    assert result is not None
    result.notes.append(f"{name}: rank 0's parameters and buffers were broadcast to every "
                        "rank before the passes ran, and every rank kept the same passes")
    if timer.used:
        result.notes.append(f"rank {context.rank} kept what rank 0's timings chose, so that "
                            "every rank keeps the same model")
    return result


def prepare_distributed(backend: Backend, model: nn.Module, level: Any, strategy: object, *,
                        sample_input: Any = None, inplace: bool = False,
                        strict: bool | None = None, quantize: str | Literal[False] | None = None
                        ) -> nn.Module:
    """The level's passes on every rank, from rank 0's weights, then the distributed wrapper
    around their result (see the module text for the order). The ranks' outcomes are
    compared first: a rank that failed, or ranks that kept different passes, are a
    DistributedError on every rank. The report gains the wrapper as its last applied
    step."""
    name = check_strategy(strategy)
    context = current_context()
    if context is None:
        raise DistributedError(f"prepare_model(distributed={name!r}) needs the process group: "
                               "call torchbridge.distributed.initialize() first (it also runs "
                               "without torchrun, as one process)")
    if backend.name != context.backend.name \
            or backend.hook_device() != context.backend.hook_device():
        raise DistributedError(
            f"this rank's device is {context.backend.hook_device()} on backend "
            f"{context.backend.name!r}, but the model is being prepared for "
            f"{backend.hook_device()} on {backend.name!r}; "
            "prepare it through the context's backend: ctx.backend.prepare_model(...)")
    reason = unsupported_reason(name, context)
    if reason is not None:
        raise DistributedError(f"distributed={name!r} is not supported on "
                               f"{context.device.type}: {reason}")
    result = _prepare_every_rank(name, backend, model, level, context,
                                 sample_input=sample_input, inplace=inplace, strict=strict,
                                 quantize=quantize)
    started = time.perf_counter()
    try:
        wrapped = _WRAPPERS[name](result.model, context)
    except Exception as exc:
        raise DistributedError(f"{name} could not wrap the prepared model on {context.device} "
                               f"({context.process_group_backend}): {type(exc).__name__}: "
                               f"{exc}") from exc
    result.passes.append(PassRecord(
        name, "applied", f"{STRATEGIES[name]}; {context.world_size} rank(s), "
        f"{context.process_group_backend}", "core", time.perf_counter() - started))
    result.notes.append(f"{name}: the wrapper is outside the level's passes (autocast, "
                        "compile), as torch recommends: compile the module passed to the "
                        "wrapper")
    if sample_input is None and result.level >= OptimizationLevel.O2 and not model.training \
            and backend.config.optimization.time_first_call:
        result.notes.append(f"no sample input: the first call is not timed under {name} (the "
                            "wrapper changes the model after prepare_model, and each rank "
                            "would keep what its own timings chose); the prepared model is "
                            "kept. Pass the same sample_input on every rank to keep the "
                            "fastest")
    result.model = wrapped
    attach_result(wrapped, result)
    return wrapped
