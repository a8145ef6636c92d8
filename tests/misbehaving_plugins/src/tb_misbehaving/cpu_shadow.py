"""Failure class 33: an entry point named "cpu", the built-in plugin's name. The host must
never import it (the name alone is the problem, so this is not gated), nor let it replace
or remove the built-in cpu backend, also with TORCHBRIDGE_DISABLE_PLUGINS=cpu."""

from __future__ import annotations

from torchbridge import Detection, hookimpl

IMPORTED = True  # the test checks this module is absent from sys.modules


@hookimpl(tryfirst=True)
def torchbridge_detect() -> Detection:
    return Detection("cpu", False, 0, "cpu", 0, reason="shadowed by an entry point")
