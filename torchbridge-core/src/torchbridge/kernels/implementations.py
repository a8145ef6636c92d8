"""What a kernel implementation declares, and how it is made into one op for torch.compile.

A plugin returns `KernelImplementation`s from `torchbridge_kernel_implementations`. The
declaration is what selection reads (see `torchbridge.kernels.choice`): which op, which
backends, dtypes, whether it trains (has a backward), the least device capability or the
architectures it is built for, whether torch.compile can trace it, and a per-call
`declines` that may hand a call back to the reference.

An implementation that is not traceable (a Triton launch, a call into a vendor library) is
wrapped in a custom op of its own, `torch.ops.torchbridge.<op>__<provider>_<name>`, with the
op's schema and fake: compile sees one op and never looks inside. The wrapper runs the
reference instead when the call's dtype is not declared or `declines` gives a reason, and
its backward is the implementation's `backward` when declared, else the reference's: the
gradients are right whichever ran forward.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import torchbridge.kernels.ops as ops_module
from torchbridge.errors import KernelError

# The numbers an implementation must match the reference to, per dtype, as
# max |impl - reference| / max |reference| (one or two roundings apart at most).
TOLERANCES = {torch.float32: 1e-4, torch.float64: 1e-7, torch.float16: 4e-3,
              torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class KernelImplementation:
    """One implementation of op `op`.

    forward: takes the op's arguments (see `torchbridge.kernels.ops.schema(op)`) and returns
        what the reference returns, never an input or a view of one.
    backward: `backward(inputs, output, *grad_outputs) -> grads`, one gradient (or None)
        per op argument; None: inference only (selection skips it for training models).
    backends: backend names it serves (None: every backend).
    dtypes: floating dtypes it computes in (None: any); other calls run the reference.
    min_capability: the least compute capability, e.g. (8, 0), compared with the device's
        `DeviceInfo.compute_capability` ("9.0"); None: no requirement.
    architectures: architecture names or prefixes ("gfx94", "gfx950"), compared with
        `DeviceInfo.architecture`; None: any.
    traceable: torch.compile can trace `forward` (plain torch ops, `torch.library.triton_op`);
        False: it is wrapped in an op of its own.
    differentiable: autograd differentiates `forward` as it is (plain torch ops), so it
        trains without a `backward`.
    declines: `declines(*args) -> reason | None`, called on each call; a reason runs the
        reference for that call (e.g. a hidden size beyond the kernel's block).
    priority: among eligible implementations the highest wins (ties: plugin call order).
    unavailable: why it cannot run in this process at all (e.g. "triton is not installed");
        listed by doctor, never selected.
    """

    op: str
    name: str
    forward: Callable[..., Any]
    backward: Callable[..., Any] | None = None
    backends: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    min_capability: tuple[int, int] | None = None
    architectures: tuple[str, ...] | None = None
    traceable: bool = False
    differentiable: bool = False
    declines: Callable[..., str | None] | None = None
    priority: int = 0
    description: str = ""
    unavailable: str | None = None

    @property
    def trains(self) -> bool:
        return self.backward is not None or self.differentiable


def implementation_problem(impl: object) -> str | None:
    """Why `impl` is not a well-formed KernelImplementation (None: it is)."""
    if not isinstance(impl, KernelImplementation):
        return f"contributed {type(impl).__name__} {impl!r:.60}, expected KernelImplementation"
    label = f"implementation {impl.name!r} of {impl.op!r}"
    if not isinstance(impl.name, str) or not impl.name:
        return f"implementation of {impl.op!r}: name must be a non-empty string"
    if ops_module.definition(impl.op) is None:
        return f"{label}: unknown op {impl.op!r}"
    for what in ("forward",):
        if not callable(getattr(impl, what)):
            return f"{label}: {what} must be callable"
    for what in ("backward", "declines"):
        value = getattr(impl, what)
        if value is not None and not callable(value):
            return f"{label}: {what} must be callable or None"
    if impl.backends is not None and not (isinstance(impl.backends, (tuple, list)) and all(
            isinstance(b, str) for b in impl.backends)):
        return f"{label}: backends must be a tuple of backend names or None"
    if impl.dtypes is not None and not (isinstance(impl.dtypes, (tuple, list)) and all(
            isinstance(d, torch.dtype) for d in impl.dtypes)):
        return f"{label}: dtypes must be a tuple of torch.dtype or None"
    cap = impl.min_capability
    if cap is not None and not (isinstance(cap, tuple) and len(cap) == 2
                                and all(isinstance(c, int) for c in cap)):
        return f"{label}: min_capability must be (major, minor) or None"
    if impl.architectures is not None and not (
            isinstance(impl.architectures, (tuple, list))
            and all(isinstance(a, str) for a in impl.architectures)):
        return f"{label}: architectures must be a tuple of names or None"
    return None


def first_floating_dtype(args: Sequence[Any]) -> torch.dtype | None:
    return next((a.dtype for a in args if isinstance(a, torch.Tensor)
                 and a.is_floating_point()), None)


def decline_reason(impl: KernelImplementation, args: Sequence[Any]) -> str | None:
    """Why `impl` hands this call to the reference (None: it runs it)."""
    dtype = first_floating_dtype(args)
    if impl.dtypes is not None and dtype is not None and dtype not in impl.dtypes:
        return f"dtype {dtype} is not among {impl.name}'s {list(impl.dtypes)}"
    if impl.declines is not None:
        reason = impl.declines(*args)
        if reason is not None:
            return str(reason)
    return None


def _is_tensor_argument(argument: Any) -> bool:
    return "Tensor" in str(argument.type)


def _scalar_kind(argument: Any) -> bool:
    """Whether a non-tensor argument is a number or bool (optional or not)."""
    return str(argument.type).removeprefix("Optional[").removesuffix("]") in (
        "float", "int", "bool", "SymInt")


def _scalar(argument: Any, value: float | None) -> Any:
    """A non-tensor argument back from the float it travelled as."""
    if value is None:
        return None
    kind = str(argument.type)
    return bool(value) if "bool" in kind else int(value) if "int" in kind else value


def _backward_op(impl: KernelImplementation, name: str) -> Any:
    """An op running `impl.backward`, so that torch.compile sees the backward as one op too
    (AOT autograd traces a Python backward; a Triton launch cannot be traced). Arguments:
    the op's tensor arguments, its outputs, the output gradients, and its other arguments
    as floats; result: one gradient per tensor argument (zeros where the implementation
    returns None for a floating input, an empty tensor for a non-floating or absent one)."""
    backward_impl = impl.backward
    assert backward_impl is not None
    arguments = ops_module.arguments(impl.op)

    def rebuild(tensors: list[torch.Tensor | None], scalars: list[float | None]
                ) -> list[Any]:
        tensor_iter, scalar_iter = iter(tensors), iter(scalars)
        return [next(tensor_iter) if _is_tensor_argument(a) else _scalar(a, next(scalar_iter))
                for a in arguments]

    def shapes(tensors: list[torch.Tensor | None]) -> list[torch.Tensor]:
        return [torch.zeros_like(t) if t is not None and t.is_floating_point()
                else torch.empty(0) for t in tensors]

    def run(inputs: list[torch.Tensor | None], outputs: list[torch.Tensor],
            grads: list[torch.Tensor], scalars: list[float | None]) -> list[torch.Tensor]:
        args = rebuild(inputs, scalars)
        output = outputs[0] if len(outputs) == 1 else tuple(outputs)
        got = list(backward_impl(tuple(args), output, *grads))
        result = shapes(inputs)
        positions = [i for i, a in enumerate(arguments) if _is_tensor_argument(a)]
        for slot, position in enumerate(positions):
            grad = got[position] if position < len(got) else None
            if grad is not None and result[slot].numel():
                result[slot] = grad.to(result[slot].dtype).contiguous()
        # An op's results may alias neither its arguments nor each other (x and residual
        # get one gradient; a gradient may be the incoming one).
        taken = {t.untyped_storage().data_ptr() for t in (*inputs, *outputs, *grads)
                 if t is not None and t.numel()}
        for slot, grad in enumerate(result):
            if grad.numel():
                if grad.untyped_storage().data_ptr() in taken:
                    result[slot] = grad = grad.clone()
                taken.add(grad.untyped_storage().data_ptr())
        return result

    op = torch.library.custom_op(
        f"{ops_module.NAMESPACE}::{name}_backward", run, mutates_args=(),
        schema="(Tensor?[] inputs, Tensor[] outputs, Tensor[] grads, float?[] scalars) "
               "-> Tensor[]")

    @op.register_fake
    def _(inputs: list[torch.Tensor | None], outputs: list[torch.Tensor],
          grads: list[torch.Tensor], scalars: list[float | None]) -> list[torch.Tensor]:
        # Contiguous, as run() returns them.
        return [t.new_empty(t.shape) if t is not None and t.is_floating_point()
                else t.new_empty(0) if t is not None else grads[0].new_empty(0)
                for t in inputs]

    return getattr(getattr(torch.ops, ops_module.NAMESPACE), f"{name}_backward")


def _wrapped_autograd(impl: KernelImplementation, reference: Callable[..., Any], name: str
                      ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(setup_context, backward) of an implementation's wrapper op: its own backward (as an
    op of its own) when it declares one and ran the call, else the reference's
    vector-Jacobian product."""
    arguments = ops_module.arguments(impl.op)
    # Non-tensor arguments travel to the backward op as floats: an op with others (a
    # string, a list) keeps the reference's backward, which is right, just not the
    # implementation's.
    plain = all(_is_tensor_argument(a) or _scalar_kind(a) for a in arguments)
    backward_op = _backward_op(impl, name) if impl.backward is not None and plain else None

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        outputs = output if isinstance(output, tuple) else (output,)
        ctx.own_backward = backward_op is not None and decline_reason(impl, inputs) is None
        ops_module.save_inputs(ctx, inputs, *(outputs if ctx.own_backward else ()))

    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        inputs, outputs = ops_module.saved_inputs(ctx)
        if not ctx.own_backward:
            return ops_module.reference_vjp(reference, inputs, grads)
        assert backward_op is not None
        tensors = [a for a, arg in zip(inputs, arguments, strict=True)
                   if _is_tensor_argument(arg)]
        scalars = [None if a is None else float(a)
                   for a, arg in zip(inputs, arguments, strict=True)
                   if not _is_tensor_argument(arg)]
        got = iter(backward_op(tensors, list(outputs), list(grads), scalars))
        out: list[Any] = []
        for a, arg in zip(inputs, arguments, strict=True):
            grad = next(got) if _is_tensor_argument(arg) else None
            usable = isinstance(a, torch.Tensor) and a.is_floating_point()
            out.append(grad if usable else None)
        return tuple(out)

    return setup_context, backward


def _qualified(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]", "_", text)


@dataclass
class BoundKernel:
    """A callable for one op: the chosen implementation (through its wrapper op when it is
    not traceable) or the reference. `implementation` and `provider` say which; `reasons`
    why the others were passed over (see choice.KernelChoice)."""

    op: str
    call: Callable[..., Any]
    implementation: KernelImplementation | None = None
    provider: str | None = None
    reasons: list[str] = field(default_factory=list)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    @property
    def label(self) -> str:
        if self.implementation is None:
            return "reference"
        return f"{self.implementation.name} (plugin {self.provider})"


_lock = threading.Lock()
_wrappers: dict[str, tuple[KernelImplementation, Any]] = {}


def wrapper_op(impl: KernelImplementation, provider: str) -> Any:
    """The custom op that runs `impl` (made once per implementation per process)."""
    base = f"{impl.op}__{_qualified(provider)}_{_qualified(impl.name)}"
    with _lock:
        for suffix in range(1000):
            name = base if suffix == 0 else f"{base}_{suffix}"
            known = _wrappers.get(name)
            if known is None:
                break
            if known[0] == impl:
                return known[1]
        definition = ops_module.definition(impl.op)
        assert definition is not None
        reference = definition.reference

        def run(*args: Any, **kwargs: Any) -> Any:
            # torch.library passes arguments that have defaults by keyword.
            bound = bind_arguments(impl.op, args, kwargs)
            if decline_reason(impl, bound) is not None:
                return reference(*bound)
            return _unaliased(impl.forward(*bound), bound)

        try:
            op = torch.library.custom_op(f"{ops_module.NAMESPACE}::{name}", run,
                                         mutates_args=(), schema=ops_module.schema(impl.op))
            op.register_fake(reference)
            setup_context, backward = _wrapped_autograd(impl, reference, name)
            op.register_autograd(backward, setup_context=setup_context)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise KernelError(f"implementation {impl.name!r} of {impl.op!r} could not be "
                              f"wrapped as an op: {exc}") from exc
        packet = getattr(getattr(torch.ops, ops_module.NAMESPACE), name)
        _wrappers[name] = (impl, packet)
        return packet


def bind(impl: KernelImplementation | None, provider: str | None, op: str,
         reasons: list[str] | None = None) -> BoundKernel:
    """A BoundKernel running `impl` (None: the reference, traceable as plain torch)."""
    definition = ops_module.definition(op)
    if definition is None:
        raise KernelError(f"unknown op {op!r}")
    if impl is None:
        return BoundKernel(op, definition.reference, None, None, reasons or [])
    if impl.traceable and impl.backward is None:  # a declared backward needs the wrapper
        traced = impl
        spec = argument_spec(op)

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = bind_arguments(op, args, kwargs, spec)
            if decline_reason(traced, bound) is not None:
                return definition.reference(*bound)
            return traced.forward(*bound)

        return BoundKernel(op, call, impl, provider, reasons or [])
    return BoundKernel(op, wrapper_op(impl, provider or "unknown"), impl, provider,
                       reasons or [])


def _unaliased(output: Any, inputs: tuple[Any, ...]) -> Any:
    """An op may not return its input: an implementation that does (an in-place kernel
    returning x) has that output copied."""
    storages = {a.untyped_storage().data_ptr() for a in inputs
                if isinstance(a, torch.Tensor) and a.numel()}

    def copy_if_alias(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.numel() and \
                t.untyped_storage().data_ptr() in storages:
            return t.clone()
        return t

    if isinstance(output, tuple):
        return tuple(copy_if_alias(t) for t in output)
    return copy_if_alias(output)


def argument_spec(op: str) -> tuple[tuple[str, bool, Any], ...]:
    """(name, has a default, default) per argument of the op's schema, as plain values
    (torch.compile traces code that reads them; it cannot iterate schema objects)."""
    packet = getattr(getattr(torch.ops, ops_module.NAMESPACE), op)
    return tuple((a.name, a.has_default_value(),
                  a.default_value if a.has_default_value() else None)
                 for a in packet.default._schema.arguments)


def bind_arguments(op: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   spec: tuple[tuple[str, bool, Any], ...] | None = None) -> tuple[Any, ...]:
    """Positional arguments with the schema's defaults filled in; unknown, repeated or
    missing arguments are a TypeError, as for the op itself."""
    spec = argument_spec(op) if spec is None else spec
    names = [name for name, _, _ in spec]
    for key in kwargs:
        if key not in names:
            raise TypeError(f"{op}() got an unexpected argument {key!r}; it takes "
                            f"{', '.join(names)}")
        if names.index(key) < len(args):
            raise TypeError(f"{op}() got {key!r} both by position and by name")
    if len(args) > len(names):
        raise TypeError(f"{op}() takes {len(names)} arguments, got {len(args)}")
    out = list(args)
    for name, has_default, default in spec[len(args):]:
        if name in kwargs:
            out.append(kwargs[name])
        elif has_default:
            out.append(default)
        else:
            raise TypeError(f"{op}() missing argument {name!r}")
    return tuple(out)
