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
An op name is validated before torch sees it (`op_name_problem`): a Python identifier of
ASCII letters, digits and single underscores, starting with a letter, that names nothing
else in the `torch.ops.torchbridge` namespace (`name`, `__class__` ...) and is no keyword;
double underscores are kept for the implementations' wrapper ops.

Ops are registered once and then left to torch; code that replaces a registration behind
their back (`torch.library.impl`, `Library("torchbridge", "IMPL").impl(...)`,
`register_fake`, `register_autograd`, `register_kernel`, `register_autocast` on one of
these ops) changes what every TorchBridge user of the op computes. `overridden_ops()` lists
what changed since registration, for doctor.
"""

from __future__ import annotations

import inspect
import keyword
import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from torchbridge.errors import KernelError

NAMESPACE = "torchbridge"

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class _Registration:
    """What registering an op put in torch: its CustomOpDef, the fake and autograd functions
    given to it, and the op's dispatcher table right after (for overridden_ops)."""

    custom_op: Any
    fake: Callable[..., Any]
    setup_context: Callable[..., Any]
    backward: Callable[..., Any]
    table: frozenset[str]
    kernels: tuple[tuple[Any, Any], ...]  # (device, function) as torch keeps them
    # Entries of the table that were there before TorchBridge defined the op (an impl may
    # be registered for an op not yet defined) and that its definition did not replace:
    # not TorchBridge's, so not in `table`; they run instead of the op's own.
    earlier: frozenset[str] = frozenset()


_registrations: dict[str, _Registration] = {}
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
MAX_NAME_LENGTH = 64


def _namespace_attributes() -> set[str]:
    """Names the torch.ops namespace object answers itself (not ops): `name`, `_dir`,
    `__class__`, its methods ..."""
    namespace = getattr(torch.ops, NAMESPACE)
    own = {k for k, v in vars(namespace).items()
           if not isinstance(v, torch._ops.OpOverloadPacket)}
    return set(dir(type(namespace))) | own


def op_name_problem(name: object) -> str | None:
    """Why `name` cannot be an op name (None: it can). An op name is what follows
    `torch.ops.torchbridge.`, and part of the names of its implementations' wrapper ops."""
    if not isinstance(name, str):
        return f"op name must be a string, got {type(name).__name__} {name!r:.40}"
    if not name.isidentifier():
        return f"op name {name!r} must be a Python identifier"
    if not _NAME.fullmatch(name):
        return (f"op name {name!r} must start with an ASCII letter and hold only ASCII "
                "letters, digits and underscores")
    if "__" in name:
        return (f"op name {name!r} may not contain '__' (reserved for the wrapper ops of "
                "implementations, <op>__<plugin>_<name>)")
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return f"op name {name!r} is a Python keyword"
    if len(name) > MAX_NAME_LENGTH:
        return f"op name {name[:20]!r}... is longer than {MAX_NAME_LENGTH} characters"
    if name in _namespace_attributes():
        return (f"op name {name!r} is taken by torch.ops.{NAMESPACE} itself (an attribute "
                "of torch's op namespace, not an op)")
    return None


def _table(name: str) -> frozenset[str]:
    """The op's dispatcher table, one line per registered kernel (`Key: registered at
    where`), from torch's dispatcher dump (empty for an op nothing was registered for)."""
    dump = torch._C._dispatch_dump(f"{NAMESPACE}::{name}")
    return frozenset(line.strip() for line in dump.splitlines()
                     if ": registered at " in line and not line.startswith("debug:"))


def _schema_of(name: str) -> str:
    packet = getattr(getattr(torch.ops, NAMESPACE), name)
    schema = str(packet.default._schema)
    return schema[schema.index("("):]


def _parameter_text(param: inspect.Parameter) -> str:
    if param.kind is inspect.Parameter.VAR_POSITIONAL:
        return f"*{param.name}"
    if param.kind is inspect.Parameter.VAR_KEYWORD:
        return f"**{param.name}"
    return param.name


def _parameters_problem(definition: OpDefinition) -> str | None:
    """Why `definition.reference`'s parameters disagree with its schema (None: they agree,
    or either cannot be read, in which case torch.library says what is wrong).

    torch calls the reference with the schema's positional arguments by position and its
    keyword-only ones (after `*`) by name, while users, `get_kernel` and the
    implementations bind a call's arguments by the schema's names: a reference whose
    parameters are in another order ((x, scale, shift) under a schema of (x, shift,
    scale)) would compute with the values swapped. So the reference's named parameters
    must be the schema's arguments, in the schema's order; one the schema does not have
    must come after them with a default, and a `*args` or `**kwargs` of its own stands for
    the schema's arguments it does not name."""
    if definition.schema is None:
        return None  # inferred from the reference: the same names by construction
    try:
        parsed = torch._C.parse_schema(f"{NAMESPACE}::{definition.name}{definition.schema}")
        params = list(inspect.signature(definition.reference).parameters.values())
    except (RuntimeError, ValueError, TypeError):
        return None
    kind = inspect.Parameter
    named = [p for p in params if p.kind not in (kind.VAR_POSITIONAL, kind.VAR_KEYWORD)]
    var_positional = any(p.kind is kind.VAR_POSITIONAL for p in params)
    var_keyword = any(p.kind is kind.VAR_KEYWORD for p in params)
    schema_args = list(parsed.arguments)
    positional = [a for a in schema_args if not a.kwarg_only]
    ref_positional = [p for p in named if p.kind is not kind.KEYWORD_ONLY]
    ref_by_name = {p.name: p for p in named}

    def wrong(why: str) -> str:
        return (f"op {definition.name!r}: {why}; the schema's arguments are "
                f"({', '.join(a.name for a in schema_args)}) and the reference's parameters "
                f"({', '.join(_parameter_text(p) for p in params)}); torch passes the schema's "
                "arguments to the reference in that order, so the names must agree in "
                "order (or leave the schema out to infer it from the reference)")

    # Names in another order are values swapped. Other names at a position are a rename,
    # which binds right by position: a warning, not an error (such ops registered before).
    swapped = {a.name for a in positional} & {p.name for p in ref_positional}
    renamed = []
    for i, arg in enumerate(positional):
        if i < len(ref_positional):
            name = ref_positional[i].name
            if name != arg.name and (name in swapped or arg.name in swapped):
                return wrong(f"argument {i} is {arg.name!r} in the schema but "
                             f"{name!r} in the reference")
            if name != arg.name:
                renamed.append(f"{arg.name!r} is {name!r}")
        elif not var_positional:
            param = ref_by_name.get(arg.name)
            if param is not None and param.kind is kind.KEYWORD_ONLY:
                return wrong(f"argument {arg.name!r} is positional in the schema but "
                             "keyword-only in the reference")
            return wrong(f"the reference takes no parameter at position {i} for the "
                         f"schema's argument {arg.name!r}")
    schema_names = {a.name for a in schema_args}
    for arg in schema_args[len(positional):]:  # keyword-only: passed by name
        param = ref_by_name.get(arg.name)
        if param is None and not var_keyword:
            return wrong(f"the schema's keyword-only argument {arg.name!r} is not a "
                         "parameter of the reference")
        if param is not None and param.kind is kind.POSITIONAL_ONLY:
            return wrong(f"the schema's keyword-only argument {arg.name!r} is "
                         "positional-only in the reference")
    # The reference's other parameters: a keyword-only argument of the schema (given by
    # name; positional-only is refused above), or one of its own with a default.
    for param in ref_positional[len(positional):] + [p for p in named
                                                      if p.kind is kind.KEYWORD_ONLY]:
        if param.name not in schema_names and param.default is kind.empty:
            return wrong(f"the reference's parameter {param.name!r} is not in the schema "
                         "and has no default")
    if renamed:
        logger.warning("op %r: the reference names its parameters otherwise than the "
                       "schema (%s); torch passes them by position", definition.name,
                       ", ".join(renamed))
    return None


def register_op(definition: OpDefinition) -> Any:
    """Register `definition` as `torch.ops.torchbridge.<name>` (once per process) and
    return the op. The same definition again returns the existing op; another definition
    under a taken name is a KernelError, and so is a schema whose arguments are not the
    reference's parameters in order (see _parameters_problem)."""
    name = definition.name
    problem = op_name_problem(name)
    if problem is not None:
        raise KernelError(problem)
    if not callable(definition.reference):
        raise KernelError(f"op {name!r}: reference must be callable, got "
                          f"{definition.reference!r}")
    problem = _parameters_problem(definition)
    if problem is not None:
        raise KernelError(problem)
    with _lock:
        known = _registered.get(name)
        if known is not None:
            if known is definition or known.reference is definition.reference:
                return getattr(getattr(torch.ops, NAMESPACE), name)
            raise KernelError(f"op {name!r} is already defined (reference "
                              f"{getattr(known.reference, '__module__', '?')}."
                              f"{getattr(known.reference, '__qualname__', '?')}); an op "
                              "name can be defined once per process")
        # Code may register kernels for torchbridge::<name> before this defines it
        # (torch.library.register_kernel, Library("torchbridge", "IMPL").impl: torch
        # accepts an impl ahead of its definition). The baseline for overridden_ops is what
        # this registration added, not the whole table right after it, or those earlier
        # overrides would count as the op's own and never be reported.
        try:
            earlier = _table(name)
        except RuntimeError:
            earlier = frozenset()
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
        table = _table(name)
        _registrations[name] = _Registration(
            op, definition.reference, setup_context, backward, table - earlier,
            tuple(getattr(op, "_backend_fns", {}).items()), table & earlier)
        return getattr(getattr(torch.ops, NAMESPACE), name)


_TORCH_DIR = str(Path(torch.__file__).parent)


def _torch_internal(fn: Any) -> bool:
    module = str(getattr(fn, "__module__", "") or "")
    code = getattr(fn, "__code__", None)
    return module == "torch" or module.startswith("torch.") or (
        code is not None and code.co_filename.startswith(_TORCH_DIR))


def _user_function(fn: Any) -> Any:
    """The function behind torch's wrappers: torch.library keeps a user's kernel inside
    wrappers of its own (register_kernel's `wrapped_fn`, itself wrapped by
    `torch._disable_dynamo`, which copies the inner name through functools.wraps), so
    follow `__wrapped__` and closure cells, breadth first and a few levels deep, to the
    first function not defined in torch. `fn` itself when none is found."""
    seen: set[int] = set()
    level = [fn]
    for _ in range(6):
        following: list[Any] = []
        for candidate in level:
            if id(candidate) in seen:
                continue
            seen.add(id(candidate))
            if callable(candidate) and hasattr(candidate, "__code__") and \
                    not _torch_internal(candidate):
                return candidate
            inner = getattr(candidate, "__wrapped__", None)
            if inner is not None:
                following.append(inner)
            for cell in getattr(candidate, "__closure__", None) or ():
                try:
                    contents = cell.cell_contents
                except ValueError:
                    continue
                if callable(contents):
                    following.append(contents)
        if not following:
            break
        level = following
    return fn


def _function_label(fn: Any) -> str:
    """module.qualname (file:line) of `fn`, or of the function torch wrapped in it."""
    fn = _user_function(fn)
    code = getattr(fn, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}{where}"


def overridden_ops() -> list[tuple[str, str]]:
    """(op, what) for every registration of a TorchBridge op that was changed after the
    op was registered, by code calling torch.library directly: a kernel added or replaced
    for a dispatch key (`Library("torchbridge", "IMPL").impl`, `torch.library.impl` on the
    dispatcher), a device kernel (`torch.library.register_kernel` / `impl`), its fake, its
    autograd, an autocast, vmap or torch_dispatch rule. Empty: every op computes what its
    definition says. For doctor; cheap (no op runs)."""
    found: list[tuple[str, str]] = []
    with _lock:
        registrations = list(_registrations.items())
    for name, reg in registrations:
        custom = reg.custom_op
        before = len(found)
        original = dict(reg.kernels)
        for device, fn in sorted(getattr(custom, "_backend_fns", {}).items(),
                                 key=lambda item: str(item[0])):
            if device in original and original[device] is fn:
                continue
            where = "every device" if device is None else f"device {device!r}"
            found.append((name, f"its kernel for {where} was replaced by "
                                f"{_function_label(fn)} (torch.library.impl / "
                                "register_kernel)"))
        if getattr(custom, "_abstract_fn", reg.fake) is not reg.fake:
            found.append((name, f"its fake (meta) implementation was replaced by "
                                f"{_function_label(custom._abstract_fn)} (register_fake)"))
        if getattr(custom, "_backward_fn", reg.backward) is not reg.backward or \
                getattr(custom, "_setup_context_fn", reg.setup_context) is not \
                reg.setup_context:
            found.append((name, f"its autograd was replaced by "
                                f"{_function_label(custom._backward_fn)} (register_autograd)"))
        for device, dtype in sorted(getattr(custom, "_autocast_dtype", {}).items()):
            found.append((name, f"an autocast rule casts its inputs to {dtype} on {device} "
                                "(register_autocast)"))
        if getattr(custom, "_vmap_fn", None) is not None:
            found.append((name, "a vmap rule was registered (register_vmap)"))
        for kind in getattr(custom, "_torch_dispatch_fns", {}):
            found.append((name, f"a torch_dispatch rule for {getattr(kind, '__name__', kind)}"
                                " was registered (register_torch_dispatch)"))
        try:
            table = _table(name)
        except RuntimeError:
            continue
        for line in sorted(table - reg.table):
            key, _, where = line.partition(": registered at ")
            if len(found) > before and where.startswith(_TORCH_DIR) and \
                    line not in reg.earlier:
                continue  # torch's own entry for a rule reported above
            where = where.split(" :: ")[0]
            how = "through torch.library.impl" if where.startswith(_TORCH_DIR) else \
                f"at {where} (torch.library Library.impl)"
            if line in reg.earlier:
                how += " before TorchBridge defined the op"
            found.append((name, f"a {key.split('[')[0]} kernel was registered {how}, "
                                "taking over the op's own for that dispatch key"))
    return found


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
