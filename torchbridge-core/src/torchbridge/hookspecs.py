"""The plugin contract. Every plugin author reads this module top to bottom.

A plugin is any object or module with functions named after these hooks and decorated with
`torchbridge.hookimpl`. Vendor backends register through the entry-point group
`torchbridge.backends`, anything else (a kernel override, an extra pass) through
`torchbridge.plugins`. The built-in CPU plugin and the core's generic accelerator plugin are
registered `trylast`, so any third-party implementation of the same hook runs before them;
mark yours `tryfirst=True` to run before the vendor plugins too.

Conventions:
- `backend_name` is the backend's short name: "cuda", "rocm", "xpu", "tpu", "cpu", or a
  third party's own. A hook that is not about your backend returns None.
- firstresult hooks: the first non-None result wins and the rest are not called.
- Device-level hooks receive a concrete `torch.device` (index set).
- Hooks must be cheap and side-effect free unless the text says otherwise: discovery creates
  no device context and imports no vendor SDK unless the hardware is indicated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

    from torchbridge.backend import Backend
    from torchbridge.levels import OptimizationLevel
    from torchbridge.optimize.passes import OptimizationPass
    from torchbridge.types import Detection, DeviceInfo, MemoryStats

PROJECT = "torchbridge"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def torchbridge_config_section() -> tuple[str, type[BaseModel]] | None:
    """Contribute a config section: return (section_name, pydantic model class).

    Called once per config load, before any value is read. The section appears as
    `config.hardware.<section_name>`, is filled from every config source like the rest, and
    must have a default for every field. Import your pydantic model inside this hook, not at
    plugin import, so that `import torchbridge` stays cheap. None: no section. All results
    are collected; a plugin that raises here is reported and its section left out.
    """


@hookspec
def torchbridge_detect() -> Detection | list[Detection] | None:
    """Say which of your backends are present: one Detection per backend you provide.

    Called on every discovery (`list_backends`, `get_backend`, `detect_best_backend`); must
    be cheap and create no device context. Report an unavailable backend too, with the
    reason, so users learn why. All results are collected; each implementation is called on
    its own so that one raising is reported and skipped without hiding the others. When two
    plugins report the same backend name the one called first (tryfirst) wins. Wrappers are
    not supported on this hook. None: nothing to report.
    """


@hookspec(firstresult=True)
def torchbridge_device_info(backend_name: str, device: torch.device) -> DeviceInfo | None:
    """Describe `device` of backend `backend_name` (firstresult).

    Called by `Backend.get_device_info(index)`. The core answers for any torch accelerator
    from `torch.get_device_module(device.type).get_device_properties`; a vendor plugin adds
    its architecture table and precision policy by answering first. None: not yours.
    """


@hookspec(firstresult=True)
def torchbridge_memory_stats(backend_name: str, device: torch.device) -> MemoryStats | None:
    """Memory of `device` in bytes (firstresult).

    The core answers for any torch accelerator through the device module's allocator
    counters and `mem_get_info`. A figure you cannot know is None, never 0, with `notes`
    saying why. None: not yours.
    """


@hookspec(firstresult=True)
def torchbridge_empty_cache(backend_name: str, device: torch.device) -> bool | None:
    """Release cached, unused memory of `device` (firstresult). True: done. None: not yours."""


@hookspec(firstresult=True)
def torchbridge_reset_peak_memory_stats(backend_name: str, device: torch.device) -> bool | None:
    """Reset the peak-allocated counter of `device` (firstresult). True: done. None: not yours."""


@hookspec(firstresult=True)
def torchbridge_synchronize(backend_name: str, device: torch.device) -> bool | None:
    """Block until all queued work on `device` is finished (firstresult).

    True: done. None: not yours. The core handles every torch accelerator.
    """


@hookspec
def torchbridge_optimization_passes(
    backend: Backend, level: OptimizationLevel
) -> list[OptimizationPass] | None:
    """Contribute optimization passes for `backend` at `level` (all results collected).

    Called by `Backend.prepare_model` / `Backend.optimize`. Return every pass you offer for
    this backend whatever the level; each pass's `min_level` and precondition decide whether
    it runs, and the report says why it did not. A pass with the same name as one returned
    by a plugin called later replaces it: that is how a tryfirst plugin overrides a built-in
    pass. To veto a pass, return `OptimizationPass.veto(name, reason)`: a veto from any
    plugin wins, whatever the order. None: nothing.
    """


@hookspec(firstresult=True)
def torchbridge_kernel(op: str, backend_name: str) -> Callable[..., Any] | None:
    """The implementation of op `op` on backend `backend_name` (firstresult).

    Called by `get_kernel(op, backend)`. The core ships a reference implementation of each
    op it names (torchbridge.kernels.OPS); a `tryfirst=True` implementation overrides it.
    The returned callable must take the same arguments as the reference. None: not yours.
    """


@hookspec(firstresult=True)
def torchbridge_distributed_backend(backend_name: str, device: torch.device) -> str | None:
    """The torch.distributed backend for `device`, e.g. "nccl", "gloo", "xccl" (firstresult).

    None: not yours.
    """
