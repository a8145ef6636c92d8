"""Public API, re-exported as `torchbridge.backends.tpu`."""

from torchbridge.backends import named_backend_class

TPUBackend = named_backend_class("tpu", "TPUBackend")

__all__ = ["TPUBackend"]
