"""Custom kernels: ops, their implementations, and which one runs where.

- `ops`: the ops as `torch.library` custom ops (`torch.ops.torchbridge.*`), each with a
  reference in plain torch, a fake and autograd; plugins declare more (`torchbridge_ops`).
- `implementations`: what an implementation declares (`KernelImplementation`) and the op
  that wraps an opaque one for torch.compile.
- `choice`: which implementation is chosen on a backend, and why each other is not.
- `substitution` (in `torchbridge.optimize`): the O3 pass that swaps modules for ones
  calling the chosen implementations, after checking their numbers.
- `compute`: the PyDotCompute kernel API of every Backend (compile_kernel, launch_kernel).

`torchbridge.get_kernel(op, backend)` returns the chosen implementation as a callable.
`config.kernel.enabled = False` or listing the op in `config.kernel.disabled_ops` forces the
reference, which is how to rule a custom kernel out when hunting a numerical problem.
Modules are imported on first use: `import torchbridge` registers no op.
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
    """The implementation of `op` on `backend` (see kernel_answer)."""
    return kernel_answer(op, backend)[1]


def __getattr__(name: str) -> Any:
    if name == "REFERENCE_KERNELS":  # first contract: op -> reference function
        return {op: reference(op) for op in OPS}
    raise AttributeError(f"module 'torchbridge.kernels' has no attribute {name!r}")
