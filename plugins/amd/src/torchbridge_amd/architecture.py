"""AMD GPU architectures by gfx name, and the precision policy that follows.

torch reports the architecture as `torch.cuda.get_device_properties(i).gcnArchName` with the
target features after colons ("gfx942:sramecc+:xnack-" on an MI300X, "gfx1100" on an RX
7900 XTX, as torch prints them); the name is the part before the first colon, which is
also how AOTriton reads it (tritonsrc/rocm_arch.py: "gfx942:sramecc+:xnack-" ->
"gfx942"). Only names AMD has published are in the table; anything else is "unknown" and
no low-precision dtype is assumed.

Sources of the policy (torch 2.13 unless said otherwise):
- FP8: torch's `_scaled_mm` allows gfx942 on ROCm, gfx1200 and gfx1201 when torch was built
  with ROCm 6.3 or newer, gfx950 with ROCm 6.5 or newer, and nothing else: not the
  pre-production gfx940/gfx941, though their CDNA3 matrix cores have the same FP8
  instructions (`_scaled_mm_allowed_device` in aten/src/ATen/native/cuda/ScaledBlas.cpp,
  Blas.cpp before torch 2.9, whose earlier list was gfx940-942). The fnuz formats are
  gfx942's only (`_scaled_mm_is_fnuz`).
- MX formats (MXFP8/MXFP4 block-scaled GEMM): gfx950 with ROCm 7.0 or newer (the hipBLASLt
  scaled GEMM in aten/src/ATen/cuda/CUDABlas.cpp; common_cuda.py
  `evaluate_platform_supports_mx_gemm`).
- The ROCm version those gates compare is the one torch was built with (ROCM_VERSION), read
  here from `torch.version.hip` ("6.4.43482-0f2d60242"): HIP's major.minor is its ROCm
  release's.
- TF32: `torch.cuda.is_tf32_supported()` is true on ROCm for "gfx94" and "gfx95" names only
  (torch/cuda/__init__.py), and hipBLASLt serves it differently on the two: gfx94x (CDNA3)
  has XF32 matrix instructions (AMD CDNA 3 ISA reference guide, V_MFMA_F32_*_XF32);
  gfx950 (CDNA4) has none, and hipBLASLt emulates TF32 there with several bf16 MFMAs
  (ROCm/hipBLASLt pull request 1806, "TF32 Emulation for gfx950").
- BF16 matrix instructions on every CDNA (MI100's CDNA1 included: AMD "AMD matrix cores"
  lab notes, MI100 BF16 512 FLOPs/clock/CU; AMD CDNA architecture whitepaper) and on RDNA3
  and newer (WMMA bf16: AMD RDNA3 and RDNA4 ISA reference guides). RDNA2 has no matrix
  instructions (AMD RDNA2 ISA reference guide). `torch.cuda.is_bf16_supported()` answers
  True for any ROCm GPU, so it is not asked.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import torch


class AMDFamily(str, enum.Enum):
    CDNA1 = "cdna1"
    CDNA2 = "cdna2"
    CDNA3 = "cdna3"
    CDNA4 = "cdna4"
    RDNA2 = "rdna2"
    RDNA3 = "rdna3"
    RDNA3_5 = "rdna3.5"
    RDNA4 = "rdna4"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ArchInfo:
    family: AMDFamily
    products: str
    consumer: bool  # a Radeon (RDNA) part: HSA_OVERRIDE_GFX_VERSION is the known workaround


# gfx names and products: LLVM "AMDGPUUsage" processors table and the ROCm documentation's
# "GPU hardware specifications" / Radeon compatibility tables (noted per entry below).
ARCHITECTURES: dict[str, ArchInfo] = {
    # Instinct: ROCm "GPU hardware specifications" (Instinct table); AMDGPUUsage.
    "gfx908": ArchInfo(AMDFamily.CDNA1, "Instinct MI100", False),
    "gfx90a": ArchInfo(AMDFamily.CDNA2, "Instinct MI210/MI250/MI250X", False),
    # gfx940 and gfx941 were pre-production MI300 parts; shipping MI300A/X and MI325X are gfx942.
    "gfx940": ArchInfo(AMDFamily.CDNA3, "Instinct MI300 (early)", False),
    "gfx941": ArchInfo(AMDFamily.CDNA3, "Instinct MI300 (early)", False),
    "gfx942": ArchInfo(AMDFamily.CDNA3, "Instinct MI300A/MI300X/MI325X", False),
    "gfx950": ArchInfo(AMDFamily.CDNA4, "Instinct MI350X/MI355X", False),
    # Radeon: ROCm "GPU hardware specifications" (Radeon / Radeon PRO tables); AMDGPUUsage.
    "gfx1030": ArchInfo(AMDFamily.RDNA2, "Radeon RX 6800/6900, PRO W6800", True),
    "gfx1031": ArchInfo(AMDFamily.RDNA2, "Radeon RX 6700 XT/6750 XT", True),  # AMDGPUUsage
    "gfx1032": ArchInfo(AMDFamily.RDNA2, "Radeon RX 6600/6650 XT", True),  # AMDGPUUsage
    "gfx1100": ArchInfo(AMDFamily.RDNA3, "Radeon RX 7900 XTX/XT/GRE, PRO W7900", True),
    "gfx1101": ArchInfo(AMDFamily.RDNA3, "Radeon RX 7800 XT/7700 XT, PRO W7700", True),
    "gfx1102": ArchInfo(AMDFamily.RDNA3, "Radeon RX 7600", True),  # ROCm Radeon table
    # APUs: AMDGPUUsage processors table; ROCm "Ryzen APU" compatibility notes.
    "gfx1103": ArchInfo(AMDFamily.RDNA3, "Radeon 780M/760M (Phoenix APU)", True),
    "gfx1150": ArchInfo(AMDFamily.RDNA3_5, "Radeon 890M (Strix Point APU)", True),
    "gfx1151": ArchInfo(AMDFamily.RDNA3_5, "Radeon 8060S (Strix Halo APU)", True),
    # RDNA4: ROCm "GPU hardware specifications" (Radeon table); AMDGPUUsage.
    "gfx1200": ArchInfo(AMDFamily.RDNA4, "Radeon RX 9060 XT", True),
    "gfx1201": ArchInfo(AMDFamily.RDNA4, "Radeon RX 9070 XT/9070, AI PRO R9700", True),
}
# Families with bf16 matrix instructions (sources in the module text).
_BF16 = {AMDFamily.CDNA1, AMDFamily.CDNA2, AMDFamily.CDNA3, AMDFamily.CDNA4,
         AMDFamily.RDNA3, AMDFamily.RDNA3_5, AMDFamily.RDNA4}
# TF32 as torch reports it (torch/cuda/__init__.py is_tf32_supported), and where hipBLASLt
# runs it: XF32 MFMAs on CDNA3 (CDNA 3 ISA), bf16 emulation on gfx950 (hipBLASLt PR 1806).
_TF32_NATIVE = ("gfx940", "gfx941", "gfx942")
_TF32_EMULATED = ("gfx950",)
_FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_OCP = (torch.float8_e4m3fn, torch.float8_e5m2)
# torch 2.13's ROCm gates (module text): the architectures, each with the least ROCm version
# torch must be built with; (0, 0) where torch sets none.
FP8_MIN_ROCM: dict[str, tuple[int, int]] = {"gfx942": (0, 0), "gfx1200": (6, 3),
                                            "gfx1201": (6, 3), "gfx950": (6, 5)}
MX_MIN_ROCM: dict[str, tuple[int, int]] = {"gfx950": (7, 0)}
_MX_FORMATS = ("mxfp8", "mxfp4")


def arch_name(gcn_arch_name: str) -> str:
    """"gfx942:sramecc+:xnack-" -> "gfx942"."""
    return gcn_arch_name.split(":", 1)[0].strip()


def family_of(arch: str) -> AMDFamily:
    info = ARCHITECTURES.get(arch)
    return info.family if info else AMDFamily.UNKNOWN


def rocm_version(hip_version: str | None) -> tuple[int, int] | None:
    """torch.version.hip ("6.4.43482-0f2d60242") as (6, 4); None when not given or not
    readable."""
    found = re.match(r"\s*(\d+)\.(\d+)", hip_version or "")
    return (int(found[1]), int(found[2])) if found else None


def rocm_needed(gate: dict[str, tuple[int, int]], arch: str, hip_version: str | None
                ) -> str | None:
    """"ROCm 6.5" where torch's `gate` allows `arch` only from a newer ROCm than the one
    this torch was built with; None where the version is enough, or not known."""
    need, have = gate.get(arch), rocm_version(hip_version)
    if need is None or have is None or have >= need:
        return None
    return f"ROCm {need[0]}.{need[1]}"


def fp8_dtypes(arch: str, hip_version: str | None = None
               ) -> tuple[torch.dtype, torch.dtype] | None:
    """(e4m3, e5m2) torch's `_scaled_mm` computes in on `arch` with a torch built for
    `hip_version` (torch.version.hip; None: the architecture alone decides), or None."""
    if arch not in FP8_MIN_ROCM or rocm_needed(FP8_MIN_ROCM, arch, hip_version):
        return None
    return _FNUZ if arch == "gfx942" else _OCP  # CDNA 3 ISA: fnuz; CDNA 4 / RDNA4 ISA: OCP


def fp8_refusal(arch: str, hip_version: str | None = None) -> str | None:
    """Why torch's `_scaled_mm` refuses FP8 on `arch` (None: it allows it), naming the ROCm
    version needed where that is the reason."""
    needed = rocm_needed(FP8_MIN_ROCM, arch, hip_version)
    if needed:
        return (f"torch's _scaled_mm allows FP8 on {arch} from {needed}; this torch is built "
                f"with HIP {hip_version}")
    if arch in ("gfx940", "gfx941"):  # FP8 MFMAs, but not in torch's list
        return (f"torch's _scaled_mm refuses FP8 on {arch} (pre-production MI300; it allows "
                "gfx942, gfx950, gfx1200/gfx1201)")
    if arch not in FP8_MIN_ROCM:
        return (f"{arch} has no FP8 matrix cores that torch uses (gfx94x, gfx950, "
                "gfx1200/gfx1201 do)")
    return None


@dataclass(frozen=True)
class PrecisionPolicy:
    """What the matrix cores of one architecture compute natively."""

    architecture: str  # the gfx name, or "unknown"
    family: AMDFamily
    fp16: bool
    bf16: bool
    fp8: tuple[torch.dtype, torch.dtype] | None
    tf32: bool  # torch allows TF32 matmuls here (natively or emulated, see tf32_emulated)
    mx_formats: tuple[str, ...]
    tf32_emulated: bool = False  # hipBLASLt runs TF32 as bf16 MFMAs: no XF32 instructions
    hip_version: str | None = None  # the torch.version.hip the FP8 and MX gates were read for

    @property
    def fp8_refusal(self) -> str | None:
        """Why there is no FP8 here (None: there is)."""
        return None if self.fp8 else fp8_refusal(self.architecture, self.hip_version)

    @property
    def withheld(self) -> list[str]:
        """What torch allows on this architecture only with a newer ROCm than this torch's,
        for notes ("MX formats on gfx950 need ROCm 7.0; this torch is built with HIP 6.4")."""
        return [f"{what} on {self.architecture} need{s} {needed}; this torch is built with "
                f"HIP {self.hip_version}" for what, s, gate in (
                    ("FP8", "s", FP8_MIN_ROCM), ("MX formats", "", MX_MIN_ROCM))
                if (needed := rocm_needed(gate, self.architecture, self.hip_version))]

    @property
    def tf32_description(self) -> str:
        """How float32 matmuls run when TF32 is allowed, for notes and reports."""
        if not self.tf32:
            return f"{self.architecture} has no TF32 (torch reports it on gfx94x and gfx95x only)"
        if self.tf32_emulated:
            return (f"TF32 emulated by hipBLASLt with bf16 matrix instructions "
                    f"({self.architecture} has no XF32 instructions)")
        return f"TF32 (XF32) on the matrix cores of {self.architecture}"

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        """The e4m3 dtype FP8 linears use here."""
        return self.fp8[0] if self.fp8 else None

    @property
    def supported_dtypes(self) -> list[str]:
        dtypes = ["float32"]
        if self.fp16:
            dtypes.append("float16")
        if self.bf16:
            dtypes.append("bfloat16")
        if self.fp8:
            dtypes += [str(d).removeprefix("torch.") for d in self.fp8]
        return dtypes

    @property
    def preferred_low_precision_dtype(self) -> str | None:
        """bf16 where native (float32's range: no loss scaling), else fp16."""
        if self.bf16:
            return "bfloat16"
        return "float16" if self.fp16 else None


def precision_policy(arch: str, hip_version: str | None = None) -> PrecisionPolicy:
    """The policy of `arch` with a torch built for `hip_version` (torch.version.hip): FP8 and
    MX formats only where torch's gates allow them for that ROCm. None: the architecture
    alone decides, as with a ROCm new enough for every gate."""
    family = family_of(arch)
    known = family is not AMDFamily.UNKNOWN
    return PrecisionPolicy(
        architecture=arch if known else "unknown",
        family=family,
        fp16=known,
        bf16=family in _BF16,
        fp8=fp8_dtypes(arch, hip_version),
        tf32=arch in _TF32_NATIVE + _TF32_EMULATED,
        mx_formats=_MX_FORMATS if arch in MX_MIN_ROCM and not rocm_needed(
            MX_MIN_ROCM, arch, hip_version) else (),
        tf32_emulated=arch in _TF32_EMULATED,
        hip_version=hip_version,
    )
