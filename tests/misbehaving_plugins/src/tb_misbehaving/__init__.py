"""Deliberately misbehaving TorchBridge plugins, one module (entry point) per failure class.

Inert unless TB_MISBEHAVING_PLUGINS=1: with the gate closed every module imports cleanly,
defines no hooks and does nothing, so the rest of the test suite sees well-behaved plugins.
A module imported while inert stays inert in that process (sys.modules caches it): to switch
the gate on in-process, delete every `tb_misbehaving*` module from sys.modules, set the
variable, then call `torchbridge.reload_plugins()`.
"""

from __future__ import annotations

import os

GATE = "TB_MISBEHAVING_PLUGINS"
ACTIVE = os.environ.get(GATE) == "1"
