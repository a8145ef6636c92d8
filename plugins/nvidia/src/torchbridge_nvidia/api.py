"""Public API, re-exported as `torchbridge.backends.nvidia`."""

from torchbridge.backends import named_backend_class

NVIDIABackend = named_backend_class("cuda", "NVIDIABackend")

__all__ = ["NVIDIABackend"]
