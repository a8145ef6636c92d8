"""The example plugin's config section. Its own module, imported inside the config hook:
importing pydantic at plugin load would add about 160 ms to every discovery."""

from __future__ import annotations

from pydantic import Field
from torchbridge import ConfigSection


class ExampleConfig(ConfigSection):
    """`config.hardware.example`."""

    greeting: str = "hello"
    scale: float = Field(default=1.0, gt=0)
    veto_pass: str | None = None
    tag_models: bool = False
    memory_gb: float = Field(default=16.0, gt=0, description="the pretend device's memory")
