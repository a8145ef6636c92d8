"""The probe seam: the only module that asks the CUDA runtime (and NVML) anything.

Tests replace these functions with recorded properties of real devices. `probe()` creates no
CUDA context: torch.cuda.is_available() and device_count() query the driver only. The other
functions are called once a cuda backend is in use.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torchbridge.devices import pci_bus_id
from torchbridge.types import ProbeResult

logger = logging.getLogger(__name__)


def probe() -> ProbeResult:
    if getattr(torch.version, "hip", None):
        return ProbeResult(False, 0, "this torch is a ROCm build: its GPUs are AMD's "
                                     "(torchbridge-amd), not NVIDIA's")
    if torch.version.cuda is None:
        return ProbeResult(False, 0, f"torch {torch.__version__} is built without CUDA; "
                                     "install a CUDA build of torch")
    if not torch.cuda.is_available():
        return ProbeResult(False, 0, "no NVIDIA GPU visible to CUDA (no driver, or "
                                     "CUDA_VISIBLE_DEVICES hides them)")
    return ProbeResult(True, torch.cuda.device_count(), None)


@dataclass(frozen=True)
class CUDAProperties:
    """The fields of torch.cuda.get_device_properties this plugin uses."""

    name: str
    major: int
    minor: int
    multi_processor_count: int
    total_memory: int  # bytes
    pci_bus_id: str | None = None  # "0000:3b:00.0", to find the same GPU in NVML


def device_properties(index: int) -> CUDAProperties:
    props = torch.cuda.get_device_properties(index)
    return CUDAProperties(props.name, props.major, props.minor, props.multi_processor_count,
                          props.total_memory, pci_bus_id(props))


def mem_get_info(index: int) -> tuple[int, int]:
    """(free, total) bytes as the driver sees them (other processes included)."""
    free, total = torch.cuda.mem_get_info(index)
    return int(free), int(total)


def allocator_counters(index: int) -> tuple[int, int, int]:
    """(allocated, reserved, peak allocated) bytes of this process's caching allocator."""
    return (torch.cuda.memory_allocated(index), torch.cuda.memory_reserved(index),
            torch.cuda.max_memory_allocated(index))


def gpu_utilization(index: int, pci_bus_id: str | None) -> dict[str, int] | None:
    """GPU and memory-controller utilization in percent from NVML (nvidia-ml-py), or None
    when NVML is not installed or fails: utilization is a nicety, never an error."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            # CUDA and NVML may number GPUs differently; the PCI bus id is the same in both.
            handle = (pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id) if pci_bus_id
                      else pynvml.nvmlDeviceGetHandleByIndex(index))
            rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
            return {"gpu_utilization_percent": int(rates.gpu),
                    "memory_utilization_percent": int(rates.memory)}
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVMLError_LibraryNotFound and friends
        logger.debug("NVML utilization unavailable: %s", exc)
        return None
