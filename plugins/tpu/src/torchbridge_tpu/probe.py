"""The probe seam: the only module that decides whether XLA hardware is indicated.

torch_xla is never imported here: importing it starts the PJRT runtime. We only look for
indications (environment variables, TPU device files) and whether torch_xla is installed.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass

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
