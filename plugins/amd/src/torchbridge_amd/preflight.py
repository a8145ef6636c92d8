"""Checks made before any kernel runs: does this torch build carry code for the GPU's
architecture, and will SDPA's flash attention (AOTriton) run on it.

A ROCm build of torch holds GPU code only for the architectures it was compiled for
(`torch.cuda.get_arch_list()`, set by PYTORCH_ROCM_ARCH at build time). On any other GPU,
discovery, device properties and allocation all work, and the first kernel fails with "HIP
error: invalid device function". Consumer Radeon parts are commonly run on a build for a
sibling architecture with HSA_OVERRIDE_GFX_VERSION (the runtime then reports the sibling's
gfx version; ollama's and others' documented workaround: 10.3.0 for RDNA2, 11.0.0 for
RDNA3). Pure functions: the plugin feeds them what the probe seam found.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torchbridge_amd.architecture import ARCHITECTURES, AMDFamily, arch_name

# LLVM's generic targets and the processors their code objects run on (LLVM AMDGPUUsage,
# "AMDGPU Generic Processors"); ROCm builds may list e.g. "gfx11-generic" in their arch list.
GENERIC_TARGETS = {
    "gfx9-generic": {"gfx900", "gfx902", "gfx904", "gfx906", "gfx909", "gfx90c"},
    "gfx9-4-generic": {"gfx940", "gfx941", "gfx942", "gfx950"},
    "gfx10-1-generic": {"gfx1010", "gfx1011", "gfx1012", "gfx1013"},
    "gfx10-3-generic": {f"gfx103{i}" for i in range(7)},
    "gfx11-generic": {"gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151",
                      "gfx1152", "gfx1153"},
    "gfx12-generic": {"gfx1200", "gfx1201"},
}
# Which built architectures can stand in for a consumer part under HSA_OVERRIDE_GFX_VERSION:
# same ISA generation, closest family first.
_STAND_INS = {
    AMDFamily.RDNA2: ("gfx1030",),
    AMDFamily.RDNA3: ("gfx1100", "gfx1101", "gfx1102"),
    AMDFamily.RDNA3_5: ("gfx1151", "gfx1150", "gfx1100"),
    AMDFamily.RDNA4: ("gfx1201", "gfx1200"),
}

# SDPA flash attention on ROCm is AOTriton's; torch 2.13's own test gates list where it runs
# (torch/testing/_internal/common_cuda.py, evaluate_platform_supports_flash_attention), and
# aten/src/ATen/native/transformers/cuda/sdp_utils.cpp refuses an arch AOTriton marks
# experimental unless TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL is set (read once per process,
# at the first attention call).
FLASH_SUPPORTED = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1201")
FLASH_EXPERIMENTAL = ("gfx1101", "gfx1102", "gfx1150", "gfx1151", "gfx1200")
EXPERIMENTAL_SWITCH = "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL"


def hsa_override_value(arch: str) -> str:
    """The HSA_OVERRIDE_GFX_VERSION spelling of an architecture: major.minor.stepping, the
    last two hex digits of the name read as numbers ("gfx1100" -> "11.0.0", "gfx1030" ->
    "10.3.0", "gfx90a" -> "9.0.10")."""
    digits = arch.removeprefix("gfx")
    return f"{int(digits[:-2])}.{int(digits[-2], 16)}.{int(digits[-1], 16)}"


# The target features that decide whether a code object loads (LLVM AMDGPUUsage, "Target
# Features"): one built with a setting ("gfx942:xnack-") loads only on a GPU running with
# that setting (XNACK follows HSA_XNACK per process; SRAMECC is the GPU's ECC mode), one
# built without it ("any": official wheels' "gfx942") on either.
LOAD_FEATURES = ("sramecc", "xnack")


def target_features(target: str) -> dict[str, str]:
    """"gfx942:sramecc+:xnack-" -> {"sramecc": "+", "xnack": "-"}: the settings stated."""
    stated = (part.strip() for part in target.split(":")[1:])
    return {p[:-1]: p[-1] for p in stated if p[:-1] in LOAD_FEATURES and p[-1:] in ("+", "-")}


def _for_arch(arch: str, entry: str) -> bool:
    name = arch_name(entry)
    return name == arch or arch in GENERIC_TARGETS.get(name, ())


def _loads(entry: str, device: dict[str, str]) -> bool:
    # A setting the device does not state is not held against the entry.
    return all(device.get(f, v) == v for f, v in target_features(entry).items())


def build_covers(gcn_arch_name: str, build_archs: tuple[str, ...]) -> bool:
    """Whether a build entry for the GPU's architecture (or a generic target covering it)
    loads with the GPU's xnack and sramecc settings; a bare name is the architecture."""
    arch, device = arch_name(gcn_arch_name), target_features(gcn_arch_name)
    return any(_for_arch(arch, e) and _loads(e, device) for e in build_archs)


def _switch_on(env: Mapping[str, str]) -> bool:
    # c10::utils::check_env accepts these spellings as true.
    return env.get(EXPERIMENTAL_SWITCH, "").strip().upper() in ("1", "ON", "YES", "TRUE", "Y")


@dataclass(frozen=True)
class Preflight:
    """What was found for one GPU. `warnings` are for the user before anything runs."""

    architecture: str
    build_archs: tuple[str, ...]
    kernels_available: bool | None  # None: the build lists no architectures to check against
    hsa_override: str | None  # the value to suggest, for a consumer part this build lacks
    flash_attention: str  # "available", "experimental", "experimental (enabled)",
    #                       "unsupported", "not built"
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {"architecture": self.architecture, "build_archs": list(self.build_archs),
                "kernels_available": self.kernels_available,
                "hsa_override": self.hsa_override, "flash_attention": self.flash_attention,
                "warnings": list(self.warnings)}


def _feature_message(device: str, gcn_arch_name: str, arch: str, entries: list[str],
                     hip: str | None) -> str:
    """The warning for a build whose code for `arch` is all for other xnack/sramecc settings."""
    stated = target_features(gcn_arch_name)
    differ = sorted({f for e in entries for f, v in target_features(e).items()
                     if stated.get(f, v) != v})
    fix = f"install a torch build for {arch} with no {'/'.join(differ)} setting (official " \
          "wheels state none)"
    if "xnack" in differ:  # XNACK is a per-process switch; SRAMECC is not
        fix = f"start Python with HSA_XNACK={0 if stated['xnack'] == '+' else 1}, or {fix}"
    return (f"{device} is {gcn_arch_name}, and this torch build (HIP {hip or '?'}) has {arch} "
            f"code only for {', '.join(entries)}, which does not load with this GPU's "
            f"{'/'.join(differ)} setting: every kernel will fail with 'HIP error: invalid "
            f"device function'. To run, {fix}")


def _kernel_check(device: str, gcn_arch_name: str, build_archs: tuple[str, ...],
                  hip: str | None) -> tuple[bool | None, str | None, str | None]:
    if not build_archs:
        return None, None, None
    if build_covers(gcn_arch_name, build_archs):
        return True, None, None
    arch = arch_name(gcn_arch_name)
    same_arch = [e for e in build_archs if _for_arch(arch, e)]
    if same_arch:  # built for it, but only for other target-feature settings
        return False, None, _feature_message(device, gcn_arch_name, arch, same_arch, hip)
    built = ", ".join(build_archs)
    message = (f"{device} is {arch}, and this torch build (HIP {hip or '?'}) has GPU code only "
               f"for {built}: every kernel will fail with 'HIP error: invalid device "
               f"function'. Install a torch build that includes {arch} (PYTORCH_ROCM_ARCH="
               f"{arch} when building from source)")
    info = ARCHITECTURES.get(arch)
    if info is None or not info.consumer:
        return False, None, message
    names = {arch_name(a) for a in build_archs}
    stand_in = next((a for a in _STAND_INS.get(info.family, ()) if a in names), None)
    if stand_in is None:
        return False, None, (message + f"; HSA_OVERRIDE_GFX_VERSION cannot help here: the "
                                       f"build has no {info.family.value.upper()} "
                                       "architecture to stand in")
    value = hsa_override_value(stand_in)
    return False, value, (message + f", or set HSA_OVERRIDE_GFX_VERSION={value} before "
                                    f"starting Python to run the build's {stand_in} code on "
                                    "it (unofficial; usually works within a family)")


def _flash_check(device: str, arch: str, flash_built: bool, env: Mapping[str, str]
                 ) -> tuple[str, str | None]:
    if not flash_built:
        return "not built", None  # nothing the user can switch on; SDPA uses its other kernels
    if arch in FLASH_SUPPORTED:
        return "available", None
    if arch in FLASH_EXPERIMENTAL:
        if _switch_on(env):
            return "experimental (enabled)", None
        return "experimental", (
            f"{device}: SDPA's flash attention (AOTriton) is experimental on {arch} "
            f"and off; set {EXPERIMENTAL_SWITCH}=1 before the first attention call to use it "
            "(otherwise attention runs the unfused math kernel, O(sequence^2) memory)")
    return "unsupported", None


def run_preflight(device: str, gcn_arch_name: str, build_archs: tuple[str, ...],
                  hip_version: str | None, flash_built: bool, env: Mapping[str, str]
                  ) -> Preflight:
    arch = arch_name(gcn_arch_name)
    kernels, override, kernel_warning = _kernel_check(device, gcn_arch_name, build_archs,
                                                      hip_version)
    flash, flash_warning = _flash_check(device, arch, flash_built, env)
    warnings = [w for w in (kernel_warning, flash_warning) if w]
    return Preflight(arch, tuple(build_archs), kernels, override, flash, warnings)
