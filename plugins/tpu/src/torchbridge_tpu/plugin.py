"""Hook implementations of the TPU plugin. Kept cheap to import: the entry point loads it,
and torch_xla is imported only once XLA is indicated (see probe.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torchbridge import hookimpl
from torchbridge.selection import PRIORITY
from torchbridge.types import Detection, DeviceInfo, MemoryStats

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel
    from torchbridge.backend import Backend
    from torchbridge.levels import OptimizationLevel
    from torchbridge.optimize.passes import OptimizationPass

logger = logging.getLogger(__name__)
# XLA on a host CPU (or GPU) is for testing TPU code paths, not for speed: below plain cpu.
XLA_OFF_TPU_PRIORITY = -10


def _mine(backend_name: str, device: torch.device) -> bool:
    return backend_name == "tpu" and device.type == "xla"


@hookimpl
def torchbridge_config_section() -> tuple[str, type[BaseModel]]:
    from torchbridge_tpu.config import TPUConfig

    return "tpu", TPUConfig


@hookimpl
def torchbridge_detect() -> Detection:
    from torchbridge_tpu import probe

    found = probe.probe()
    if not found.indicated:
        reason = ("no TPU indicated (PJRT_DEVICE unset, no TPU_* environment variables, "
                  "no /dev/accel* device files)")
        return Detection("tpu", False, PRIORITY["tpu"], "xla", 0, "Google", reason, ())
    if not found.torch_xla_installed:
        reason = f"{found.evidence}, but torch_xla is not installed (pip install torch-xla)"
        return Detection("tpu", False, PRIORITY["tpu"], "xla", 0, "Google", reason, ())
    try:
        runtime = probe.xla_runtime()
    except Exception as exc:  # the runtime refused to start: say why, stay unavailable
        reason = f"{found.evidence}, but the XLA runtime did not start: " \
                 f"{type(exc).__name__}: {exc}"
        return Detection("tpu", False, PRIORITY["tpu"], "xla", 0, "Google", reason, ())
    if runtime.device_kind == "TPU":
        return Detection("tpu", True, PRIORITY["tpu"], "xla", runtime.device_count, "Google",
                         f"TPU through torch_xla ({found.evidence})", ())
    return Detection("tpu", True, XLA_OFF_TPU_PRIORITY, "xla", runtime.device_count, "Google",
                     f"XLA on {runtime.device_kind} ({found.evidence}): torch_xla's runtime "
                     "and compiler without a TPU; ranked below plain cpu, select it by name", ())


@hookimpl
def torchbridge_device_info(backend_name: str, device: torch.device, backend: Backend
                            ) -> DeviceInfo | None:
    if not _mine(backend_name, device):
        return None
    from torchbridge_tpu.xla import describe_device

    return describe_device(device, backend_name, backend.hardware_config)


@hookimpl
def torchbridge_memory_stats(backend_name: str, device: torch.device) -> MemoryStats | None:
    if not _mine(backend_name, device):
        return None
    from torchbridge_tpu.xla import memory_stats

    return memory_stats(device)


@hookimpl
def torchbridge_empty_cache(backend_name: str, device: torch.device) -> bool | None:
    if not _mine(backend_name, device):
        return None
    from torchbridge_tpu.xla import sync

    # XLA frees a device buffer when its last tensor dies; there is no cache to release.
    # Flushing the pending graph lets buffers of dead intermediate tensors go now.
    sync(wait=True)
    logger.info("empty_cache on XLA: pending work flushed; XLA keeps no cache to release")
    return True


@hookimpl
def torchbridge_reset_peak_memory_stats(backend_name: str, device: torch.device) -> bool | None:
    if not _mine(backend_name, device):
        return None
    from torchbridge.errors import DeviceError

    from torchbridge_tpu.xla import memory_stats

    if memory_stats(device).peak_allocated_bytes is None:
        return True  # no peak counter exists (XLA:CPU): nothing to reset
    raise DeviceError("torch_xla cannot reset the TPU's peak memory counter; compare "
                      "get_memory_stats() before and after instead")


@hookimpl
def torchbridge_synchronize(backend_name: str, device: torch.device) -> bool | None:
    if not _mine(backend_name, device):
        return None
    from torchbridge_tpu.xla import sync

    sync(wait=True)
    return True


@hookimpl
def torchbridge_distributed_backend(backend_name: str, device: torch.device) -> str | None:
    if not _mine(backend_name, device):
        return None
    # torch_xla registers the "xla" process-group backend with torch.distributed when this
    # module is imported; torchbridge.distributed.initialize() needs it registered.
    import torch_xla.distributed.xla_backend  # noqa: F401

    return "xla"


@hookimpl
def torchbridge_optimization_passes(backend: Backend, level: OptimizationLevel
                                    ) -> list[OptimizationPass] | None:
    if backend.name != "tpu":
        return None
    from torchbridge_tpu.passes import tpu_passes

    return tpu_passes(backend)
