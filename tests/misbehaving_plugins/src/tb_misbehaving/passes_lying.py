"""Failure class: a pass that lies about what it changes. It declares `mutates=False` (and
no process-wide settings), then changes them anyway. The pipeline must find out by itself,
roll the pass back and name it in the report; the prepared model must stay within the
level's tolerance of O0.

Inert unless TB_LYING_PASSES names a behaviour (its own gate, so that the test that uses it
does not open every other misbehaving plugin). The module defines its hook only when the
variable is set at import; the behaviour is read when the pass runs:
- weights_then_raise: adds 1.0 to every floating parameter, then raises;
- weights: adds 1.0 to every floating parameter (through .data: no version counter moves);
- setting: turns on TF32 for float32 matmuls (a process-wide torch setting);
- structure: replaces the first submodule by an identity.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torchbridge import OptimizationLevel, OptimizationPass, hookimpl

GATE = "TB_LYING_PASSES"


def _lie(model: nn.Module, ctx: Any) -> nn.Module:
    how = os.environ.get(GATE, "")
    if how.startswith("weights"):
        for p in model.parameters():
            if p.is_floating_point():
                p.data.add_(1.0)
        if how == "weights_then_raise":
            raise RuntimeError("mb_lying: failed after changing the weights")
    elif how == "setting":
        torch.backends.cuda.matmul.allow_tf32 = not torch.backends.cuda.matmul.allow_tf32
    elif how == "structure":
        name = next(iter(model._modules))
        model._modules[name] = nn.Identity()
    return model


if os.environ.get(GATE):  # no hooks at all otherwise, as every module here when inert

    @hookimpl
    def torchbridge_optimization_passes() -> Any:
        return [OptimizationPass("mb_lying", "claims to change nothing in the model",
                                 OptimizationLevel.O1, _lie, order=45, mutates=False)]
