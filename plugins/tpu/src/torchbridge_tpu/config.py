"""`config.hardware.tpu`. Imported only when a config is loaded (pydantic is not cheap)."""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from torchbridge.config import ConfigModel


class TPUVersion(str, enum.Enum):
    """The generations of generations.GENERATIONS, and auto."""

    AUTO = "auto"
    V2 = "v2"
    V3 = "v3"
    V4 = "v4"
    V5E = "v5e"
    V5P = "v5p"
    V6E = "v6e"
    V7 = "v7"
    V7X = "v7x"  # Ironwood, device kind "TPU7x"


class TPUTopology(str, enum.Enum):
    """What topology.py checks against the runtime."""

    AUTO = "auto"
    SINGLE = "single"
    POD = "pod"
    SUPERPOD = "superpod"


class TPUConfig(ConfigModel):
    version: TPUVersion = Field(
        default=TPUVersion.AUTO, description="auto: read from the runtime's device kind; a "
        "version fills in only for a TPU this plugin's table does not know (it picks the "
        "dtypes DeviceInfo reports); one contradicting the device is noted and ignored")
    topology: TPUTopology = Field(
        default=TPUTopology.AUTO, description="auto: from the runtime (DeviceInfo.extra"
        "['topology']); single (one host), pod (one slice over several hosts) or superpod "
        "(several slices, Multislice) states what the job expects: a runtime reporting "
        "otherwise is noted in DeviceInfo.notes")
    compilation_mode: Literal["openxla", "lazy"] = Field(
        default="openxla", description="openxla: torch.compile(backend='openxla') at O2+; "
        "lazy: torch_xla's lazy tensor tracing only (the seeds' 'torch_xla')")
    enable_xla_cache: bool = Field(default=False, description="XLA's persistent "
                                   "compilation cache, initialized by prepare_model")
    cache_dir: str | None = Field(default=None, description="None: "
                                  "~/.cache/torchbridge/xla")
    precision: Literal["bfloat16", "float32"] = Field(
        default="bfloat16", description="compute dtype at O2+ (bfloat16 is the TPU's)")
    mixed_precision: bool = Field(default=True, description="bf16 autocast at O2+ with "
                                  "float32 weights")
    max_memory_fraction: float | None = Field(
        default=None, gt=0.0, le=1.0,
        validation_alias=AliasChoices("max_memory_fraction", "memory_fraction"),
        description="share of device memory OOM-protected allocations may plan for; "
        "torch_xla has no per-process cap, so nothing else enforces it")

    @property
    def memory_fraction(self) -> float | None:
        """The seeds' name for max_memory_fraction."""
        return self.max_memory_fraction

    @field_validator("compilation_mode", mode="before")
    @classmethod
    def _seed_mode_name(cls, value: object) -> object:
        return "lazy" if value == "torch_xla" else value
