"""The ops: `torch.library` custom ops in the `torchbridge` namespace.

An op is defined by an `OpDefinition`: a name, a reference implementation in plain torch
that runs on any device, and a schema (inferred from the reference's annotations when not
given). From the reference alone the op gets:
- its fake (meta) implementation: the reference itself run on fake tensors, so shapes and
  dtypes follow whatever the reference computes;
- autograd: the vector-Jacobian product of the reference (`torch.func.vjp`), so an op
  trains wherever its reference is differentiable.
`torch.ops.torchbridge.<name>` is the op; `torchbridge.kernels.ops.<name>` the same as a
Python function. Plugins declare more ops through the `torchbridge_ops` hook.

Custom ops live in torch's process-wide registry: an op is registered once per process and
a second definition under the same name is refused (KernelError), never silently replaced.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from torchbridge.errors import KernelError

NAMESPACE = "torchbridge"


@dataclass(frozen=True)
class OpDefinition:
    """An op: `name` (a Python identifier), `reference` (plain torch, any device; it must
    not return an input or a view of one), `schema` ("(Tensor x, float eps=1e-06) ->
    Tensor", the torch.library schema without the name; None: inferred from the
    reference's type annotations), and `description`."""

    name: str
    reference: Callable[..., Any]
    schema: str | None = None
    description: str = ""


def _wide(t: torch.Tensor) -> torch.Tensor:
    """At least float32: half-precision inputs are computed in float32, float64 stays."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
              ) -> torch.Tensor:
    x32 = _wide(x)
    out = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        out = out * _wide(weight)
    return out.to(x.dtype)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                  eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return _rms_norm(summed, weight, eps), summed


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate32 = _wide(gate)
    return (gate32 * torch.sigmoid(gate32) * _wide(up)).to(torch.promote_types(gate.dtype,
                                                                                up.dtype))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Hugging Face's convention (rotate_half); cos and sin broadcast against x.
    x32 = _wide(x)
    return (x32 * _wide(cos) + _rotate_half(x32) * _wide(sin)).to(x.dtype)


def _scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  attn_mask: torch.Tensor | None = None,
                                  is_causal: bool = False, scale: float | None = None,
                                  enable_gqa: bool = False) -> torch.Tensor:
    # No dropout: the op's backward recomputes the forward, which a random mask would not
    # survive. Training with attention dropout keeps the model's own attention.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                          scale=scale, enable_gqa=enable_gqa).clone()


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
    return F.linear(x, weight, bias)


BUILTIN_OPS = (
    OpDefinition("rms_norm", _rms_norm,
                 "(Tensor x, Tensor? weight=None, float eps=1e-06) -> Tensor",
                 "x * rsqrt(mean(x^2, -1) + eps) * weight, in float32, output in x's dtype"),
    OpDefinition("add_rms_norm", _add_rms_norm,
                 "(Tensor x, Tensor residual, Tensor? weight=None, float eps=1e-06) "
                 "-> (Tensor, Tensor)",
                 "(rms_norm(x + residual) * weight, x + residual): the residual add fused"),
    OpDefinition("silu_mul", _silu_mul, "(Tensor gate, Tensor up) -> Tensor",
                 "SwiGLU's gating: silu(gate) * up"),
    OpDefinition("rotary_embedding", _rotary_embedding,
                 "(Tensor x, Tensor cos, Tensor sin) -> Tensor",
                 "x * cos + rotate_half(x) * sin (Hugging Face convention)"),
    OpDefinition("scaled_dot_product_attention", _scaled_dot_product_attention,
                 "(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, bool is_causal=False,"
                 " float? scale=None, bool enable_gqa=False) -> Tensor",
                 "softmax(q k^T * scale + mask) v, without dropout"),
    OpDefinition("linear", _linear, "(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor",
                 "x @ weight^T + bias"),
)


def reference_vjp(reference: Callable[..., Any], inputs: Sequence[Any],
                  grads: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """One gradient (or None) per argument of `reference(*inputs)`: the vector-Jacobian
    product with `grads`, recomputing the forward, for every floating tensor argument."""
    wants = [i for i, a in enumerate(inputs)
             if isinstance(a, torch.Tensor) and a.is_floating_point()]

    def call(*differentiated: torch.Tensor) -> Any:
        args = list(inputs)
        for i, t in zip(wants, differentiated, strict=True):
            args[i] = t
        return reference(*args)

    vjp = torch.func.vjp(call, *(inputs[i] for i in wants))[1]
    grad_inputs = vjp(grads[0] if len(grads) == 1 else tuple(grads))
    out: list[Any] = [None] * len(inputs)
    for i, g in zip(wants, grad_inputs, strict=True):
        out[i] = g
    return tuple(out)


def save_inputs(ctx: Any, inputs: Sequence[Any], *extra: torch.Tensor) -> None:
    """Keep a call's inputs (and `extra` tensors, e.g. outputs) on an autograd ctx."""
    ctx.tensor_positions = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
    ctx.others = [None if isinstance(a, torch.Tensor) else a for a in inputs]
    ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_positions), *extra)


def saved_inputs(ctx: Any) -> tuple[list[Any], tuple[torch.Tensor, ...]]:
    """(inputs, extra tensors) as kept by save_inputs."""
    saved = ctx.saved_tensors
    count = len(ctx.tensor_positions)
    inputs = list(ctx.others)
    for i, t in zip(ctx.tensor_positions, saved[:count], strict=True):
        inputs[i] = t
    return inputs, tuple(saved[count:])


def vjp_autograd(reference: Callable[..., Any]
                 ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(setup_context, backward) computing gradients as the reference's vector-Jacobian
    product: the forward is recomputed in the backward, so only the inputs are saved."""

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        save_inputs(ctx, inputs)

    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        inputs, _ = saved_inputs(ctx)
        return reference_vjp(reference, inputs, grads)

    return setup_context, backward


_lock = threading.Lock()
_registered: dict[str, OpDefinition] = {}


def _schema_of(name: str) -> str:
    packet = getattr(getattr(torch.ops, NAMESPACE), name)
    schema = str(packet.default._schema)
    return schema[schema.index("("):]


def register_op(definition: OpDefinition) -> Any:
    """Register `definition` as `torch.ops.torchbridge.<name>` (once per process) and
    return the op. The same definition again returns the existing op; another definition
    under a taken name is a KernelError."""
    name = definition.name
    if not isinstance(name, str) or not name.isidentifier():
        raise KernelError(f"op name must be a Python identifier, got {name!r}")
    if not callable(definition.reference):
        raise KernelError(f"op {name!r}: reference must be callable, got "
                          f"{definition.reference!r}")
    with _lock:
        known = _registered.get(name)
        if known is not None:
            if known is definition or known.reference is definition.reference:
                return getattr(getattr(torch.ops, NAMESPACE), name)
            raise KernelError(f"op {name!r} is already defined (reference "
                              f"{getattr(known.reference, '__module__', '?')}."
                              f"{getattr(known.reference, '__qualname__', '?')}); an op "
                              "name can be defined once per process")
        try:
            op = torch.library.custom_op(f"{NAMESPACE}::{name}", definition.reference,
                                         mutates_args=(), schema=definition.schema)
            op.register_fake(definition.reference)
            setup_context, backward = vjp_autograd(definition.reference)
            op.register_autograd(backward, setup_context=setup_context)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise KernelError(f"op {name!r} could not be registered with torch.library: "
                              f"{exc}") from exc
        _registered[name] = definition
        return getattr(getattr(torch.ops, NAMESPACE), name)


def definition(name: str) -> OpDefinition | None:
    return _registered.get(name)


def arguments(name: str) -> list[Any]:
    """The op's schema arguments (each has .name, .type, default values)."""
    packet = getattr(getattr(torch.ops, NAMESPACE), name)
    return list(packet.default._schema.arguments)


def schema(name: str) -> str:
    """The op's schema without its name, e.g. "(Tensor gate, Tensor up) -> Tensor"."""
    return _schema_of(name)


for _definition in BUILTIN_OPS:
    register_op(_definition)

rms_norm = torch.ops.torchbridge.rms_norm
add_rms_norm = torch.ops.torchbridge.add_rms_norm
silu_mul = torch.ops.torchbridge.silu_mul
rotary_embedding = torch.ops.torchbridge.rotary_embedding
scaled_dot_product_attention = torch.ops.torchbridge.scaled_dot_product_attention
linear = torch.ops.torchbridge.linear
