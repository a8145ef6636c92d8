"""`from torchbridge.backends.amd import ...`: the torchbridge-amd plugin's public API."""

from torchbridge.backends._vendor import reexport

reexport(globals(), "torchbridge_amd", "amd")
