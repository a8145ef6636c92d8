"""What each NVIDIA GPU is: properties from the probe seam, architecture from the table."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torchbridge.types import DeviceCount, DeviceInfo

from torchbridge_nvidia import probe
from torchbridge_nvidia.architecture import (
    NVIDIAArchitecture,
    architecture_of,
    not_in_table,
    precision_policy,
)
from torchbridge_nvidia.errors import CUDADeviceError, CUDANotAvailableError

logger = logging.getLogger(__name__)
_GB = 1024**3


def configured_architecture(detected: NVIDIAArchitecture, configured: str | None,
                            capability: str) -> tuple[NVIDIAArchitecture, str | None]:
    """The architecture of a GPU whose table entry is `detected`: a configured one
    (hardware.nvidia.architecture) fills in only when the table does not know the GPU, so
    that DeviceInfo, autocast and the passes give one answer. Returns it and a note when
    the table did not know the GPU or the setting was ignored."""
    if configured in (None, "auto"):
        configured = detected.value
    wanted = NVIDIAArchitecture(configured)  # the config holds the enum: name its value
    if detected is NVIDIAArchitecture.UNKNOWN and wanted is NVIDIAArchitecture.UNKNOWN:
        return detected, (f"{not_in_table(capability)}; no low-precision dtype assumed (set "
                          "hardware.nvidia.architecture if you know it)")
    if wanted is detected:
        return detected, None
    if detected is NVIDIAArchitecture.UNKNOWN:
        return wanted, (f"{not_in_table(capability)}; treated as {wanted.value} "
                        "(hardware.nvidia.architecture)")
    return detected, (f"hardware.nvidia.architecture={wanted.value} ignored: the GPU is "
                      f"{detected.value}")


def describe_device(index: int, backend_name: str = "cuda", section: Any = None) -> DeviceInfo:
    """`section`: config.hardware.nvidia of the backend asking (None: no config)."""
    props = probe.device_properties(index)
    capability = f"{props.major}.{props.minor}"
    detected = architecture_of(props.major, props.minor)
    arch, note = configured_architecture(detected, getattr(section, "architecture", None),
                                         capability)
    if arch is NVIDIAArchitecture.UNKNOWN:
        logger.warning("%s: %s", props.name, note)
    policy = precision_policy(arch)
    free, _ = probe.mem_get_info(index)
    return DeviceInfo(
        name=props.name,
        backend=backend_name,
        memory_total_gb=props.total_memory / _GB,
        memory_available_gb=free / _GB,
        compute_capability=capability,
        supported_dtypes=policy.supported_dtypes,
        vendor="NVIDIA",
        architecture=arch.value,
        preferred_low_precision_dtype=policy.preferred_low_precision_dtype,
        device=f"cuda:{index}",
        extra={"multiprocessor_count": props.multi_processor_count,
               "utilization": probe.gpu_utilization(index, props.pci_bus_id)},
        notes=note,
    )


class CUDADeviceManager:
    """The visible NVIDIA GPUs: count, properties, utilization, current device."""

    def __init__(self) -> None:
        found = probe.probe()
        if not found.available:
            raise CUDANotAvailableError(f"no usable NVIDIA GPU: {found.reason}",
                                        backend="cuda")
        self._count = found.device_count

    @property
    def device_count(self) -> int:
        return DeviceCount(self._count)

    def _check(self, index: int) -> int:
        if not isinstance(index, int) or not 0 <= index < self._count:
            raise CUDADeviceError(f"{self._count} NVIDIA GPU(s) visible; index {index!r} "
                                  "does not exist")
        return index

    def get_device_properties(self, index: int = 0) -> dict[str, Any]:
        props = probe.device_properties(self._check(index))
        return {"name": props.name, "compute_capability": f"{props.major}.{props.minor}",
                "architecture": architecture_of(props.major, props.minor).value,
                "total_memory_gb": props.total_memory / _GB,
                "multiprocessor_count": props.multi_processor_count}

    def get_gpu_utilization(self, index: int = 0) -> dict[str, int | None]:
        """{"gpu_utilization_percent", "memory_utilization_percent"} from NVML; None values
        when nvidia-ml-py is not installed or NVML fails."""
        props = probe.device_properties(self._check(index))
        found = probe.gpu_utilization(index, props.pci_bus_id)
        if found is None:
            return {"gpu_utilization_percent": None, "memory_utilization_percent": None}
        return dict(found)

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(self._check(index))
