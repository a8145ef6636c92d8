"""Public API, re-exported as `torchbridge.backends.tpu`."""

from torchbridge.backends import named_backend_class

from torchbridge_tpu.config import TPUConfig, TPUTopology, TPUVersion

TPUBackend = named_backend_class("tpu", "TPUBackend")

__all__ = ["TPUBackend", "TPUConfig", "TPUTopology", "TPUVersion"]
