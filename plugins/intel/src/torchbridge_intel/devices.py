"""What each Intel GPU is: properties from the probe seam, family from the tables, precision
policy from the capabilities."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torchbridge.types import DeviceCount, DeviceInfo

from torchbridge_intel import probe
from torchbridge_intel.errors import XPUDeviceError, XPUNotAvailableError
from torchbridge_intel.families import DESCRIPTION, TF32_XMX, IntelFamily, identify
from torchbridge_intel.policy import PrecisionPolicy, fp64_refusal, precision_policy

logger = logging.getLogger(__name__)
_GB = 1024**3
# Families whose every part has XMX (device_architecture.def's Xe-HPC, Xe-HPG, Xe2, Xe3).
# Used only to say so when torch reports no XMX on one: torch reads these flags through
# ocloc, and every failure there reads as "absent" (pytorch#196074, an Arc B580).
_XMX_FAMILIES = {IntelFamily.PONTE_VECCHIO, IntelFamily.ALCHEMIST, IntelFamily.BATTLEMAGE,
                 IntelFamily.LUNAR_LAKE, IntelFamily.PANTHER_LAKE}


def device_policy(index: int) -> tuple[probe.XPUProperties, PrecisionPolicy]:
    props = probe.device_properties(index)
    family_tf32 = TF32_XMX.get(identify(props).family)
    return props, precision_policy(props, probe.tf32_supported(index), family_tf32)


def _configured_dtype(policy: PrecisionPolicy, precision: str, name: str,
                      notes: list[str]) -> str | None:
    """The dtype O2+ computes in, after config.hardware.intel.precision."""
    if precision == "float32":
        return None
    if precision == "auto":
        return policy.preferred_low_precision_dtype
    if precision in policy.supported_dtypes:
        return precision
    fallback = policy.preferred_low_precision_dtype
    notes.append(f"hardware.intel.precision={precision}, but {name} does not compute in "
                 f"{precision}; using {fallback or 'float32'}")
    return fallback


def describe_device(index: int, backend_name: str = "xpu", section: Any = None) -> DeviceInfo:
    props, policy = device_policy(index)
    found = identify(props)
    notes: list[str] = []
    if found.family is IntelFamily.UNKNOWN:
        notes.append(f"{props.name} is not in this plugin's family tables (architecture "
                     f"{props.architecture}, device id {props.device_id}); described by its "
                     "reported capabilities only")
    if found.family in _XMX_FAMILIES and props.has_subgroup_matrix_multiply_accumulate is False:
        notes.append(f"torch reports no XMX on this {DESCRIPTION[found.family]} part, whose "
                     "family has it; torch reads these flags through ocloc and reports "
                     "'absent' when it cannot ask (pytorch#196074). bf16 is not assumed")
    if policy.fp64 is False:
        notes.append(fp64_refusal(props.name))
    precision = getattr(section, "precision", "auto")
    preferred = _configured_dtype(policy, precision, props.name, notes)
    free_total = probe.mem_get_info(index)
    total = props.total_memory if props.total_memory is not None else \
        (free_total[1] if free_total else None)
    xccl, xccl_reason = probe.xccl_status()
    ipex = probe.ipex_status()
    return DeviceInfo(
        name=props.name,
        backend=backend_name,
        memory_total_gb=total / _GB if total is not None else None,
        memory_available_gb=free_total[0] / _GB if free_total else None,
        compute_capability=found.ip_version,
        supported_dtypes=policy.supported_dtypes,
        vendor="Intel",
        architecture=found.family.value,
        preferred_low_precision_dtype=preferred,
        device=f"xpu:{index}",
        extra={
            "family": DESCRIPTION[found.family], "identified_by": found.source,
            "ip_version": found.ip_version, "architecture_id": props.architecture,
            "device_id": props.device_id, "driver_version": props.driver_version,
            "integrated": props.is_integrated_gpu, "eu_count": props.gpu_eu_count,
            "compute_units": props.max_compute_units,
            "subslice_count": props.gpu_subslice_count,
            "xmx": policy.xmx, "bf16_conversions": policy.bf16_conversions,
            "fp16": policy.fp16, "fp64": policy.fp64, "tf32": policy.tf32,
            "policy_low_precision_dtype": policy.preferred_low_precision_dtype,
            "distributed_backend": "xccl" if xccl else None,
            "distributed_backend_reason": xccl_reason,
            "ipex": ipex.version, "ipex_reason": ipex.reason,
        },
        notes="; ".join(notes) or None,
    )


class XPUDeviceManager:
    """The visible Intel GPUs: count, properties, telemetry, current device."""

    def __init__(self) -> None:
        found = probe.probe()
        if not found.available:
            raise XPUNotAvailableError(f"no usable Intel GPU: {found.reason}", backend="xpu")
        self._count = found.device_count

    @property
    def device_count(self) -> int:
        return DeviceCount(self._count)

    def _check(self, index: int) -> int:
        if not isinstance(index, int) or not 0 <= index < self._count:
            raise XPUDeviceError(f"{self._count} Intel GPU(s) visible; index {index!r} "
                                 "does not exist")
        return index

    def get_device_properties(self, index: int = 0) -> dict[str, Any]:
        props = probe.device_properties(self._check(index))
        found = identify(props)
        return {"name": props.name, "family": found.family.value,
                "ip_version": found.ip_version, "device_id": props.device_id,
                "total_memory_gb": props.total_memory / _GB if props.total_memory else None,
                "eu_count": props.gpu_eu_count, "compute_units": props.max_compute_units,
                "integrated": props.is_integrated_gpu, "has_fp16": props.has_fp16,
                "has_fp64": props.has_fp64,
                "has_bfloat16_conversions": props.has_bfloat16_conversions,
                "xmx": props.has_subgroup_matrix_multiply_accumulate,
                "driver_version": props.driver_version}

    def get_telemetry(self, index: int = 0) -> dict[str, float | None]:
        """{"utilization_percent", "power_watts", "temperature_c",
        "memory_bandwidth_percent"}: None for each this torch or driver cannot tell.
        Utilization, power and bandwidth each sample for 100 ms."""
        return probe.telemetry(self._check(index))

    get_gpu_utilization = get_telemetry  # the NVIDIA manager's name for the same question

    def set_device(self, index: int) -> None:
        torch.xpu.set_device(self._check(index))
