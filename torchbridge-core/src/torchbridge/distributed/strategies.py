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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from torchbridge.distributed.context import DistributedContext, current_context
from torchbridge.errors import DistributedError
from torchbridge.optimize.report import PassRecord, attach_result
from torchbridge.wrapped import unwrap

if TYPE_CHECKING:
    from torchbridge.backend import Backend

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


def _broadcast_from_rank0(module: nn.Module) -> None:
    """fully_shard keeps each rank's own shard of its own weights; DDP broadcasts rank 0's.
    Do the same before sharding, so both strategies start every rank from one model."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)


def _fsdp(prepared: nn.Module, context: DistributedContext) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = fully_shard_function()
    assert fully_shard is not None  # unsupported_reason said so before the passes ran
    inner = user_module(prepared)
    mesh = init_device_mesh(context.device.type, (context.world_size,))
    _broadcast_from_rank0(inner)
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


def prepare_distributed(backend: Backend, model: nn.Module, level: Any, strategy: object, *,
                        sample_input: Any = None, inplace: bool = False,
                        strict: bool | None = None, quantize: str | Literal[False] | None = None
                        ) -> nn.Module:
    """The level's passes through `backend.optimize`, then the distributed wrapper around
    their result (see the module text for the order). The report gains the wrapper as its
    last applied step."""
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
    result = backend.optimize(model, level, sample_input=sample_input, inplace=inplace,
                              strict=strict, quantize=quantize)
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
    result.model = wrapped
    attach_result(wrapped, result)
    return wrapped
