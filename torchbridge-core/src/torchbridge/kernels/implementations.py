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
gradients are right whichever ran forward. Its outputs are contiguous, whichever ran and
whatever strides it returned (compiled code checks an op's strides against its fake).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import torchbridge.kernels.ops as ops_module
from torchbridge.errors import KernelError
from torchbridge.tensor_bits import same_bits

logger = logging.getLogger(__name__)

# The numbers an implementation must match the reference to, per dtype, as
# max |impl - reference| / max |reference| (one or two roundings apart at most).
TOLERANCES = {torch.float32: 1e-4, torch.float64: 1e-7, torch.float16: 4e-3,
              torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class KernelImplementation:
    """One implementation of op `op`.

    forward: takes the op's arguments (see `torchbridge.kernels.ops.schema(op)`) and returns
        what the reference returns (in any layout), never an input or a view of one.
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


class DeclinesRaised(str):
    """A decline_reason that is the implementation's failure: its `declines` raised. The
    call runs the reference all the same; a checked kernel refuses the implementation
    with it, and the substitution gate does not substitute it."""


def decline_reason(impl: KernelImplementation, args: Sequence[Any]) -> str | None:
    """Why `impl` hands this call to the reference (None: it runs it). A `declines` that
    raises hands the call to the reference too, with a DeclinesRaised reason: the
    implementation's failure, not the caller's."""
    dtype = first_floating_dtype(args)
    if impl.dtypes is not None and dtype is not None and dtype not in impl.dtypes:
        return f"dtype {dtype} is not among {impl.name}'s {list(impl.dtypes)}"
    if impl.declines is not None:
        try:
            reason = impl.declines(*args)
            return None if reason is None else str(reason)
        except Exception as exc:
            return DeclinesRaised(f"its declines raised {type(exc).__name__}: "
                                  f"{short(exc)} (called with {describe_tensors(args)})")
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
        # Contiguous, as the fake says (zeros_like would keep a transposed input's strides).
        return [t.new_zeros(t.shape) if t is not None and t.is_floating_point()
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


# --- comparing an implementation's outputs with the reference's ------------------------------

def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def short(text: object, limit: int = 160) -> str:
    """`text` on one line, cut to `limit` characters: a reason quoting an exception or a
    value (an exception's message may hold a whole tensor's values) stays readable."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def layout_class(t: torch.Tensor) -> str:
    """How `t` lies in memory, as a class a kernel may treat differently (not its exact
    strides): "contiguous", "channels_last" / "channels_last_3d", "expanded" (a dimension
    of stride 0: a broadcast), "row-strided" (innermost dimension dense, rows apart),
    "transposed" (innermost dimension not dense: transposed, permuted), or a non-strided
    layout's name (sparse)."""
    if t.layout != torch.strided:
        return str(t.layout).removeprefix("torch.")
    return "contiguous" if t.is_contiguous() else _strided_class(t)


def describe_tensors(values: Sequence[Any]) -> str:
    """`bfloat16[2, 8, 64], float32[64], 1e-06`: a call's arguments, compactly (a tensor's
    layout, storage offset and device where they are not the common case)."""
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            text = f"{dtype_name(v.dtype)}{list(v.shape)}"
            try:
                layout = layout_class(v)
                offset = v.storage_offset() if v.layout == torch.strided else 0
            except (RuntimeError, NotImplementedError):  # a subclass without strides
                layout, offset = "contiguous", 0
            if layout != "contiguous":
                text += f" {layout}"
            if offset:
                text += f" at storage offset {offset}"
            return text if v.device.type == "cpu" else f"{text} on {v.device}"
        return f"{v!r:.30}"
    return ", ".join(one(v) for v in values)


def _kind(value: Any) -> str:
    """What an output is, for a reason: "a tensor", "a tuple of 2", "None"."""
    if isinstance(value, torch.Tensor):
        return "a tensor"
    if value is None:
        return "None"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _structure_mismatch(candidate: Any, reference: Any) -> str | None:
    """How the containers of `candidate` differ from the reference's (pytree structure:
    a 1-tuple is not a tensor, a list is not a tuple), or None."""
    from torchbridge import trees

    cand_spec, ref_spec = trees.flatten(candidate)[1], trees.flatten(reference)[1]
    if cand_spec == ref_spec:
        return None
    cand_kind, ref_kind = _kind(candidate), _kind(reference)
    if cand_kind != ref_kind:
        return f"returns {cand_kind} where the reference returns {ref_kind}"
    return (f"returns {cand_kind} structured as {short(cand_spec, 80)} where the "
            f"reference's is {short(ref_spec, 80)}")


def _leaf_mismatch(cands: Sequence[Any], refs: Sequence[Any]) -> str | None:
    """What differs in kind between two outputs' leaves (their number, a tensor's device,
    dtype or shape), or None."""
    if len(cands) != len(refs):
        return f"returns {len(cands)} output(s) where the reference returns {len(refs)}"
    for i, (c, r) in enumerate(zip(cands, refs, strict=True)):
        which = f" as output {i}" if len(refs) > 1 else ""
        if not isinstance(r, torch.Tensor):
            continue
        if not isinstance(c, torch.Tensor):
            return f"returns {_kind(c)}{which} where the reference returns a tensor"
        if c.device != r.device:
            return (f"returns a tensor on {c.device}{which} where the reference returns "
                    f"one on {r.device}")
        if c.dtype != r.dtype:
            return (f"returns {dtype_name(c.dtype)}{which} where the reference returns "
                    f"{dtype_name(r.dtype)}")
        if c.shape != r.shape:
            return (f"returns shape {list(c.shape)}{which} where the reference returns "
                    f"{list(r.shape)}")
    return None


def output_mismatch(candidate: Any, reference: Any) -> str | None:
    """What differs in kind between an implementation's output and the reference's: its
    structure ("returns a tuple of 1 where the reference returns a tensor"), the number of
    outputs, a tensor's device, dtype or shape ("returns float32 where the reference
    returns bfloat16"); None when only values may differ."""
    return _structure_mismatch(candidate, reference) or _leaf_mismatch(
        torch.utils._pytree.tree_leaves(candidate), torch.utils._pytree.tree_leaves(reference))


def relative_error(candidate: Any, reference: Any) -> float:
    """max |candidate - reference| / max |reference| over every tensor output; inf when the
    number of outputs, a tensor's device, dtype or shape differ (output_mismatch says how;
    the containers are not compared here). Positions where the reference is not finite
    must hold the same value (nan where nan, the same inf). Empty tensors of the same
    shape are equal."""
    cands = torch.utils._pytree.tree_leaves(candidate)
    refs = torch.utils._pytree.tree_leaves(reference)
    if _leaf_mismatch(cands, refs) is not None:
        return float("inf")
    worst = 0.0
    for c, r in zip(cands, refs, strict=True):
        if not isinstance(r, torch.Tensor) or not r.numel():
            continue
        if not r.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(c, r) else float("inf"))
            continue
        c, r = c.detach().float(), r.detach().float()
        finite = torch.isfinite(r)
        if not bool(finite.all()):
            same = (c == r) | (torch.isnan(c) & torch.isnan(r))
            if not bool(same[~finite].all()):
                return float("inf")
            c, r = c[finite], r[finite]
            if not r.numel():
                continue
        scale = r.abs().max().item() or 1.0
        diff = (c - r).abs().max().item()
        worst = max(worst, diff / scale if diff == diff else float("inf"))
    return worst


def tolerance_for(*values: Any) -> float:
    """The loosest TOLERANCES entry among the floating dtypes of `values` (and of the
    autocast dtype when autocast is on for their device)."""
    dtypes = {t.dtype for t in torch.utils._pytree.tree_leaves(values)
              if isinstance(t, torch.Tensor) and t.is_floating_point()}
    devices = {t.device.type for t in torch.utils._pytree.tree_leaves(values)
               if isinstance(t, torch.Tensor)}
    for device in devices:
        try:
            if torch.is_autocast_enabled(device):
                dtypes.add(torch.get_autocast_dtype(device))
        except (RuntimeError, TypeError):  # a device type autocast does not know
            continue
    return max((TOLERANCES.get(d, 1e-4) for d in dtypes), default=1e-4)


def call_problem(output: Any, expected: Any, args: Sequence[Any]) -> str | None:
    """Why `output` (an implementation's, on `args`) is not the reference's `expected`:
    a wrong kind of output, named, or values beyond the tolerance; None: it matches."""
    mismatch = output_mismatch(output, expected)
    if mismatch is not None:
        return f"{mismatch} (called with {describe_tensors(args)})"
    tol = tolerance_for(args, expected)
    error = relative_error(output, expected)
    if not error <= tol:
        return (f"differs from the reference by {error:.3g} (tolerance {tol:g}; called "
                f"with {describe_tensors(args)})")
    return None


# --- an implementation leaves its inputs alone ---------------------------------------------

def _tensor_arguments(op: str, args: Sequence[Any]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor among the op's arguments (`x`, `tensors[1]`)."""
    names = [a.name for a in ops_module.arguments(op)]
    found: list[tuple[str, torch.Tensor]] = []
    for i, value in enumerate(args):
        name = names[i] if i < len(names) else f"argument {i}"
        items = list(enumerate(value)) if isinstance(value, (tuple, list)) else [(None, value)]
        found.extend((name if j is None else f"{name}[{j}]", t) for j, t in items
                     if isinstance(t, torch.Tensor))
    return found


def _storage(t: torch.Tensor) -> int | None:
    """Where a tensor's memory starts (a view shares its base's); None: no plain storage."""
    try:
        return t.untyped_storage().data_ptr() if t.numel() else None
    except (RuntimeError, NotImplementedError):  # a subclass without one (sparse, nested)
        return None


@dataclass
class InputSnapshot:
    """An op call's tensor arguments as they were before an implementation ran, for
    `write_problem`: each one's version counter (None for an inference tensor, which keeps
    none) and, within `snapshot_inputs`' limit, a copy of its values."""

    args: tuple[Any, ...]
    tensors: list[tuple[str, torch.Tensor, int | None, torch.Tensor | None]]


def snapshot_inputs(op: str, args: Sequence[Any], limit: int | None = None,
                    originals: Sequence[Any] | None = None) -> InputSnapshot:
    """`args` (the op's positional arguments) before an implementation runs on them; tensors
    of more than `limit` bytes (None: no limit) keep only their version counter. With
    `originals`, the arguments `args` are copies of: their values are what `args` must
    still hold, and nothing is copied."""
    tensors = []
    sources = _tensor_arguments(op, originals) if originals is not None else None
    with torch.no_grad():
        for i, (name, t) in enumerate(_tensor_arguments(op, args)):
            try:
                version: int | None = t._version
            except RuntimeError:  # an inference tensor: its values are compared, if copied
                version = None
            # Values are compared bit for bit (same_bits), which a sparse or other
            # non-strided layout may not allow: those keep their version counter only.
            small = (limit is None or t.numel() * t.element_size() <= limit) and \
                t.layout == torch.strided
            copy = sources[i][1] if sources is not None else \
                t.detach().clone() if small else None
            tensors.append((name, t, version, copy))
    return InputSnapshot(tuple(args), tensors)


def _written(snapshot: InputSnapshot) -> list[str]:
    """The arguments an implementation changed: values differing from the copy, or (no copy,
    or the values written back as they were) a version counter that moved. A view shares its
    base's counter, so q, k and v sliced from one tensor move together: values name which."""
    changed = [name for name, t, _, copy in snapshot.tensors
               if copy is not None and not same_bits(t, copy)]
    return changed or [name for name, t, version, _ in snapshot.tensors
                       if version is not None and t._version != version]


def write_problem(output: Any, snapshot: InputSnapshot) -> str | None:
    """Why an implementation's call broke the rule that it leaves its inputs alone (see
    KernelImplementation.forward): it wrote into an argument, or an output is an argument or
    a view of one (shares its memory); None: neither."""
    called = f"(called with {describe_tensors(snapshot.args)})"
    written = _written(snapshot)
    if written:
        return (f"writes into its argument {', '.join(written)}; an implementation must "
                f"leave its inputs unchanged {called}")
    storages = {_storage(t): name for name, t, _, _ in snapshot.tensors}
    storages.pop(None, None)
    outputs = torch.utils._pytree.tree_leaves(output)
    for i, out in enumerate(outputs):
        name = storages.get(_storage(out)) if isinstance(out, torch.Tensor) else None
        if name is not None:
            which = f" as output {i}" if len(outputs) > 1 else ""
            return (f"returns its argument {name} (or a view of it){which}; an implementation "
                    f"must return new tensors {called}")
    return None


def restore_inputs(snapshot: InputSnapshot) -> None:
    """Put back the values of the copied arguments an implementation wrote into (only those:
    writing moves a tensor's version counter, which autograd checks its saved tensors by)."""
    with torch.no_grad():
        for _, t, _, copy in snapshot.tensors:
            if copy is not None and not same_bits(t, copy):
                try:
                    t.copy_(copy)
                except RuntimeError:  # an inference tensor outside inference mode
                    logger.debug("could not restore an argument the implementation wrote")


# --- the first-use check's signature ---------------------------------------------------------

# How many distinct argument signatures a checked kernel compares on before it trusts every
# call: the check costs one reference run per new signature.
MAX_CHECKED_SIGNATURES = 16
# How many values of its number arguments a checked kernel compares on per signature of
# the others, before it trusts other values of them (see call_signature).
MAX_NUMBER_VALUES = 4

# Non-tensor arguments whose value is always part of a signature: they choose what is
# computed (is_causal, enable_gqa, a mode), take few values, and a kernel may ignore or
# mishandle one value while getting another right. Numbers (int, float) too, but bounded:
# see call_signature.
_VALUE_TYPES = frozenset((type(None), bool, str, torch.dtype, torch.device, torch.layout,
                          torch.memory_format))


def _strided_class(t: torch.Tensor) -> str:
    """layout_class for a strided tensor that is not contiguous, in few queries: called
    on every call of a checked kernel given one (attention's q, k, v often are)."""
    # One way, for the signature and for the reasons that name it (a size-1 dimension's
    # stride means nothing: it is not a broadcast, nor a transposition).
    shape, stride = t.shape, t.stride()
    if any(s == 0 and n > 1 for n, s in zip(shape, stride, strict=True)):
        return "expanded"
    if len(stride) == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    if len(stride) == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last_3d"
    return "row-strided" if stride[-1] == 1 or shape[-1] == 1 else "transposed"


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor in a signature: dtype, shape, device, layout class (whether it is
    contiguous, channels-last, expanded, strided: see layout_class; not its exact strides,
    so that the key stays small and the signatures few) and whether it starts past its
    storage's start. A kernel reading memory as if contiguous is right on a contiguous call
    and wrong on a transposed one of the same shape: the second is a new signature."""
    try:
        # Computed on every call: a contiguous tensor (the common case) costs one query.
        layout = "contiguous" if t.is_contiguous() else _strided_class(t)
        offset = t.storage_offset() != 0
    except (RuntimeError, NotImplementedError):  # sparse, nested: no strides to read
        layout, offset = str(t.layout), False
    return t.dtype, t.shape, t.device, layout, offset


def _argument_key(value: Any, numbers: bool) -> Any:
    # Computed on every call of a checked kernel: the commonest kinds first, by exact type.
    if isinstance(value, torch.Tensor):
        return _tensor_key(value)
    kind = type(value)
    if kind in _VALUE_TYPES:
        return kind, value  # the type too: True and 1 are equal and hash alike
    if isinstance(value, (int, float)):  # bool is caught above
        return (kind, value) if numbers else kind
    if isinstance(value, (tuple, list)):
        return kind, tuple(_argument_key(v, numbers) for v in value)
    return kind  # other objects: compared by type, their values may not hash


def call_signature(args: tuple[Any, ...], kwargs: dict[str, Any], *,
                   numbers: bool = True) -> tuple[Any, ...]:
    """What a checked kernel checks once per distinct value of: each tensor's dtype,
    shape, device and layout class (see _tensor_key), plain non-tensor values (bools,
    strings, None, dtypes, tuples of them) as they are, other objects by type; numbers by
    value (`numbers`), else by type.

    Numbers by value, because an eps or a softmax scale is set once per model and a kernel
    that ignores it (computes the default scale whatever it is given) is wrong only for the
    values it ignores, so it is checked on each. But not without bound: a number can also
    change on every call (a step's scale, a position), which would spend the
    MAX_CHECKED_SIGNATURES checks on values, each costing a reference run, and leave later
    shapes unchecked. So after MAX_NUMBER_VALUES values with the same other arguments,
    other values are trusted (the signature with numbers by type is marked checked)."""
    key = tuple([_argument_key(a, numbers) for a in args])
    if kwargs:
        key += tuple([(k, _argument_key(v, numbers)) for k, v in sorted(kwargs.items())])
    return key


@dataclass
class BoundKernel:
    """A callable for one op: the chosen implementation (through its wrapper op when it is
    not traceable) or the reference. `implementation` and `provider` say which; `reasons`
    why the others were passed over (see choice.KernelChoice).

    `checked` (what `torchbridge.get_kernel` returns, and what a module substituted by
    prepare_model's kernel_substitution calls): the implementation's first eager call with
    each argument signature (tensors' dtypes, shapes, devices and layout classes, other
    arguments' values: see call_signature; the first MAX_CHECKED_SIGNATURES of them) also
    runs the reference on the same arguments, before the implementation; an output of the
    wrong structure, device, dtype, shape or number, values beyond the tolerance, an
    argument the implementation wrote into, an output that is an argument (or a view of
    one), an exception, or a `declines` that raises drops the implementation for good
    (its plugin's error, a warning, the reason in `reasons`, each `on_refusal` told), and
    this call gets the reference's output (arguments it wrote into are put back where they
    were copied) and every later one runs the reference; selection passes the
    implementation over from then on (`refusal`), so the next `get_kernel` gets the next
    best. Calls under torch.compile are not checked (they trace the implementation as it
    is), nor calls on meta or fake tensors or under torch.jit.trace (checked at the first
    real call). `unchecked()` is the same kernel without the check."""

    op: str
    call: Callable[..., Any]
    implementation: KernelImplementation | None = None
    provider: str | None = None
    reasons: list[str] = field(default_factory=list)
    checked: bool = False
    checked_signatures: set[tuple[Any, ...]] = field(default_factory=set, repr=False)
    # Per signature with numbers by type: how many values of the numbers were checked.
    number_values: dict[tuple[Any, ...], int] = field(default_factory=dict, repr=False)
    refused: str | None = None
    backend: str | None = None  # the backend it was chosen for (None: bound directly)
    hook: str = "torchbridge_kernel_implementations"  # the plugin hook it came from
    # Called with the refusal's message when the check refuses the implementation (the
    # kernel substitution pass: the report's kernel lines then say so).
    on_refusal: list[Callable[[str], None]] = field(default_factory=list, repr=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.checked and self.implementation is not None and \
                not torch.compiler.is_compiling():
            return self._checked_call(args, kwargs)
        return self.call(*args, **kwargs)

    @property
    def label(self) -> str:
        if self.implementation is None:
            return "reference"
        return f"{self.implementation.name} (plugin {self.provider})"

    def unchecked(self) -> BoundKernel:
        """This kernel without the first-use check (e.g. for benchmarks)."""
        return BoundKernel(self.op, self.call, self.implementation, self.provider,
                           list(self.reasons), backend=self.backend, hook=self.hook)

    def _checked_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        signature = call_signature(args, kwargs)
        if signature in self.checked_signatures:
            return self.call(*args, **kwargs)
        loose = call_signature(args, kwargs, numbers=False)
        if loose in self.checked_signatures or \
                len(self.checked_signatures) >= MAX_CHECKED_SIGNATURES:
            return self.call(*args, **kwargs)
        if uncheckable(args, kwargs):
            # Meta or fake tensors (shape propagation, tracing under a fake mode, vmap)
            # carry no values to compare: the call goes through unchecked, and since the
            # signature is not marked checked, the first real call with it is checked.
            return self.call(*args, **kwargs)
        impl = self.implementation
        assert impl is not None
        definition = ops_module.definition(self.op)
        assert definition is not None
        bound = bind_arguments(self.op, args, kwargs)
        declined = decline_reason(impl, bound)
        if isinstance(declined, DeclinesRaised):
            self._refuse(declined)  # its declines failed: the implementation's failure
            return self.call(*args, **kwargs)  # the reference, from now on
        if declined is not None:
            return self.call(*args, **kwargs)  # the reference runs it: nothing to check
        # The reference runs first, on the arguments as the caller gave them: an
        # implementation that writes into them cannot change what it is compared with.
        with torch.no_grad():
            expected = definition.reference(*bound)
        run = bound
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in torch.utils._pytree.tree_leaves(bound)):
            # Training: the implementation runs on differentiable copies (the same strides
            # where dense), since a write into an argument autograd tracks would stay in its
            # record for the caller's other uses of it, which putting the values back
            # cannot undo; gradients reach the caller's tensors through the copies.
            run = tuple(torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, bound))
            before = snapshot_inputs(self.op, run, originals=bound)
        else:
            # Copies of the arguments to find writes into them by (and put them back from):
            # each one no larger than the reference's output, which the check holds anyway.
            # A larger one (a linear's weight at a few rows) is watched by its version
            # counter alone, which every torch op writing into it moves, but not a raw
            # kernel's stores.
            limit = sum(t.numel() * t.element_size()
                        for t in torch.utils._pytree.tree_leaves(expected)
                        if isinstance(t, torch.Tensor))
            before = snapshot_inputs(self.op, bound, limit)
        problem: str | None
        try:
            output = self.call(*run)
        except OutputKindError as exc:  # the wrapper op's: named, without the values
            problem = f"{exc.problem} (called with {describe_tensors(bound)})"
        except Exception as exc:
            problem = f"raised {type(exc).__name__}: {short(exc)}"
        else:
            try:
                problem = write_problem(output, before) or \
                    call_problem(output, expected, bound)
            except Exception as exc:  # an output the comparison cannot read
                problem = (f"returns an output that cannot be compared with the "
                           f"reference's ({type(exc).__name__}: {short(exc)}; called with "
                           f"{describe_tensors(bound)})")
        if problem is None:
            self.checked_signatures.add(signature)
            if loose != signature:
                count = self.number_values[loose] = self.number_values.get(loose, 0) + 1
                if count >= MAX_NUMBER_VALUES:
                    self.checked_signatures.add(loose)
            return output
        self._refuse(problem)
        if run is not bound:
            return definition.reference(*bound)  # with gradients; the caller's are untouched
        restore_inputs(before)
        return expected  # computed before the implementation could write anything

    def _refuse(self, problem: str) -> None:
        from torchbridge.plugins import get_plugin_host

        message = (f"{self.label} failed its check against the reference on first use: "
                   f"{problem}; the reference runs instead")
        logger.warning("kernel for %s: %s", self.op, message)
        if self.provider is not None:
            # The hook the implementation came from: a first-contract plugin implements
            # torchbridge_kernel, not torchbridge_kernel_implementations.
            get_plugin_host().record_hook_error(self.provider, self.hook,
                                                f"op {self.op}: {message}")
            if self.backend is not None and self.implementation is not None:
                # Remembered for the process, so selection passes it over from now on
                # (choice.choose) rather than choosing it again for the next get_kernel.
                _record_refusal(self.op, self.backend, self.provider,
                                self.implementation,
                                f"refused: failed its check against the reference on "
                                f"first use: {problem}")
        definition = ops_module.definition(self.op)
        assert definition is not None
        self.reasons.append(message)
        self.refused = message
        self.implementation, self.provider = None, None
        self.call = definition.reference
        for tell in self.on_refusal:
            try:
                tell(message)
            except Exception:  # a report that cannot be updated: the refusal stands
                logger.debug("on_refusal callback failed for %s", self.op, exc_info=True)


# Implementations a checked kernel refused: (op, backend, plugin, implementation name) ->
# (plugin host, the plugin's record, reason). A refusal holds while the same plugin
# registration is loaded: reloading plugins, or registering the plugin again, forgets it
# (a new record), so a fixed plugin is tried afresh.
_refusals_lock = threading.Lock()
_refusals: dict[tuple[str, str, str, str], tuple[Any, Any, str]] = {}


def _record_refusal(op: str, backend: str, provider: str, impl: KernelImplementation,
                    reason: str) -> None:
    from torchbridge.plugins import get_plugin_host

    host = get_plugin_host()
    with _refusals_lock:
        _refusals[(op, backend, provider, impl.name)] = (host, host.records.get(provider),
                                                         reason)


def refusal(op: str, backend: str, provider: str, impl: KernelImplementation) -> str | None:
    """Why `impl` (from plugin `provider`) was refused for `op` on `backend` by a checked
    kernel in this process; None: it was not (or its plugin was registered again since)."""
    with _refusals_lock:
        entry = _refusals.get((op, backend, provider, impl.name))
    if entry is None:
        return None
    from torchbridge.plugins import get_plugin_host

    host, record, reason = entry
    current = get_plugin_host()
    if current is not host or current.records.get(provider) is not record:
        return None
    return reason


def uncheckable(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a call's tensors hold no values to compare with the reference: meta tensors,
    fake tensors (or a fake or proxy mode active, as while tracing), functorch-wrapped
    tensors (vmap). `.item()` on them fails or records a graph break."""
    from torch._subclasses.fake_tensor import FakeTensor

    leaves = torch.utils._pytree.tree_leaves((tuple(args), kwargs))
    for value in leaves:
        if not isinstance(value, torch.Tensor):
            continue
        if value.device.type == "meta" or isinstance(value, FakeTensor):
            return True
        try:
            if torch._C._functorch.is_functorch_wrapped_tensor(value):
                return True
        except (AttributeError, RuntimeError):
            pass
    try:
        keys = torch._C._TorchDispatchModeKey
        if torch._C._get_dispatch_mode(keys.FAKE) is not None or \
                torch._C._get_dispatch_mode(keys.PROXY) is not None:
            return True
    except (AttributeError, RuntimeError):
        pass
    # Under torch.jit.trace: the check's reference run would be recorded in the trace.
    return torch._C._get_tracing_state() is not None


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
        returns = _returns(impl.op)

        def run(*args: Any, **kwargs: Any) -> Any:
            # torch.library passes arguments that have defaults by keyword.
            bound = bind_arguments(impl.op, args, kwargs)
            if decline_reason(impl, bound) is not None:
                return _op_outputs(reference(*bound))
            output = impl.forward(*bound)
            wrong = _returns_problem(output, returns)
            if wrong is not None:  # torch would say "Unable to cast" and print the values
                raise OutputKindError(impl.name, wrong)
            return _op_outputs(output, bound)

        def fake(*args: Any, **kwargs: Any) -> Any:
            return _op_outputs(reference(*args, **kwargs))

        try:
            op = torch.library.custom_op(f"{ops_module.NAMESPACE}::{name}", run,
                                         mutates_args=(), schema=ops_module.schema(impl.op))
            op.register_fake(fake)
            setup_context, backward = _wrapped_autograd(impl, reference, name)
            op.register_autograd(backward, setup_context=setup_context)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise KernelError(f"implementation {impl.name!r} of {impl.op!r} could not be "
                              f"wrapped as an op: {exc}") from exc
        packet = getattr(getattr(torch.ops, ops_module.NAMESPACE), name)
        _wrappers[name] = (impl, packet)
        return packet


def bind(impl: KernelImplementation | None, provider: str | None, op: str,
         reasons: list[str] | None = None, *, backend: str | None = None,
         hook: str = "torchbridge_kernel_implementations") -> BoundKernel:
    """A BoundKernel running `impl` (None: the reference, traceable as plain torch);
    `backend` it was chosen for and the plugin `hook` it came from, for a refusal."""
    definition = ops_module.definition(op)
    if definition is None:
        raise KernelError(f"unknown op {op!r}")
    if impl is None:
        return BoundKernel(op, definition.reference, None, None, reasons or [],
                           backend=backend, hook=hook)
    if impl.traceable and impl.backward is None:  # a declared backward needs the wrapper
        traced = impl
        spec = argument_spec(op)

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = bind_arguments(op, args, kwargs, spec)
            if decline_reason(traced, bound) is not None:
                return definition.reference(*bound)
            return traced.forward(*bound)

        return BoundKernel(op, call, impl, provider, reasons or [], backend=backend,
                           hook=hook)
    return BoundKernel(op, wrapper_op(impl, provider or "unknown"), impl, provider,
                       reasons or [], backend=backend, hook=hook)


class OutputKindError(KernelError):
    """An opaque implementation returned something its op's schema cannot return (a tuple
    where the op returns a tensor); `problem` says what, without the implementation's
    name."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name} {problem}")
        self.problem = problem


def _returns(op: str) -> tuple[str, ...]:
    """The types the op's schema returns ("Tensor", "Tensor[]", ...)."""
    packet = getattr(getattr(torch.ops, ops_module.NAMESPACE), op)
    return tuple(str(r.type) for r in packet.default._schema.returns)


def _returns_problem(output: Any, returns: tuple[str, ...]) -> str | None:
    """How `output` is not what a schema returning `returns` returns (None: it fits)."""
    if len(returns) == 1 and returns[0] == "Tensor":
        if not isinstance(output, torch.Tensor):
            return f"returns {_kind(output)} where the reference returns a tensor"
    elif len(returns) == 1 and returns[0].endswith("[]"):
        if not isinstance(output, (tuple, list)):
            return f"returns {_kind(output)} where the reference returns a list of tensors"
    elif len(returns) > 1 and not (isinstance(output, (tuple, list))
                                   and len(output) == len(returns)):
        return f"returns {_kind(output)} where the reference returns a tuple of {len(returns)}"
    return None


def _op_outputs(output: Any, inputs: tuple[Any, ...] = ()) -> Any:
    """The wrapper op's outputs (a tensor, or a tuple or list of them): contiguous, and
    none of them an input. Compiled code checks that an op returns the strides its fake
    gave, and the reference's strides follow its inputs' layout (attention on transposed
    q, k, v returns a transposed output), which an implementation need not copy: so both
    the fake and the run return contiguous tensors, whatever the implementation or the
    reference returned. And an op may not return its input: an implementation that does
    (an in-place kernel returning x) has that output copied. Without `inputs` (the fake,
    whose tensors have no storage to compare; the reference) no output is compared."""
    storages = {a.untyped_storage().data_ptr() for a in inputs
                if isinstance(a, torch.Tensor) and a.numel()}

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if storages and t.numel() and t.untyped_storage().data_ptr() in storages:
            return t.clone(memory_format=torch.contiguous_format)
        return t.contiguous()

    if isinstance(output, tuple):
        return tuple(one(t) for t in output)
    if isinstance(output, list):
        return [one(t) for t in output]
    return one(output)


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
