"""The probe seam: the only module that asks the XPU runtime (and the installed packages
around it) anything. Tests replace these functions with recorded properties of real devices.

torch has `torch.xpu` built in (2.5+); intel-extension-for-pytorch is never needed to detect
or describe a device. `probe()` only counts devices; the other functions run once an xpu
backend is in use.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torchbridge.types import ProbeResult

logger = logging.getLogger(__name__)


def probe() -> ProbeResult:
    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        return ProbeResult(False, 0, f"torch {torch.__version__} has no torch.xpu")
    if not getattr(torch._C, "_has_xpu", True):
        return ProbeResult(False, 0, f"torch {torch.__version__} is built without XPU support; "
                                     "install an XPU build of torch")
    if not xpu.is_available():
        return ProbeResult(False, 0, "no Intel GPU visible to torch.xpu (no Level Zero driver, "
                                     "or ZE_AFFINITY_MASK hides them)")
    return ProbeResult(True, xpu.device_count(), None)


@dataclass(frozen=True)
class XPUProperties:
    """The fields of torch.xpu.get_device_properties this plugin uses. Which exist depends on
    the torch version (and the SYCL compiler torch was built with), so every field but the
    name is optional: None means "this torch does not report it", never "false".

    Documented fields: https://docs.pytorch.org/docs/main/generated/torch.xpu.get_device_properties.html
    has_fp16/has_fp64/has_atomic64/driver_version/vendor/version: pytorch#121898 (2024);
    `architecture` (an int: the SYCL `ext::oneapi::experimental::architecture` value) only
    when torch was built with SYCL >= 2025.0 (torch/csrc/xpu/Module.cpp, pytorch#138186);
    `is_integrated_gpu`: pytorch#182624 (2026).
    """

    name: str
    total_memory: int | None = None  # bytes
    max_compute_units: int | None = None
    gpu_eu_count: int | None = None
    gpu_subslice_count: int | None = None
    device_id: int | None = None  # PCI device id, e.g. 0x56A0 for an Arc A770
    driver_version: str | None = None
    architecture: int | None = None
    is_integrated_gpu: bool | None = None
    has_fp16: bool | None = None
    has_fp64: bool | None = None
    has_bfloat16_conversions: bool | None = None
    has_subgroup_matrix_multiply_accumulate: bool | None = None  # XMX (DPAS)
    has_subgroup_matrix_multiply_accumulate_tensor_float32: bool | None = None
    sub_group_sizes: tuple[int, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# Names a field had in some torch builds: `has_bf16_conversion` in a 2024 development build
# (intel/intel-xpu-backend-for-triton#1888 prints it); releases name it has_bfloat16_conversions.
_ALIASES = {"has_bfloat16_conversions": ("has_bf16_conversion",)}


def _read(props: Any, name: str) -> Any:
    for candidate in (name, *_ALIASES.get(name, ())):
        value = getattr(props, candidate, None)
        if value is not None:
            return value
    return None


def device_properties(index: int) -> XPUProperties:
    props = torch.xpu.get_device_properties(index)
    values: dict[str, Any] = {}
    for name in XPUProperties.__dataclass_fields__:
        if name in ("name", "extra"):
            continue
        value = _read(props, name)
        if name.startswith(("has_", "is_")) and value is not None:
            value = bool(value)
        elif name == "sub_group_sizes" and value is not None:
            value = tuple(int(v) for v in value)
        values[name] = value
    return XPUProperties(name=str(getattr(props, "name", "Intel GPU")), **values)


def tf32_supported(index: int) -> bool | None:
    """torch's own verdict (torch.xpu.is_tf32_supported, which asks the current device);
    None where this torch has no such function."""
    check = getattr(torch.xpu, "is_tf32_supported", None)
    if check is None:
        return None
    with torch.xpu.device(index):
        return bool(check())


def mem_get_info(index: int) -> tuple[int, int] | None:
    """(free, total) bytes as the driver sees them, or None where this torch cannot ask
    (torch.xpu.mem_get_info is missing, or the driver does not report free memory)."""
    func = getattr(torch.xpu, "mem_get_info", None)
    if func is None:
        return None
    try:
        free, total = func(index)
    except RuntimeError as exc:  # e.g. a driver without the free-memory extension
        logger.debug("torch.xpu.mem_get_info(%d) failed: %s", index, exc)
        return None
    return int(free), int(total)


def allocator_counters(index: int) -> tuple[int | None, int | None, int | None]:
    """(allocated, reserved, peak allocated) bytes of this process's caching allocator."""
    def ask(name: str) -> int | None:
        func = getattr(torch.xpu, name, None)
        return int(func(index)) if func is not None else None

    return ask("memory_allocated"), ask("memory_reserved"), ask("max_memory_allocated")


# torch.xpu telemetry (Level Zero Sysman through the pyzes package, torch 2.13): each of
# utilization and power_draw samples for 100 ms; all may need elevated privileges.
TELEMETRY = {"utilization_percent": "utilization", "power_watts": "power_draw",
             "temperature_c": "temperature", "memory_bandwidth_percent": "memory_usage"}


def telemetry(index: int) -> dict[str, float | None]:
    """Utilization, power, temperature and memory bandwidth where this torch has them and
    the driver answers; None for each one it cannot tell (never an error)."""
    found: dict[str, float | None] = {}
    for key, name in TELEMETRY.items():
        func = getattr(torch.xpu, name, None)
        if func is None:
            found[key] = None
            continue
        try:
            found[key] = float(func(index))
        except Exception as exc:  # pyzes missing (ImportError), no Sysman access (RuntimeError)
            logger.debug("torch.xpu.%s(%d) unavailable: %s", name, index, exc)
            found[key] = None
    return found


def enable_tf32() -> None:
    """Let float32 matmuls and convolutions on XPU use TF32. They read the oneDNN flag
    (pytorch#137570 for convolutions, #144240 for matmuls), not torch.backends.cuda's."""
    set_tf32(True)


def tf32_enabled() -> bool | None:
    """The oneDNN TF32 flag as torch holds it (None on a torch built without XPU support,
    which ignores the setter with a warning)."""
    value: bool | None = torch.backends.mkldnn.allow_tf32  # type: ignore[assignment]
    return value


def set_tf32(allowed: bool | None) -> None:
    torch.backends.mkldnn.allow_tf32 = allowed  # type: ignore[assignment]  # a ContextProp


def synchronize(index: int) -> None:
    torch.xpu.synchronize(index)


def empty_cache() -> None:
    torch.xpu.empty_cache()


def reset_peak_memory_stats(index: int) -> None:
    torch.xpu.reset_peak_memory_stats(index)


def xccl_status() -> tuple[bool, str]:
    """(available, why): XCCL, torch.distributed's backend for XPU, ships in XPU wheels from
    torch 2.8 (pytorch#141741); `torch.distributed.is_xccl_available` says whether this build
    has it. torch's default_device_backend_map names "xccl" for xpu even when it is not built
    in, so that table alone cannot tell."""
    import torch.distributed as dist

    if not dist.is_available():
        return False, f"torch {torch.__version__} is built without torch.distributed"
    check = getattr(dist, "is_xccl_available", None)
    if check is None:
        return False, (f"torch {torch.__version__} predates the XCCL backend "
                       "(torch.distributed.is_xccl_available appeared with it; XPU wheels "
                       "ship it from torch 2.8)")
    if not check():
        return False, (f"torch {torch.__version__} is built without XCCL "
                       "(torch.distributed.is_xccl_available() is False); install an XPU "
                       "build of torch 2.8 or newer")
    return True, "XCCL is built into this torch"


IPEX_DISTRIBUTIONS = ("intel-extension-for-pytorch", "intel_extension_for_pytorch")


@dataclass(frozen=True)
class IPEXStatus:
    usable: bool
    version: str | None
    reason: str


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def ipex_status() -> IPEXStatus:
    """Whether intel-extension-for-pytorch is installed and built for this torch, read from
    package metadata without importing it: IPEX checks torch's major.minor against its own at
    import and exits the process on a mismatch (`exit(127)` in its __init__), and development
    stopped after 2.8 (intel/intel-extension-for-pytorch#867), so any torch from 2.9 on has
    no matching IPEX."""
    version = None
    for dist_name in IPEX_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(dist_name)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    if version is None:
        return IPEXStatus(False, None, "intel-extension-for-pytorch is not installed (it is "
                                       "optional: torch.xpu needs no IPEX)")
    if _minor(version) != _minor(torch.__version__):
        return IPEXStatus(False, version, f"intel-extension-for-pytorch {version} is built for "
                          f"torch {_minor(version)}, this is torch {torch.__version__}; IPEX "
                          "refuses to load beside another torch minor version (and ended "
                          "with 2.8)")
    return IPEXStatus(True, version, f"intel-extension-for-pytorch {version} matches torch "
                                     f"{torch.__version__}")


def triton_xpu_status() -> tuple[bool, str]:
    """(usable, why): inductor generates Triton kernels for XPU, which needs a Triton with
    Intel's backend (the pytorch-triton-xpu wheel, installed beside XPU builds of torch).
    Triton finds backends as directories triton/backends/<name> (with compiler.py and
    driver.py) or, in newer releases, through "triton.backends" entry points; both are
    looked up here without importing Triton."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return False, ("Triton is not installed; inductor on XPU needs pytorch-triton-xpu "
                       "(installed with the XPU build of torch)")
    for location in spec.submodule_search_locations:
        if os.path.isdir(os.path.join(location, "backends", "intel")):
            return True, "Triton with the Intel XPU backend is installed"
    if any(ep.name == "intel" for ep in importlib.metadata.entry_points(group="triton.backends")):
        return True, "Triton with the Intel XPU backend (entry point) is installed"
    return False, ("the installed Triton has no Intel XPU backend (triton/backends/intel); "
                   "inductor on XPU needs pytorch-triton-xpu")
