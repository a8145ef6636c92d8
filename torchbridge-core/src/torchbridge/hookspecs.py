"""The plugin contract. Every plugin author reads this module top to bottom.

A plugin is a module (or object) with functions named after these hooks and decorated with
`torchbridge.hookimpl`. Register it through an entry point: `torchbridge.backends` for a
plugin that provides a backend, `torchbridge.plugins` for anything else (a kernel override,
an extra pass). A function named `torchbridge_*` without `@hookimpl`, or a decorated one
whose name matches no hook below, is never called; doctor shows it as a warning.

Who answers what:
- The plugin whose `torchbridge_detect` reported a backend owns it: the device-level hooks
  (device_info, memory_stats, empty_cache, reset_peak_memory_stats, synchronize,
  distributed_backend) are asked of the owner only. Another plugin may override one with
  `@hookimpl(tryfirst=True)`; doctor lists such overrides. When the owner returns None the
  core's fallbacks answer, but only those the Detection opted into
  (`Detection(fallbacks=("generic",))` for any torch accelerator, `("cpu",)` for a backend
  whose device type is "cpu", `()` for none); `backend.answered_by`, `DeviceInfo.notes` and
  `MemoryStats.notes` say when a fallback answered.
- Contributions (config sections, passes, kernels, backend_created) are collected from
  every plugin. The built-in plugins (`cpu`, `generic`) are registered trylast, so any
  third-party implementation runs before them; `tryfirst=True` runs before vendor plugins.

Arguments: pluggy passes an implementation only the arguments it names, so name just what
you use. `backend` is the `torchbridge.Backend` being served: `backend.config` is the
config it was created with (`get_backend("x", config=cfg)`), `backend.hardware_config` your
own section of it. Never load the config yourself inside a hook.
Device-level hooks receive a concrete `torch.device` with its index, also for cpu-hosted
backends (`cpu:1` for the second device).

Isolation: a hook that raises (anything but KeyboardInterrupt, SystemExit included) or
returns the wrong type is recorded as your plugin's error, shown by doctor, and skipped;
the host goes on with the next answer. Calling back into torchbridge from a hook is
allowed, except into the step that is calling you (discovery from `torchbridge_detect`, a
config load from `torchbridge_config_section`, plugin loading from your module's import):
that is a PluginError, not a deadlock.

Config sections subclass `torchbridge.ConfigSection` (pydantic: unknown keys rejected,
assignments validated, errors as ConfigurationError with the field path
`hardware.<name>.<field>`). A plain `pydantic.BaseModel` section is given the same rules.

Hooks must be cheap and side-effect free unless the text says otherwise: discovery creates
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
    from torchbridge.kernels.implementations import KernelImplementation
    from torchbridge.kernels.ops import OpDefinition
    from torchbridge.levels import OptimizationLevel
    from torchbridge.optimize.kernel_patterns import ModulePattern
    from torchbridge.optimize.passes import OptimizationPass
    from torchbridge.types import Detection, DeviceInfo, MemoryStats

PROJECT = "torchbridge"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def torchbridge_config_section() -> tuple[str, type[BaseModel]] | None:
    """Contribute a config section: return (section_name, model class).

    Called once per plugin set, before any config value is read. The section appears as
    `config.hardware.<section_name>` and `backend.hardware_config` of your backends, and is
    filled from every config source like the rest. Subclass `torchbridge.ConfigSection`;
    every field needs a default. Import your model inside this hook, not at plugin import,
    so that `import torchbridge` stays cheap (pydantic costs about 150 ms). None: no
    section. A section that is malformed, named like another plugin's (or `cpu`, the
    built-in's), or that cannot be built from its defaults is left out, and your plugin is
    listed with the error.
    """


@hookspec
def torchbridge_detect() -> Detection | list[Detection] | None:
    """Say which of your backends are present: one Detection per backend you provide.

    Called once per process, on first discovery (`list_backends`, `get_backend`,
    `detect_best_backend`; `list_backends(rescan=True)` calls it again); timed and shown by
    doctor. Must be cheap and create no device context. Report an unavailable backend too,
    with the reason, so users learn why. Each Detection is checked: name (lower case),
    available (bool), priority and device_count (int, at least 1 when available),
    device_type (a torch device type, or one declared with
    `torchbridge.devices.declare_device_type`), no more devices than torch sees, fallbacks.
    A malformed one is your plugin's error and that backend is not offered; `cpu` is built
    in and cannot be reported by a plugin. When two plugins report the same backend the
    one called first (tryfirst) wins. Wrappers are not supported. None: nothing to report.
    """


@hookspec(firstresult=True)
def torchbridge_device_info(backend_name: str, device: torch.device, backend: Backend
                            ) -> DeviceInfo | None:
    """Describe `device` of your backend (owner's answer, see the module text).

    Called by `Backend.get_device_info(index)`. Set `DeviceInfo.device` to `str(device)`.
    Set `extra["fp64"] = False` when the device cannot compute in float64: prepare_model
    then refuses float64 models and sample inputs before placing them, in every mode
    (UnsupportedDtypeError). The "generic" fallback answers for any torch accelerator from
    `torch.get_device_module(device.type).get_device_properties`. None: not yours.
    """


@hookspec(firstresult=True)
def torchbridge_memory_stats(backend_name: str, device: torch.device, backend: Backend
                             ) -> MemoryStats | None:
    """Memory of `device` in bytes (owner's answer).

    A figure you cannot know is None, never 0, with `notes` saying why. The "generic"
    fallback answers for any torch accelerator through the device module's allocator
    counters and `mem_get_info`. None: not yours.
    """


@hookspec(firstresult=True)
def torchbridge_empty_cache(backend_name: str, device: torch.device, backend: Backend
                            ) -> bool | None:
    """Release cached, unused memory of `device` (owner's answer). True: done. None: not
    yours."""


@hookspec(firstresult=True)
def torchbridge_reset_peak_memory_stats(backend_name: str, device: torch.device,
                                        backend: Backend) -> bool | None:
    """Reset the peak-allocated counter of `device` (owner's answer). True: done. None: not
    yours."""


@hookspec(firstresult=True)
def torchbridge_synchronize(backend_name: str, device: torch.device, backend: Backend
                            ) -> bool | None:
    """Block until all queued work on `device` is finished (owner's answer).

    True: done. None: not yours. The "generic" fallback handles every torch accelerator.
    """


@hookspec(firstresult=True)
def torchbridge_distributed_backend(backend_name: str, device: torch.device, backend: Backend
                                    ) -> str | None:
    """The torch.distributed backend for `device`, e.g. "nccl", "gloo", "xccl" (owner's
    answer; the "generic" fallback answers from torch's own table). None: not yours.

    `torchbridge.distributed.initialize()` starts the process group with it, so it must be
    registered with torch.distributed when you return it (import the module that registers
    it, or `dist.Backend.register_backend(name, factory, devices=[...])`); where its
    registered devices exclude "cpu", gloo is added for CPU tensors."""


@hookspec
def torchbridge_backend_created(backend: Backend) -> None:
    """A Backend was just created (collected from every plugin; the result is ignored).

    Apply the process-wide settings your config section asks for and nothing else: the
    built-in cpu plugin sets torch's thread count here when `hardware.cpu.num_threads` is
    set. Creating a backend from here is a PluginError. None: always.
    """


@hookspec
def torchbridge_optimization_passes(
    backend: Backend, level: OptimizationLevel
) -> list[OptimizationPass] | None:
    """Contribute optimization passes for `backend` at `level` (all results collected).

    Called by `Backend.prepare_model` / `Backend.optimize`. Return a list of every pass you
    offer for this backend whatever the level; each pass's `min_level` and check decide
    whether it runs, and the report says why it did not. A pass with the same name as one
    returned by a plugin called later replaces it: that is how a tryfirst plugin overrides
    a built-in pass. To veto a pass, return `OptimizationPass.veto(name, reason)`: a veto
    from any plugin wins, whatever the order; a veto naming no pass is reported. Anything
    in the list that is not a well-formed OptimizationPass is reported as your plugin's
    error and left out; the pipeline goes on. None: nothing.

    Called for every backend, not only yours: check `backend.name` before reading
    `backend.hardware_config` (another backend's section, or None). The pipeline does not
    trust a pass's declarations: it compares the model and the watched process-wide
    settings before and after each pass and rolls back a pass that changed what it
    declared it would not (`mutates=False`, `settings`), naming it in the report; a pass
    is reported applied only when its `effect` (or, without one, some change) is observed.
    """


@hookspec(firstresult=True)
def torchbridge_kernel(op: str, backend_name: str, backend: Backend) -> Callable[..., Any] | None:
    """An implementation of op `op` on `backend`: the first contract, kept working.

    Every plugin is asked. A plain callable becomes an implementation for `backend` only,
    inference-only and opaque to torch.compile (wrapped in an op of its own); it takes the
    op's arguments (`torchbridge.kernels.ops.schema(op)`). Returning a
    `KernelImplementation` here works too; new code uses
    `torchbridge_kernel_implementations`. An answer that is not callable is reported and
    skipped. None: not yours.
    """


@hookspec
def torchbridge_kernel_implementations(backend: Backend) -> list[KernelImplementation] | None:
    """Every kernel implementation you offer (all plugins' results collected).

    Return `torchbridge.KernelImplementation`s for any ops (the core's or declared by a
    plugin): each declares its backends, dtypes, backward (trains or not), least compute
    capability or architectures, whether torch.compile can trace it, and may decline a
    call. Selection (`torchbridge.kernels.choice`) picks one per op, use and device;
    prepare_model's `kernel_substitution` pass uses it only after checking its numbers
    against the reference on the model's shapes. Malformed entries are your plugin's error
    and left out. None: nothing.
    """


@hookspec
def torchbridge_ops() -> list[OpDefinition] | None:
    """Declare new ops: `torchbridge.OpDefinition(name, reference, schema)` each (all
    plugins' results collected). Each becomes `torch.ops.torchbridge.<name>` with a fake
    and autograd derived from the reference; implementations then name it as their op. A
    name already defined is your plugin's error. None: nothing."""


@hookspec
def torchbridge_module_patterns(backend: Backend) -> list[ModulePattern] | None:
    """Module patterns for the kernel substitution pass (all plugins' results collected):
    `torchbridge.ModulePattern` recognises a module by structure, names the op it computes,
    and gives the forward that calls the op and a synthetic input to check it on. The core
    ships rms_norm (nn.RMSNorm and Hugging Face-style RMSNorm), SwiGLU MLPs and
    nn.MultiheadAttention. None: nothing."""
