"""Putting a model back exactly as it was, in place, when a pass fails.

A deep copy taken before a pass cannot roll back the caller's own model (inplace=True): it
would hand back the copy while the caller's object stays half-changed. A snapshot records
what a pass can change on the objects themselves: each module's class and attribute table
(its parameter, buffer, submodule and hook tables copied one level deep), and, for passes
that change weights, the data of every parameter and buffer. Restoring writes all of it
back into the same objects, so that every reference the caller holds sees the old state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _copy_table(table: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.copy() if isinstance(v, dict) else v) for k, v in table.items()}


class ModelSnapshot:
    def __init__(self, model: nn.Module, *, tensors: bool) -> None:
        self.modules = [(m, m.__class__, _copy_table(m.__dict__))
                        for m in model.modules()]
        self.data: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        if tensors:
            seen: set[int] = set()
            for t in [*model.parameters(), *model.buffers()]:
                if id(t) not in seen:
                    seen.add(id(t))
                    self.data.append((t, t.data.clone(), t.requires_grad))

    def restore(self) -> None:
        for module, cls, table in self.modules:
            if module.__class__ is not cls:
                module.__class__ = cls
            module.__dict__.clear()
            module.__dict__.update(_copy_table(table))
        with torch.no_grad():
            for tensor, saved, requires_grad in self.data:
                tensor.data = saved
                if tensor.requires_grad != requires_grad and tensor.is_leaf:
                    tensor.requires_grad_(requires_grad)
