"""TPU generations: the version a device kind names, and what its matrix units compute.

The runtime names a TPU by its PJRT device kind, the string JAX shows as
`jax.Device.device_kind` and torch_xla returns from `xm.xla_device_kind(device)` (not among
its device attributes, which hold coords, core_on_chip, num_cores, name). The kinds,
as JAX maps them to chip versions (jax/_src/pallas/mosaic/tpu_info.py,
`chip_version_from_device_kind`): "TPU v2", "TPU v3", "TPU v4", "TPU v4 lite", "TPU v5 lite"
(v5e), "TPU v5" (v5p), "TPU v6 lite" (v6e, Trillium), "TPU7" and "TPU7x" (Ironwood).

What each generation multiplies natively, from two public sources that agree: Google
Cloud's per-version "System architecture" pages (peak compute per chip by data type) and
JAX's TpuInfo table in the same tpu_info.py (bf16/int8/fp8 ops per second, 0 for "Not
Available"). Every generation multiplies bf16 in its MXUs (Cloud TPU "The bfloat16
numerical format"); float16 is no TPU matmul type (tpu_info.py `is_matmul_supported`
accepts it on no generation; pytorch/xla issue 2939: "TPU uses bfloat16"). Only a format
faster than bf16 is listed: int8 inputs on v4 run at the bf16 rate, FP8 inputs on v5p and
v6e too.

Pure data: no torch_xla, no pydantic; config.TPUVersion names the same versions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BASE_DTYPES = ["float32", "bfloat16"]


@dataclass(frozen=True)
class TPUGeneration:
    version: str  # the TPUVersion value: "v5e"
    name: str     # Google Cloud's name for it
    int8: bool    # int8 x int8 matmuls at twice the bf16 rate
    fp8: bool     # float8 (e4m3fn, e5m2) matmuls at twice the bf16 rate

    @property
    def supported_dtypes(self) -> list[str]:
        dtypes = list(BASE_DTYPES)
        if self.int8:
            dtypes.append("int8")
        if self.fp8:
            dtypes += ["float8_e4m3fn", "float8_e5m2"]
        return dtypes


GENERATIONS = {
    # Cloud TPU "TPU v2" page: bf16 only; tpu_info.py: int8 and fp8 "Not Available".
    "v2": TPUGeneration("v2", "TPU v2", int8=False, fp8=False),
    # Cloud TPU "TPU v3": 123 TFLOPs (bf16); tpu_info.py: int8 and fp8 "Not Available".
    "v3": TPUGeneration("v3", "TPU v3", int8=False, fp8=False),
    # Cloud TPU "TPU v4": 275 TFLOPs "bf16 or int8" (int8 at the bf16 rate); tpu_info.py:
    # int8 "Not Available", int8 only as the weight of a bf16 matmul (is_matmul_supported).
    "v4": TPUGeneration("v4", "TPU v4", int8=False, fp8=False),
    # Cloud TPU "TPU v5e": 197 TFLOPs bf16, 393 TOPs int8; tpu_info.py: fp8 "Not Available".
    "v5e": TPUGeneration("v5e", "TPU v5e", int8=True, fp8=False),
    # Cloud TPU "TPU v5p": 459 TFLOPs bf16, 918 TOPs int8; Cloud "TPU7x" page: FP8 459
    # (the bf16 rate); tpu_info.py: fp8 "Not Available".
    "v5p": TPUGeneration("v5p", "TPU v5p", int8=True, fp8=False),
    # Cloud TPU "TPU v6e" (Trillium): 918 TFLOPs bf16, 1836 TOPs int8; Cloud "TPU7x" page:
    # FP8 918 (the bf16 rate).
    "v6e": TPUGeneration("v6e", "TPU v6e (Trillium)", int8=True, fp8=False),
    # Cloud TPU "TPU7x (Ironwood)": 2307 TFLOPs bf16, 4614 FP8, no int8 figure;
    # tpu_info.py (TPU_7 and TPU_7X alike): fp8 4.6e15 ops/s, int8 "Not Available".
    "v7": TPUGeneration("v7", "TPU7 (Ironwood)", int8=False, fp8=True),
    "v7x": TPUGeneration("v7x", "TPU7x (Ironwood)", int8=False, fp8=True),
}

# Device kinds whose version is not their number and letter (tpu_info.py's mapping).
_KIND_ALIASES = {"v5 lite": "v5e", "v5litepod": "v5e", "v6 lite": "v6e", "v5": "v5p"}
_KIND = re.compile(r"v?(\d+)([a-z]*)")


def tpu_version(device_kind: str | None) -> str | None:
    """"TPU v4" -> "v4", "TPU v5 lite" -> "v5e", "TPU v5" -> "v5p", "TPU7x" -> "v7x"; None
    when it is not a TPU kind (a "TPU v4 lite" is a v4: the same matrix units)."""
    if not device_kind or not device_kind.startswith("TPU"):
        return None
    rest = device_kind[3:].strip().lower()
    for prefix, version in _KIND_ALIASES.items():
        if rest == prefix or rest.startswith(prefix + " ") or \
                (prefix.endswith("pod") and rest.startswith(prefix)):
            return version
    match = _KIND.match(rest)
    return f"v{match.group(1)}{match.group(2)}" if match else None


def generation(version: str | None) -> TPUGeneration | None:
    return GENERATIONS.get(version) if version else None


def supported_dtypes(version: str | None) -> list[str]:
    """The generation's dtypes; for a TPU no table entry knows, only what every TPU has."""
    found = generation(version)
    return found.supported_dtypes if found else list(BASE_DTYPES)
