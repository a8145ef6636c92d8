"""What the core asks torch about device types: is a string one, how many devices of it this
torch sees, and which device module serves it.

`runtime_device_count` is the core's one question to the runtime during discovery; tests
that replay recorded devices at a plugin's probe seam replace it too, so that the core
believes the recorded machine.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from torchbridge.errors import PluginError

logger = logging.getLogger(__name__)

# Device types the core does not serve through a device module: host memory and XLA are
# answered by their own plugins.
_NOT_GENERIC = {"cpu", "xla", "meta"}


def device_module(device: torch.device | str) -> Any | None:
    """`torch.cuda`, `torch.xpu`, ... for an accelerator device; None for cpu, xla, meta and
    types torch has no module for."""
    device_type = device.type if isinstance(device, torch.device) else device
    if device_type in _NOT_GENERIC:
        return None
    try:
        return torch.get_device_module(device_type)
    except (RuntimeError, AttributeError, ValueError):
        return None


def device_type_problem(device_type: object) -> str | None:
    """None when `device_type` names a torch device type; else what is wrong with it."""
    if not isinstance(device_type, str) or not device_type:
        return f"device_type must be a non-empty string, got {device_type!r}"
    try:
        parsed = torch.device(device_type)
    except (RuntimeError, ValueError, TypeError):
        return (f"device_type {device_type!r} is not a torch device type; declare it first "
                "with torchbridge.devices.declare_device_type (renames torch's PrivateUse1)")
    if parsed.type != device_type or parsed.index is not None:
        return f"device_type must be a bare type such as 'cuda', got {device_type!r}"
    return None


def runtime_device_count(device_type: str) -> int | None:
    """How many devices of `device_type` this torch sees; None where torch cannot count them
    (cpu, xla, a declared PrivateUse1 type without a device module)."""
    module = device_module(device_type)
    counter = getattr(module, "device_count", None)
    if counter is None:
        return None
    try:
        return int(counter())
    except Exception:  # a device module that cannot count tells us nothing
        return None


def declare_device_type(name: str) -> None:
    """Make `name` a torch device type by renaming torch's PrivateUse1 backend to it
    (torch.utils.rename_privateuse1_backend), as out-of-tree accelerators (torch_npu, ...)
    do. Idempotent; a name torch already knows is left alone. Only one PrivateUse1 name can
    exist per process: a second, different one is a PluginError."""
    if not isinstance(name, str) or not name.isidentifier():
        raise PluginError(f"device type name must be an identifier, got {name!r}")
    if device_type_problem(name) is None:
        return
    current = torch._C._get_privateuse1_backend_name()
    if current != "privateuseone":
        raise PluginError(f"cannot declare device type {name!r}: torch's PrivateUse1 backend "
                          f"is already named {current!r} in this process")
    from torch.utils.backend_registration import rename_privateuse1_backend

    rename_privateuse1_backend(name)
    logger.info("declared device type %r (torch PrivateUse1)", name)


def pci_bus_id(props: Any) -> str | None:
    """The PCI address ("0000:3b:00.0") of a device from its torch device properties, to
    find the same GPU in a vendor's management library (NVML, amdsmi), whose numbering may
    differ from torch's; None where this torch does not expose it (before 2.6)."""
    location = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
    if None in location:
        return None
    domain, bus, device = location
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"
