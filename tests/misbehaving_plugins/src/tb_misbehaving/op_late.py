"""Failure class: a plugin's own op that appears late. It declares `late_scale` (and an
implementation of it); the op used to exist as torch.ops.torchbridge.late_scale only after
something called get_kernel: not after the plugin loaded, not after get_backend, not after
an O3 prepare_model of a model without a module of its kind.

Ops are process-wide and never unregistered, so tests use `LateOps(op_name)`: the same
plugin declaring an op under a name of the test's own.

Reads the gate at its own import (not tb_misbehaving.ACTIVE), so that a test can load it
active on its own, from its file, without importing the package; register it with
torchbridge.register_plugin(module, name=...).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torchbridge import KernelImplementation, OpDefinition, hookimpl

# tb_misbehaving.GATE, read here: importing the package with the gate open would leave
# it (and every module of it imported later) active for the whole process.
GATE = "TB_MISBEHAVING_PLUGINS"
ACTIVE = os.environ.get(GATE) == "1"
OP = "late_scale"


def late_scale(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
    return x * factor


class LateOps:
    """The plugin, declaring its op as `op`."""

    def __init__(self, op: str = OP) -> None:
        self.op = op

    @hookimpl
    def torchbridge_ops(self) -> list[OpDefinition]:
        return [OpDefinition(self.op, late_scale, "(Tensor x, float factor=2.0) -> Tensor")]

    @hookimpl
    def torchbridge_kernel_implementations(self, backend: Any) -> list[KernelImplementation]:
        return [KernelImplementation(self.op, "late_scale_kernel", late_scale,
                                     traceable=True, differentiable=True)]


if ACTIVE:
    _plugin = LateOps()

    @hookimpl
    def torchbridge_ops() -> list[OpDefinition]:
        return _plugin.torchbridge_ops()

    @hookimpl
    def torchbridge_kernel_implementations(backend: Any) -> list[KernelImplementation]:
        return _plugin.torchbridge_kernel_implementations(backend)
