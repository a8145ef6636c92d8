"""The kernel registry: named ops, a reference implementation of each, plugin overrides.

`torchbridge.get_kernel(op, backend)` asks the `torchbridge_kernel` hook; the core answers
last with the reference below, so any plugin's implementation (tryfirst to beat a vendor
plugin) wins.
`config.kernel.enabled = False` or listing the op in `config.kernel.disabled_ops` forces the
reference, which is how to rule a custom kernel out when hunting a numerical problem.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from torchbridge.errors import KernelError
from torchbridge.plugins import get_plugin_host

if TYPE_CHECKING:
    from torchbridge.backend import Backend


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
             ) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, computed in float32."""
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating: silu(gate) * up."""
    return F.silu(gate) * up


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal)


REFERENCE_KERNELS: dict[str, Callable[..., Any]] = {
    "rms_norm": rms_norm,
    "silu_mul": silu_mul,
    "scaled_dot_product_attention": scaled_dot_product_attention,
}
OPS = tuple(REFERENCE_KERNELS)


def kernel_problem(kernel: object) -> str | None:
    return None if callable(kernel) else f"returned {kernel!r}, which is not callable"


def kernel_answer(op: str, backend: Backend) -> tuple[str | None, Callable[..., Any]]:
    """(plugin, implementation) of `op` on `backend`: the first plugin answer (tryfirst
    plugins before vendor plugins before the core's reference), or (None, the reference)
    when config turns custom kernels off. A plugin that raises or answers with something
    not callable is reported and skipped."""
    if op not in REFERENCE_KERNELS:
        raise KernelError(f"unknown op {op!r}; known ops: {', '.join(OPS)}")
    kernel_config = backend.config.kernel
    if not kernel_config.enabled or op in kernel_config.disabled_ops:
        return None, REFERENCE_KERNELS[op]
    host = get_plugin_host()
    for plugin, kernel in host.call_each("torchbridge_kernel", check=kernel_problem, op=op,
                                         backend_name=backend.name, backend=backend):
        return plugin, kernel
    return None, REFERENCE_KERNELS[op]


def resolve_kernel(op: str, backend: Backend) -> Callable[..., Any]:
    """The implementation of `op` on `backend` (see kernel_answer)."""
    return kernel_answer(op, backend)[1]
