"""The probe seam: the only module that asks whether XLA hardware is here and what it is.

`probe()` never imports torch_xla: importing it starts the PJRT runtime. It only looks for
indications (PJRT_DEVICE, TPU environment variables, TPU device files) and whether torch_xla
is installed. `xla_runtime()` imports torch_xla, and is called only once XLA is indicated.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

TPU_ENV = ("TPU_NAME", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID", "TPU_SKIP_MDS_QUERY")
TPU_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")


@dataclass(frozen=True)
class XlaIndication:
    indicated: bool
    pjrt_device: str | None
    evidence: str | None
    torch_xla_installed: bool


def probe() -> XlaIndication:
    pjrt = os.environ.get("PJRT_DEVICE")
    evidence = None
    if pjrt:
        evidence = f"PJRT_DEVICE={pjrt}"
    else:
        env = next((name for name in TPU_ENV if os.environ.get(name)), None)
        files = [path for pattern in TPU_DEVICE_GLOBS for path in glob.glob(pattern)]
        if env:
            evidence = f"{env} is set"
        elif files:
            evidence = f"TPU device files {', '.join(sorted(files)[:3])}"
    installed = importlib.util.find_spec("torch_xla") is not None
    return XlaIndication(evidence is not None, pjrt, evidence, installed)


@dataclass(frozen=True)
class XlaRuntime:
    """What the PJRT runtime of this process reports."""

    device_kind: str  # "TPU", "CPU", "CUDA": the hardware behind the xla device
    device_count: int  # addressable devices of this process
    world_size: int  # torch_xla's: under multiprocessing the global device count, not hosts
    device_attributes: list[dict[str, Any]] = field(default_factory=list)
    pjrt_device_kind: str | None = None  # "TPU v5 lite", "cpu": names the TPU generation
    host_count: int = 1


@functools.lru_cache(maxsize=1)
def xla_runtime() -> XlaRuntime:
    """Start (once) and describe the XLA runtime. Raises whatever torch_xla raises when the
    runtime cannot start; detection reports that as the reason."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    device = torch_xla.device()
    attributes = [dict(a) for a in xr.global_runtime_device_attributes()]
    # PJRT's device attributes (coords, core_on_chip, num_cores, slice_index, name on a
    # TPU) do not hold the device kind; torch_xla reports it on its own.
    pjrt_kind = xm.xla_device_kind(device)
    # Processes over processes per host: xr.world_size() counts devices under torch_xla's
    # multiprocessing (xmp.spawn runs one process per chip on a TPU VM).
    hosts = max(1, xr.process_count() // max(1, xr.local_process_count()))
    return XlaRuntime(xm.xla_device_hw(device), xr.addressable_runtime_device_count(),
                      xr.world_size(), attributes, pjrt_kind, hosts)


def memory_info(device: Any) -> dict[str, int] | None:
    """xm.get_memory_info for `device` as {"used", "limit", "peak"} bytes; None where the
    runtime does not implement allocator stats (XLA:CPU), with the error logged by callers."""
    import torch_xla.core.xla_model as xm

    info = xm.get_memory_info(device)
    if "bytes_limit" in info:  # torch_xla >= 2.5
        return {"used": int(info["bytes_used"]), "limit": int(info["bytes_limit"]),
                "peak": int(info.get("peak_bytes_used", info["bytes_used"]))}
    total, free = int(info["kb_total"]) * 1024, int(info["kb_free"]) * 1024  # older releases
    return {"used": total - free, "limit": total, "peak": total - free}
