"""What each AMD GPU is: properties from the probe seam, architecture from the table, the
preflight checks and amdsmi telemetry."""

from __future__ import annotations

import logging
import os
from typing import Any

from torchbridge.types import DeviceInfo

from torchbridge_amd import probe
from torchbridge_amd.architecture import (
    AMDFamily,
    PrecisionPolicy,
    arch_name,
    family_of,
    precision_policy,
)
from torchbridge_amd.preflight import Preflight, run_preflight

logger = logging.getLogger(__name__)
_GB = 1024**3


def configured_policy(detected: str, configured: str | None, hip_version: str | None = None
                      ) -> tuple[PrecisionPolicy, str | None]:
    """The policy for a GPU whose table architecture is `detected`, with a torch built for
    `hip_version`; a configured architecture (hardware.amd.architecture) fills in only when
    the table does not know it. Returns the policy and a note when the setting was used or
    ignored."""
    if configured in (None, "auto", detected):
        return precision_policy(detected, hip_version), None
    if family_of(detected) is AMDFamily.UNKNOWN:
        return precision_policy(configured, hip_version), (
            f"{detected} is not in this plugin's table; treated as {configured} "
            "(hardware.amd.architecture)")
    return precision_policy(detected, hip_version), (
        f"hardware.amd.architecture={configured} ignored: the GPU is {detected}")


def preflight_for(index: int, props: probe.ROCmProperties | None = None) -> Preflight:
    props = props or probe.device_properties(index)
    return run_preflight(f"{props.name} (rocm:{index})", props.gcn_arch_name,
                         probe.build_arch_list(), probe.hip_version(),
                         probe.flash_attention_built(), os.environ)


def telemetry(index: int, pci_bus_id: str | None) -> dict[str, float | None]:
    """amdsmi's figures; None values (never an error) without a working amdsmi."""
    found = probe.gpu_telemetry(index, pci_bus_id)
    return {name: (found or {}).get(name) for name in probe.TELEMETRY_FIELDS}


def describe_device(index: int, backend_name: str = "rocm", section: Any = None) -> DeviceInfo:
    props = probe.device_properties(index)
    detected = arch_name(props.gcn_arch_name)
    if family_of(detected) is AMDFamily.UNKNOWN:
        logger.warning("%s is %s, which this plugin's table does not know; no low-precision "
                       "dtype is assumed (set hardware.amd.architecture if you know it)",
                       props.name, detected)
    configured = getattr(section, "architecture", None)
    policy, arch_note = configured_policy(detected, configured, probe.hip_version())
    check = preflight_for(index, props)
    free, _ = probe.mem_get_info(index)
    notes = [n for n in (arch_note, *policy.withheld, *check.warnings) if n]
    return DeviceInfo(
        name=props.name,
        backend=backend_name,
        memory_total_gb=props.total_memory / _GB,
        memory_available_gb=free / _GB,
        compute_capability=detected,
        supported_dtypes=policy.supported_dtypes,
        vendor="AMD",
        architecture=policy.architecture,
        preferred_low_precision_dtype=policy.preferred_low_precision_dtype,
        device=f"cuda:{index}",
        extra={"gcn_arch_name": props.gcn_arch_name, "family": policy.family.value,
               "compute_units": props.multi_processor_count,
               "fp8_dtype": str(policy.fp8_dtype).removeprefix("torch.")
               if policy.fp8_dtype else None,
               "mx_formats": list(policy.mx_formats), "tf32": policy.tf32,
               "tf32_emulated": policy.tf32_emulated, "tf32_mode": policy.tf32_description,
               "preflight": check.to_dict(),
               "telemetry": telemetry(index, props.pci_bus_id)},
        notes="; ".join(notes) or None,
    )
