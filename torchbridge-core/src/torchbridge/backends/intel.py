"""`from torchbridge.backends.intel import ...`: the torchbridge-intel plugin's public API."""

from torchbridge.backends._vendor import reexport

reexport(globals(), "torchbridge_intel", "intel")
