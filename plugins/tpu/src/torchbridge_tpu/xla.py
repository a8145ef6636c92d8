"""Device description, memory and synchronization on the XLA device."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torchbridge.types import DeviceInfo, MemoryStats

from torchbridge_tpu import probe
from torchbridge_tpu.generations import GENERATIONS, generation, supported_dtypes, tpu_version
from torchbridge_tpu.topology import check_topology

logger = logging.getLogger(__name__)
_GB = 1024**3
# XLA on a host CPU (or GPU) stands in for a TPU, so it takes the TPU's code paths (bf16
# preferred); it computes float16 as well.
_STAND_IN_DTYPES = ["float32", "bfloat16", "float16"]

__all__ = ["describe_device", "memory_stats", "resolve_version", "sync", "tpu_version"]


def resolve_version(detected: str | None, configured: str | None, on_tpu: bool,
                    device_kind: str) -> tuple[str | None, str | None]:
    """(version to use, note). The device kind decides; config.hardware.tpu.version fills
    in only for a TPU whose kind this plugin's table does not know, and is noted and
    ignored where it contradicts a known TPU or there is no TPU (XLA on the CPU)."""
    if configured in (None, "auto") or configured == detected:
        return detected, None
    if not on_tpu:
        return detected, (f"hardware.tpu.version={configured} ignored: no TPU here "
                          f"(XLA on {device_kind})")
    if detected not in GENERATIONS:
        return configured, (f"{device_kind} is not in this plugin's TPU table; treated as "
                            f"{configured} (hardware.tpu.version)")
    return detected, (f"hardware.tpu.version={configured} ignored: the device is {detected} "
                      f"({device_kind})")


def _setting(section: Any, name: str) -> str | None:
    value = getattr(section, name, None)
    return getattr(value, "value", value)  # the config's enums, or plain strings


def describe_device(device: torch.device, backend_name: str, section: Any = None
                    ) -> DeviceInfo:
    """`section`: config.hardware.tpu (its version and topology are checked against the
    runtime's), or None."""
    runtime = probe.xla_runtime()
    index = device.index or 0
    attributes = runtime.device_attributes[index] if index < len(runtime.device_attributes) \
        else {}
    # A runtime that lists the kind among a device's attributes is read first; torch_xla's
    # PJRT runtimes do not, and report it apart (probe.xla_runtime).
    kind = str(attributes.get("device_kind") or runtime.pjrt_device_kind
               or runtime.device_kind)
    on_tpu = runtime.device_kind == "TPU"
    detected = tpu_version(kind) if on_tpu else None
    version, version_note = resolve_version(detected, _setting(section, "version"), on_tpu,
                                            kind if on_tpu else runtime.device_kind)
    known = generation(version)
    if on_tpu and known is None:
        logger.warning("%s is not in this plugin's TPU table; only float32 and bfloat16 are "
                       "assumed (set hardware.tpu.version if you know the generation)", kind)
    topology, topology_note = check_topology(_setting(section, "topology"), runtime)
    notes = [n for n in (version_note, topology_note) if n]
    for note in notes:
        logger.info("%s", note)
    stats = memory_stats(device)
    return DeviceInfo(
        name=kind if on_tpu else f"XLA:{runtime.device_kind}",
        backend=backend_name,
        memory_total_gb=stats.total_bytes / _GB if stats.total_bytes else None,
        memory_available_gb=stats.free_bytes / _GB if stats.free_bytes is not None else None,
        compute_capability=detected,
        supported_dtypes=supported_dtypes(version) if on_tpu else list(_STAND_IN_DTYPES),
        vendor="Google",
        architecture=(known.version if known else "unknown") if on_tpu
        else f"xla-{runtime.device_kind.lower()}",
        # bf16 is the TPU's native matmul dtype. On XLA:CPU the same policy is kept on
        # purpose: it is the stand-in for a TPU, so it must take the TPU's code paths.
        preferred_low_precision_dtype="bfloat16",
        device=str(device),
        extra={"device_kind": runtime.device_kind,
               "tpu_version": known.version if known else None,
               "generation": known.name if known else None,
               "pjrt_device_kind": runtime.pjrt_device_kind,
               "device_count": runtime.device_count, "world_size": runtime.world_size,
               "host_count": runtime.host_count, "topology": topology,
               "attributes": attributes},
        notes="; ".join(notes) or None,
    )


def memory_stats(device: torch.device) -> MemoryStats:
    try:
        info = probe.memory_info(device)
    except RuntimeError as exc:  # XLA:CPU: "UNIMPLEMENTED: GetAllocatorStats is not supported"
        reason = str(exc).split("\n")[0]
        return MemoryStats(device=str(device), notes="this XLA runtime reports no memory "
                           f"figures ({reason}); they are unknown, not zero")
    if info is None:
        return MemoryStats(device=str(device), notes="this XLA runtime reports no memory")
    return MemoryStats(device=str(device), allocated_bytes=info["used"],
                       peak_allocated_bytes=info["peak"], free_bytes=info["limit"] - info["used"],
                       total_bytes=info["limit"],
                       notes="XLA has no caching allocator: reserved is unknown")


def sync(wait: bool = True) -> None:
    """Cut the lazy graph and run it (torch_xla.sync); with `wait`, block until the device
    has finished."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    if wait:
        xm.wait_device_ops()

