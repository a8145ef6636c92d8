"""Public API, re-exported as `torchbridge.backends.tpu`."""

from torchbridge.backends import named_backend_class

from torchbridge_tpu.config import TPUConfig, TPUTopology, TPUVersion
from torchbridge_tpu.generations import GENERATIONS, TPUGeneration, tpu_version

TPUBackend = named_backend_class("tpu", "TPUBackend")

__all__ = ["GENERATIONS", "TPUBackend", "TPUConfig", "TPUGeneration", "TPUTopology",
           "TPUVersion", "tpu_version"]
