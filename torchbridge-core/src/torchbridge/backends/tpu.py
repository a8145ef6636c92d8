"""`from torchbridge.backends.tpu import ...`: the torchbridge-tpu plugin's public API."""

from torchbridge.backends._vendor import reexport

reexport(globals(), "torchbridge_tpu", "tpu")
