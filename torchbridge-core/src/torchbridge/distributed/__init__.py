"""Distributed training on torch.distributed, on whatever backend TorchBridge selects.

    ctx = torchbridge.distributed.initialize()         # torchrun's env, or one process
    model = ctx.backend.prepare_model(model, "O1", distributed="ddp")   # or "fsdp"
    ...
    torchbridge.distributed.save_distributed_checkpoint(model, "ckpt/", optimizer)
    torchbridge.distributed.destroy()

Start it with `torchbridge launch --nproc-per-node auto train.py` (torchrun underneath).
Names load on first use, like the package root's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchbridge.distributed.checkpoints import (
        distributed_to_single_file,
        load_distributed_checkpoint,
        save_distributed_checkpoint,
        single_file_to_distributed,
    )
    from torchbridge.distributed.context import DistributedContext, current_context
    from torchbridge.distributed.runtime import destroy, initialize
    from torchbridge.distributed.strategies import STRATEGIES, user_module

_LAZY = {
    "initialize": "torchbridge.distributed.runtime",
    "destroy": "torchbridge.distributed.runtime",
    "DistributedContext": "torchbridge.distributed.context",
    "current_context": "torchbridge.distributed.context",
    "STRATEGIES": "torchbridge.distributed.strategies",
    "user_module": "torchbridge.distributed.strategies",
    "save_distributed_checkpoint": "torchbridge.distributed.checkpoints",
    "load_distributed_checkpoint": "torchbridge.distributed.checkpoints",
    "distributed_to_single_file": "torchbridge.distributed.checkpoints",
    "single_file_to_distributed": "torchbridge.distributed.checkpoints",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torchbridge.distributed' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "STRATEGIES", "DistributedContext", "current_context", "destroy",
    "distributed_to_single_file", "initialize", "load_distributed_checkpoint",
    "save_distributed_checkpoint", "single_file_to_distributed", "user_module",
]
