"""The user's module inside the wrappers put around it, for the keys it saves under."""

from __future__ import annotations

from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside the wrappers around it: torch.compile's (a plugin's pass
    may wrap) and DDP's (prepare_model(distributed="ddp")), so that a prepared model saves
    under the same keys as the original (without DDP's "module." prefix). The core's own
    passes change forward in place and wrap nothing. With FSDP2 it is the module
    `fully_shard` sharded in place."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(inner, nn.Module):
            model = inner
        else:
            return model
