"""`from torchbridge.backends.cpu import CPUBackend`."""

from torchbridge.backends import CPUBackend

__all__ = ["CPUBackend"]
