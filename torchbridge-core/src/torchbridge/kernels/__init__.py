"""Custom kernels: ops, their implementations, and which one runs where.

- `ops`: the ops as `torch.library` custom ops (`torch.ops.torchbridge.*`), each with a
  reference in plain torch, a fake and autograd; plugins declare more (`torchbridge_ops`).
- `implementations`: what an implementation declares (`KernelImplementation`) and the op
  that wraps an opaque one for torch.compile.
- `choice`: which implementation is chosen on a backend, and why each other is not.
- `substitution` (in `torchbridge.optimize`): the O3 pass that swaps modules for ones
  calling the chosen implementations, after checking their numbers.
- `compute`: the PyDotCompute kernel API of every Backend (compile_kernel, launch_kernel).

`torchbridge.get_kernel(op, backend)` returns the chosen implementation as a callable,
checked: its first eager call with each new argument signature (tensors' dtypes and
shapes, other arguments' values; up to MAX_CHECKED_SIGNATURES) also runs the reference on
the same arguments, and must match it in kind (dtype, shape) and values (the dtype's
tolerance), leaving its arguments unchanged and returning none of them; an implementation
that fails is dropped for good (reported as its plugin's error) and the reference runs.
`get_kernel(...).unchecked()` (or `unchecked_kernel`) skips the check.
`config.kernel.enabled = False` or listing the op in `config.kernel.disabled_ops` forces
the reference, which is how to rule a custom kernel out when hunting a numerical problem.

The core's ops are registered when this package's `ops` module is first imported; the ops
plugins declare (`torchbridge_ops`) by `register_plugin_ops()`, which `get_kernel`,
`known_ops`, doctor's and `torchbridge kernels`' table and the O3 kernel pass call.
`overridden_ops()` names registrations that code changed behind TorchBridge's back with
torch.library (doctor shows them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchbridge.backend import Backend
    from torchbridge.kernels.implementations import BoundKernel

# The ops of the first contract, kept for code that imported them.
OPS = ("rms_norm", "silu_mul", "scaled_dot_product_attention")


def reference(op: str) -> Any:
    """The reference implementation of `op` (plain torch)."""
    import torchbridge.kernels.ops as ops_module
    from torchbridge.errors import KernelError
    from torchbridge.kernels.choice import known_ops

    known_ops()  # registers the ops plugins declare
    definition = ops_module.definition(op)
    if definition is None:
        raise KernelError(f"unknown op {op!r}; known ops: {', '.join(known_ops())}")
    return definition.reference


def kernel_answer(op: str, backend: Backend) -> tuple[str | None, BoundKernel]:
    """(plugin, callable) of `op` on `backend`: the chosen implementation's provider, or
    (None, the reference) when none is eligible (see choice.choose)."""
    from torchbridge.kernels.choice import choose

    bound = choose(op, backend).bound()
    return bound.provider, bound


def resolve_kernel(op: str, backend: Backend) -> BoundKernel:
    """The implementation of `op` on `backend` (see kernel_answer), checked against the
    reference on first use (see BoundKernel)."""
    bound = kernel_answer(op, backend)[1]
    bound.checked = True
    return bound


def unchecked_kernel(op: str, backend: Backend) -> BoundKernel:
    """The implementation of `op` on `backend` without the first-use check."""
    return kernel_answer(op, backend)[1]


def register_plugin_ops() -> tuple[str, ...]:
    """Register the ops every loaded plugin declares (`torchbridge_ops`) as
    `torch.ops.torchbridge.<name>`; returns every op's name. Once per plugin set (cached on
    the plugin host's generation); a declaration that cannot be registered (a taken or
    invalid name) is its plugin's error. Must not be called while plugins are loading."""
    from torchbridge.kernels.choice import known_ops

    return known_ops()


def overridden_ops() -> list[tuple[str, str]]:
    """(op, what) for each registration of a TorchBridge op that code changed directly
    with torch.library after TorchBridge registered it (see ops.overridden_ops)."""
    import torchbridge.kernels.ops as ops_module

    return ops_module.overridden_ops()


def __getattr__(name: str) -> Any:
    if name == "REFERENCE_KERNELS":  # first contract: op -> reference function
        return {op: reference(op) for op in OPS}
    raise AttributeError(f"module 'torchbridge.kernels' has no attribute {name!r}")
