"""NVIDIA architectures by compute capability, and the precision policy that follows.

The table holds only capabilities NVIDIA has published; anything else is reported as
unknown rather than guessed from the nearest number.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class NVIDIAArchitecture(str, enum.Enum):
    VOLTA = "volta"
    TURING = "turing"
    AMPERE = "ampere"
    ADA = "ada"
    HOPPER = "hopper"
    BLACKWELL = "blackwell"
    UNKNOWN = "unknown"


_BY_CAPABILITY = {
    (7, 0): NVIDIAArchitecture.VOLTA, (7, 2): NVIDIAArchitecture.VOLTA,  # V100, Xavier
    (7, 5): NVIDIAArchitecture.TURING,                                   # T4, RTX 20xx
    (8, 0): NVIDIAArchitecture.AMPERE, (8, 6): NVIDIAArchitecture.AMPERE,  # A100; A10, RTX 30xx
    (8, 7): NVIDIAArchitecture.AMPERE,                                   # Jetson Orin
    (8, 9): NVIDIAArchitecture.ADA,                                      # L4, L40, RTX 40xx
    (9, 0): NVIDIAArchitecture.HOPPER,                                   # H100, H200
    (10, 0): NVIDIAArchitecture.BLACKWELL, (10, 3): NVIDIAArchitecture.BLACKWELL,  # B200, B300
    (12, 0): NVIDIAArchitecture.BLACKWELL, (12, 1): NVIDIAArchitecture.BLACKWELL,  # RTX 50xx, GB10
}
# Order of the known architectures, for "Ampere and newer" rules.
_RANK = {arch: rank for rank, arch in enumerate(
    [NVIDIAArchitecture.VOLTA, NVIDIAArchitecture.TURING, NVIDIAArchitecture.AMPERE,
     NVIDIAArchitecture.ADA, NVIDIAArchitecture.HOPPER, NVIDIAArchitecture.BLACKWELL])}


def architecture_of(major: int, minor: int) -> NVIDIAArchitecture:
    return _BY_CAPABILITY.get((major, minor), NVIDIAArchitecture.UNKNOWN)


def at_least(arch: NVIDIAArchitecture, oldest: NVIDIAArchitecture) -> bool:
    """`arch` is `oldest` or newer. An unknown architecture is never assumed to be new."""
    return arch in _RANK and _RANK[arch] >= _RANK[oldest]


@dataclass(frozen=True)
class PrecisionPolicy:
    """What the tensor cores of one architecture compute natively."""

    architecture: NVIDIAArchitecture
    fp8: bool   # e4m3 / e5m2 matmuls (Hopper and newer)
    bf16: bool  # Ampere and newer
    fp16: bool  # every supported architecture

    @property
    def supported_dtypes(self) -> list[str]:
        dtypes = ["float32"]
        if self.fp16:
            dtypes.append("float16")
        if self.bf16:
            dtypes.append("bfloat16")
        if self.fp8:
            dtypes += ["float8_e4m3fn", "float8_e5m2"]
        return dtypes

    @property
    def preferred_low_precision_dtype(self) -> str | None:
        """bf16 where native (same range as fp32: no loss scaling), else fp16."""
        if self.bf16:
            return "bfloat16"
        return "float16" if self.fp16 else None


def precision_policy(arch: NVIDIAArchitecture) -> PrecisionPolicy:
    return PrecisionPolicy(
        architecture=arch,
        fp8=at_least(arch, NVIDIAArchitecture.HOPPER),
        bf16=at_least(arch, NVIDIAArchitecture.AMPERE),
        fp16=at_least(arch, NVIDIAArchitecture.VOLTA),
    )
