"""Public API, re-exported as `torchbridge.backends.intel`."""

from torchbridge.backends import named_backend_class

IntelBackend = named_backend_class("xpu", "IntelBackend")

__all__ = ["IntelBackend"]
