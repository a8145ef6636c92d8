"""`from torchbridge.backends.nvidia import ...`: the torchbridge-nvidia plugin's public API."""

from torchbridge.backends._vendor import reexport

reexport(globals(), "torchbridge_nvidia", "nvidia")
