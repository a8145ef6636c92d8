"""A test plugin declaring one kernel implementation for cpu, preferred over the others
(tests/conftest.py's `declare` fixture registers one), and what the tests read back: the
plugin's errors and its row in the kernel table; and a residual block with an RMSNorm for
kernel substitution to swap. Shared by the kernel-check modules."""

from __future__ import annotations

from typing import Any

import torch
import torchbridge
from torch import nn
from torchbridge import KernelImplementation
from torchbridge.kernels.choice import kernel_table
from torchbridge.plugins import plugin_records


class _Declares:
    """A plugin declaring one implementation for cpu, preferred over the others."""

    def __init__(self, op: str, name: str, forward: Any, **declared: Any) -> None:
        self.op, self.name, self.forward, self.declared = op, name, forward, declared

    @torchbridge.hookimpl
    def torchbridge_kernel_implementations(self, backend: Any) -> list[KernelImplementation]:
        return [KernelImplementation(op=self.op, name=self.name, forward=self.forward,
                                     backends=("cpu",), priority=100, **self.declared)]


def _errors_of(plugin: str) -> list[str]:
    return next(r for r in plugin_records() if r.name == plugin).errors


def _row(op: str, name: str) -> tuple[str, dict[str, Any]]:
    entry = next(e for e in kernel_table(torchbridge.get_backend("cpu")) if e["op"] == op)
    return entry["selected"], next(i for i in entry["implementations"] if i["name"] == name)


class RmsNormBlock(nn.Module):
    """An RMSNorm (which kernel substitution swaps for an rms_norm kernel) in a residual
    block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.RMSNorm(64, eps=1e-6), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.proj(self.norm(x))
        return out
