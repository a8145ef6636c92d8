"""Failure class: a kernel right only on small inputs. Its rms_norm handles the first 64
rows (one tile) and gets every later row wrong (the scale applied twice), so a check on
16 rows passes and a real batch is wrong.

Reads the gate at its own import (not tb_misbehaving.ACTIVE), so that a test can load it
active on its own, from its file, without importing the package; register it with
torchbridge.register_plugin(module, name=...).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torchbridge import KernelImplementation, hookimpl

# tb_misbehaving.GATE, read here: importing the package with the gate open would leave
# it (and every module of it imported later) active for the whole process.
GATE = "TB_MISBEHAVING_PLUGINS"
ACTIVE = os.environ.get(GATE) == "1"
NAME = "one_tile_rms_norm"
TILE = 64


def one_tile_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float
                      ) -> torch.Tensor:
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.float()
    rows = out.reshape(-1, out.shape[-1])
    if rows.shape[0] > TILE and weight is not None:
        rows = torch.cat((rows[:TILE], rows[TILE:] * weight.float()))  # the bug
    return rows.reshape(out.shape).to(x.dtype)


if ACTIVE:

    @hookimpl(tryfirst=True)
    def torchbridge_kernel_implementations(backend: Any) -> list[KernelImplementation]:
        return [KernelImplementation("rms_norm", NAME, one_tile_rms_norm, priority=100,
                                     backends=("cpu",), description="right on one tile")]
