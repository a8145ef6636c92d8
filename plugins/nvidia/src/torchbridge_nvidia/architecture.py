"""NVIDIA architectures by compute capability, and the precision policy that follows.

The table holds only capabilities NVIDIA has published; anything else is reported as
unknown rather than guessed from the nearest number. Sources, named per entry below:
- the capability of each product: NVIDIA's "CUDA GPUs - Compute Capability" list and the
  CUDA C++ Programming Guide, "Compute Capabilities";
- what the tensor cores of each architecture compute: NVIDIA's architecture whitepapers
  (Volta, Turing, A100 "Ampere", Ada Lovelace, H100 "Hopper", Blackwell) and, for FP8, the
  gate torch's own FP8 matmul applies (`_scaled_mm_allowed_device` in
  aten/src/ATen/native/cuda/ScaledBlas.cpp, Blas.cpp before torch 2.9: major >= 9 or 8.9).
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


# Source of every entry: NVIDIA "CUDA GPUs - Compute Capability" list (products per
# capability) and CUDA C++ Programming Guide, "Compute Capabilities" (architecture names).
_BY_CAPABILITY = {
    (7, 0): NVIDIAArchitecture.VOLTA,      # V100 (Volta whitepaper)
    (7, 2): NVIDIAArchitecture.VOLTA,      # Jetson AGX Xavier (Jetson Xavier module spec)
    (7, 5): NVIDIAArchitecture.TURING,     # T4, RTX 20xx (Turing whitepaper)
    (8, 0): NVIDIAArchitecture.AMPERE,     # A100 (A100 Tensor Core GPU Architecture)
    (8, 6): NVIDIAArchitecture.AMPERE,     # A10, RTX 30xx (GA102 whitepaper)
    (8, 7): NVIDIAArchitecture.AMPERE,     # Jetson AGX Orin (Jetson Orin module spec)
    (8, 9): NVIDIAArchitecture.ADA,        # L4, L40S, RTX 40xx (Ada Lovelace whitepaper)
    (9, 0): NVIDIAArchitecture.HOPPER,     # H100, H200 (H100 Tensor Core GPU Architecture)
    (10, 0): NVIDIAArchitecture.BLACKWELL,  # B200 (Blackwell architecture technical brief)
    # Jetson Thor, one GPU under two numbers: sm_101 up to CUDA 12.9, renamed sm_110 from
    # CUDA 13.0 (CUTLASS 4.2 changelog; NVIDIA MathDx release notes). Blackwell tensor cores
    # of sm_100's kind (tcgen05), so FP8, BF16 and FP16 as below; torch._scaled_mm's gate
    # (major >= 9) accepts both numbers.
    (10, 1): NVIDIAArchitecture.BLACKWELL,
    (11, 0): NVIDIAArchitecture.BLACKWELL,
    (10, 3): NVIDIAArchitecture.BLACKWELL,  # B300 (Blackwell Ultra; CUDA 12.9 sm_103)
    (12, 0): NVIDIAArchitecture.BLACKWELL,  # RTX 50xx (RTX Blackwell GPU architecture)
    (12, 1): NVIDIAArchitecture.BLACKWELL,  # GB10 / DGX Spark (CUDA 12.9 sm_121)
}
# Order of the known architectures, for "Ampere and newer" rules.
_RANK = {arch: rank for rank, arch in enumerate(
    [NVIDIAArchitecture.VOLTA, NVIDIAArchitecture.TURING, NVIDIAArchitecture.AMPERE,
     NVIDIAArchitecture.ADA, NVIDIAArchitecture.HOPPER, NVIDIAArchitecture.BLACKWELL])}

# The oldest architecture whose tensor cores compute each format natively.
FP16_SINCE = NVIDIAArchitecture.VOLTA   # first tensor cores (Volta whitepaper)
BF16_SINCE = NVIDIAArchitecture.AMPERE  # bf16 and TF32 (A100 Tensor Core GPU Architecture)
# e4m3/e5m2: Ada's fourth-generation tensor cores (Ada Lovelace whitepaper, "FP8
# Transformer Engine"); torch._scaled_mm accepts 8.9 and 9.0+ (ScaledBlas.cpp).
FP8_SINCE = NVIDIAArchitecture.ADA
FP8_MIN_CAPABILITY = (8, 9)
# The names of the architectures in the table with FP8 (for a kernel's `architectures`).
FP8_ARCHITECTURES = tuple(arch.value for arch, rank in _RANK.items()
                          if rank >= _RANK[FP8_SINCE])


# flash-attn's own requirements (flash-attn README): FlashAttention-3's kernels are built
# for Hopper (sm_90) only, FlashAttention-2's for Ampere (8.0) and newer; it refuses older
# GPUs at the call ("FlashAttention only supports Ampere GPUs or newer").
FLASH_ATTN_3_ARCHITECTURES = (NVIDIAArchitecture.HOPPER.value,)
FLASH_ATTN_3_MIN_CAPABILITY = (9, 0)
FLASH_ATTN_2_MIN_CAPABILITY = (8, 0)


def architecture_of(major: int, minor: int) -> NVIDIAArchitecture:
    return _BY_CAPABILITY.get((major, minor), NVIDIAArchitecture.UNKNOWN)


def not_in_table(capability: str | None) -> str:
    """What to say of a GPU the table does not know: a fact about this plugin, not about the
    GPU (which may well have what the table would give a newer architecture)."""
    return f"compute capability {capability or '(none reported)'} is not in the NVIDIA " \
           "plugin's table of architectures"


def at_least(arch: NVIDIAArchitecture, oldest: NVIDIAArchitecture) -> bool:
    """`arch` is `oldest` or newer. An unknown architecture is never assumed to be new."""
    return arch in _RANK and _RANK[arch] >= _RANK[oldest]


@dataclass(frozen=True)
class PrecisionPolicy:
    """What the tensor cores of one architecture compute natively."""

    architecture: NVIDIAArchitecture
    fp8: bool   # e4m3 / e5m2 matmuls (Ada and newer)
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
        fp8=at_least(arch, FP8_SINCE),
        bf16=at_least(arch, BF16_SINCE),
        fp16=at_least(arch, FP16_SINCE),
    )
