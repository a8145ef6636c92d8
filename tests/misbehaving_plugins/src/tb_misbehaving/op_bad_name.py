"""Failure class: ops declared under names that cannot be ops. `__class__` is an attribute
of torch's op namespace (torch.ops.torchbridge.__class__ is a type, not an op): registered
anyway it crashed get_kernel and `torchbridge kernels`. With it, a keyword, a name with a
dash and one reserved for the implementations' wrapper ops, and one good op, which must
still be registered.

Reads the gate at its own import (not tb_misbehaving.ACTIVE), so that a test can load it
active on its own, from its file, without importing the package; register it with
torchbridge.register_plugin(module, name=...).
"""

from __future__ import annotations

import os

import torch
from torchbridge import OpDefinition, hookimpl

# tb_misbehaving.GATE, read here: importing the package with the gate open would leave
# it (and every module of it imported later) active for the whole process.
GATE = "TB_MISBEHAVING_PLUGINS"
ACTIVE = os.environ.get(GATE) == "1"
BAD_NAMES = ("__class__", "name", "lambda", "bad-name", "rms_norm__mine")
GOOD_NAME = "bad_name_plugin_double"


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


if ACTIVE:

    @hookimpl
    def torchbridge_ops() -> list[OpDefinition]:
        return [OpDefinition(name, double, "(Tensor x) -> Tensor") for name in BAD_NAMES] \
            + [OpDefinition(GOOD_NAME, double, "(Tensor x) -> Tensor")]
