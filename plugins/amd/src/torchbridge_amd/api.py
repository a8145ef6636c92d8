"""Public API, re-exported as `torchbridge.backends.amd`."""

from torchbridge.backends import named_backend_class

AMDBackend = named_backend_class("rocm", "AMDBackend")

__all__ = ["AMDBackend"]
