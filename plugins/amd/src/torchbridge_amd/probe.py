"""The probe seam: the only module that asks the ROCm runtime (and amdsmi) anything.

A ROCm build of torch exposes AMD GPUs through torch.cuda with torch.version.hip set. Tests
replace these functions with recorded properties of real devices. `probe()` creates no
device context and imports no amdsmi: without its library `import amdsmi` raises KeyError
(not ImportError), and discovery must stay cheap. The other functions are called once a
rocm backend is in use.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torchbridge.devices import pci_bus_id
from torchbridge.types import ProbeResult

logger = logging.getLogger(__name__)


def probe() -> ProbeResult:
    if not getattr(torch.version, "hip", None):
        return ProbeResult(False, 0, f"torch {torch.__version__} is not a ROCm build "
                                     "(torch.version.hip is None); install a ROCm build of torch")
    if not torch.cuda.is_available():
        return ProbeResult(False, 0, "no AMD GPU visible to HIP (no amdgpu driver, or "
                                     "HIP_VISIBLE_DEVICES hides them)")
    return ProbeResult(True, torch.cuda.device_count(), None)


@dataclass(frozen=True)
class ROCmProperties:
    """The fields of torch.cuda.get_device_properties this plugin uses."""

    name: str
    gcn_arch_name: str  # "gfx942:sramecc+:xnack-"
    multi_processor_count: int  # compute units (HIP counts workgroup processors on RDNA)
    total_memory: int  # bytes
    pci_bus_id: str | None = None  # "0000:c1:00.0", to find the same GPU in amdsmi


def device_properties(index: int) -> ROCmProperties:
    props = torch.cuda.get_device_properties(index)
    return ROCmProperties(props.name, props.gcnArchName, props.multi_processor_count,
                          props.total_memory, pci_bus_id(props))


def build_arch_list() -> tuple[str, ...]:
    """The GPU architectures this torch build carries code for (PYTORCH_ROCM_ARCH)."""
    return tuple(torch.cuda.get_arch_list())


def hip_version() -> str | None:
    return getattr(torch.version, "hip", None)


def flash_attention_built() -> bool:
    """Whether this build was compiled with SDPA's flash attention (AOTriton on ROCm)."""
    return bool(torch.backends.cuda.is_flash_attention_available())


def mem_get_info(index: int) -> tuple[int, int]:
    """(free, total) bytes as the driver sees them (other processes included)."""
    free, total = torch.cuda.mem_get_info(index)
    return int(free), int(total)


def allocator_counters(index: int) -> tuple[int, int, int]:
    """(allocated, reserved, peak allocated) bytes of this process's caching allocator."""
    return (torch.cuda.memory_allocated(index), torch.cuda.memory_reserved(index),
            torch.cuda.max_memory_allocated(index))


TELEMETRY_FIELDS = ("gpu_utilization_percent", "memory_utilization_percent", "power_watts",
                    "temperature_c", "vram_used_bytes", "vram_total_bytes")
_MB = 1024 * 1024


def _number(value: Any) -> float | None:
    """amdsmi answers "N/A" (a string) for what a GPU does not report."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _field(read: Any, *keys: str) -> float | None:
    """The first numeric value among `keys` of the dict `read()` returns; None when amdsmi
    raises (a metric the GPU or a VM guest does not support) or has none."""
    try:
        found = read()
    except Exception as exc:  # AmdSmiLibraryException and friends
        logger.debug("amdsmi: %s", exc)
        return None
    if not isinstance(found, dict):
        return _number(found)
    return next((v for v in (_number(found.get(k)) for k in keys) if v is not None), None)


def _handle(amdsmi: Any, index: int, pci_bus_id: str | None) -> Any:
    handles = amdsmi.amdsmi_get_processor_handles()
    if pci_bus_id:  # HIP and amdsmi may number GPUs differently; the PCI address is the same
        for handle in handles:
            if str(amdsmi.amdsmi_get_gpu_device_bdf(handle)).lower() == pci_bus_id.lower():
                return handle
    return handles[index]


def gpu_telemetry(index: int, pci_bus_id: str | None) -> dict[str, float | None] | None:
    """Utilization, power, temperature and VRAM from amdsmi, or None when amdsmi is not
    installed or does not work. API names from AMD's amdsmi Python reference:
    amdsmi_get_gpu_activity (gfx_activity, umc_activity in %), amdsmi_get_power_info
    (current_socket_power / average_socket_power in W), amdsmi_get_temp_metric (degrees C),
    amdsmi_get_gpu_vram_usage (vram_used, vram_total in MB)."""
    try:
        import amdsmi
    except (ImportError, KeyError) as exc:  # KeyError: the package without its library
        logger.debug("amdsmi unavailable: %r", exc)
        return None
    try:
        amdsmi.amdsmi_init()
    except Exception as exc:
        logger.debug("amdsmi_init failed: %s", exc)
        return None
    try:
        handle = _handle(amdsmi, index, pci_bus_id)
        temps = amdsmi.AmdSmiTemperatureType
        current = amdsmi.AmdSmiTemperatureMetric.CURRENT
        # MI300 reports no edge sensor; the hotspot (junction) sensor is on every part.
        temperature = _field(lambda: amdsmi.amdsmi_get_temp_metric(handle, temps.HOTSPOT,
                                                                    current))
        if temperature is None:
            temperature = _field(lambda: amdsmi.amdsmi_get_temp_metric(handle, temps.EDGE,
                                                                        current))
        used = _field(lambda: amdsmi.amdsmi_get_gpu_vram_usage(handle), "vram_used")
        total = _field(lambda: amdsmi.amdsmi_get_gpu_vram_usage(handle), "vram_total")
        return {
            "gpu_utilization_percent": _field(lambda: amdsmi.amdsmi_get_gpu_activity(handle),
                                              "gfx_activity"),
            "memory_utilization_percent": _field(
                lambda: amdsmi.amdsmi_get_gpu_activity(handle), "umc_activity"),
            "power_watts": _field(lambda: amdsmi.amdsmi_get_power_info(handle),
                                  "current_socket_power", "average_socket_power"),
            "temperature_c": temperature,
            "vram_used_bytes": used * _MB if used is not None else None,
            "vram_total_bytes": total * _MB if total is not None else None,
        }
    except Exception as exc:  # no handle for this GPU, an older amdsmi without a function
        logger.debug("amdsmi telemetry failed: %s", exc)
        return None
    finally:
        try:
            amdsmi.amdsmi_shut_down()
        except Exception as exc:
            logger.debug("amdsmi_shut_down failed: %s", exc)
