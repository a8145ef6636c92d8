"""Loads fine, then raises during discovery."""

from torchbridge import hookimpl


@hookimpl
def torchbridge_detect() -> None:
    raise RuntimeError("broken_detect: the driver exploded (deliberately, for the tests)")
