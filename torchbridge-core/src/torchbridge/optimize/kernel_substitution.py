"""The kernel substitution pass: modules that compute an op run the chosen implementation.

A `ModulePattern` (torchbridge.optimize.kernel_patterns) recognises a module by structure
and says how its forward calls the op. For each module that matches:

1. Its real inputs are captured from one run of the sample input (one copy per input
   signature); without a sample, a synthetic input of its width in its parameters' dtype.
   A module the sample run never calls is reported and left alone.
2. The formula check: the pattern's forward with the op's reference must reproduce the
   module's own output within the dtype's tolerance, on those inputs and on a synthetic
   input shifted off zero mean (which tells LayerNorm from RMSNorm at any width);
   otherwise the module is not what the pattern thinks and stays as it is.
3. The correctness gate: each eligible implementation, in preference order, runs on the
   same inputs; it must take the call (not decline it), return what the reference returns
   for every call of the op (number of outputs, dtypes, shapes: a wrong one is named,
   "returns float32 where the reference returns bfloat16"), match the reference within the
   tolerance, match its gradients when the model trains, and with `measure=True` not be
   slower than the module. Without a sample input it is also probed where the level runs:
   in the autocast dtype when the model computes under autocast (O2+), and on a second,
   larger synthetic input (`ModulePattern.larger_input`: more rows than a kernel's first
   tile, odd sizes); a probe call the implementation declines is left to the reference,
   as it would be at run time. The first that passes is used; a refusal is reported with
   its figure. Verdicts are shared between modules whose call to the op is the same
   (shapes, dtypes and scalar arguments): thirty identical layers are one check.
4. The module's class becomes a subclass of its own whose forward calls the
   implementation: the module object, its parameters (tied ones stay tied), state_dict
   keys, attributes and hooks are kept; isinstance still holds. Pickled, it comes back as
   its own class running its own code; deep-copied, it keeps the kernel.
5. At run time the module calls the implementation checked, as `get_kernel`'s kernels
   are (BoundKernel.checked): each new call signature (another batch size, a mask, a
   transposed input) is compared with the reference once, on first use; one that fails
   refuses the implementation for the process, the call gets the reference's output, and
   the module's kernel line in the report becomes "refused" with the reason.

With no eligible implementation a module is left alone: the model's own code is the
reference, and torch.compile can fuse it.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchbridge.kernels.choice import Candidate, KernelChoice, choose, known_ops
from torchbridge.kernels.implementations import (
    TOLERANCES,
    BoundKernel,
    DeclinesRaised,
    bind,
    bind_arguments,
    decline_reason,
    describe_tensors,
    dtype_name,
    first_floating_dtype,
    output_mismatch,
    relative_error,
    restore_inputs,
    short,
    snapshot_inputs,
    write_problem,
)
from torchbridge.optimize.hf_attention import HF_ATTENTION
from torchbridge.optimize.kernel_patterns import BUILTIN_PATTERNS, ModulePattern, grown_input
from torchbridge.optimize.passes import OptimizationPass, PassContext
from torchbridge.optimize.report import KERNEL_SUBSTITUTION_PASS
from torchbridge.plugins import get_plugin_host

logger = logging.getLogger(__name__)


def clock() -> float:
    """The clock a measured keep-or-reject decision reads (tests replace it: the decision is
    tested without the real clock, whose readings hang on the machine's load)."""
    return time.perf_counter()


# --- the substituted module ------------------------------------------------------------

@dataclass
class Substitution:
    pattern: ModulePattern
    kernel: BoundKernel
    facts: dict[str, Any]

    def __deepcopy__(self, memo: dict[int, Any]) -> Substitution:
        # Shared by copies: what the module runs, not its state (the pattern and facts are
        # read-only; the kernel is the chosen implementation, whose checked-call record
        # is the implementation's own), and a plugin's kernel need not copy.
        return self


_SUBCLASSES: dict[type, type] = {}


def _substituted_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    sub: Substitution = self._torchbridge_substitution  # type: ignore[assignment]
    return sub.pattern.forward(self, sub.kernel, sub.facts, *args, **kwargs)


def _restore(cls: type[nn.Module], state: dict[str, Any]) -> nn.Module:
    module = cls.__new__(cls)
    module.__dict__.update(state)
    return module


def _reduce_ex(self: nn.Module, protocol: Any) -> tuple[Any, ...]:
    # The kernel (an op, a plugin's function) does not pickle; the module's own class does.
    state = {k: v for k, v in self.__dict__.items() if k != "_torchbridge_substitution"}
    return _restore, (type(self).__mro__[1], state)


def _deepcopy(self: nn.Module, memo: dict[int, Any]) -> nn.Module:
    # copy.deepcopy would otherwise go through __reduce_ex__, which is for pickling: the
    # copy would run the module's own code while its report says substituted. A copy
    # lives where the subclass exists, so it stays one, with the same Substitution (see
    # Substitution.__deepcopy__); the rest is what deepcopy does for any nn.Module.
    copied = type(self).__new__(type(self))
    memo[id(self)] = copied
    state = self.__getstate__()  # type: ignore[no-untyped-call]
    copied.__setstate__(copy.deepcopy(state, memo))  # type: ignore[no-untyped-call]
    return copied


def substituted_class(cls: type) -> type:
    """A subclass of `cls` whose forward calls the substitution's kernel; same name, so
    code that matches module classes by name (Hugging Face's no-split lists) still does."""
    if getattr(cls, "_torchbridge_substituted", False):
        return cls
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {
            "forward": _substituted_forward, "_torchbridge_substituted": True,
            "__reduce_ex__": _reduce_ex, "__deepcopy__": _deepcopy,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": f"{cls.__qualname__} running a TorchBridge kernel (see "
                       "module._torchbridge_substitution)."})
        _SUBCLASSES[cls] = sub
    return sub


def substitute(module: nn.Module, pattern: ModulePattern, kernel: BoundKernel,
               facts: dict[str, Any]) -> None:
    module.__class__ = substituted_class(type(module))
    module._torchbridge_substitution = Substitution(pattern, kernel, facts)  # type: ignore[assignment]


# --- checking numbers --------------------------------------------------------------------

__all__ = ["relative_error", "output_mismatch", "kernel_substitution_pass"]


def _tolerance(dtype: torch.dtype, ctx: PassContext) -> float:
    """The dtype's tolerance, or the autocast dtype's when the model computes in it."""
    tol = TOLERANCES.get(dtype, 1e-4)
    autocast: torch.dtype | None = ctx.state.get("autocast_dtype")
    return max(tol, TOLERANCES.get(autocast, tol)) if autocast is not None else tol


def _signature(values: Any, keywords: dict[str, Any] | None = None) -> tuple[Any, ...]:
    """What identifies a call for sharing verdicts: tensors by shape and dtype (None for
    absent ones), other values by repr; keyword arguments by name too."""
    def one(v: Any) -> Any:
        return (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v)
    return tuple(one(v) for v in values) + tuple(
        (k, one(v)) for k, v in sorted((keywords or {}).items()))


def _shifted(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Floating inputs moved off zero mean: LayerNorm and RMSNorm agree on zero-mean data to
    about 1/sqrt(width), and differ plainly here."""
    return tuple(a + 3.0 if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


def _gradients(run: Callable[..., Any], args: tuple[Any, ...], module: nn.Module,
               grad_seed: int) -> list[torch.Tensor | None]:
    """Gradients of `run(*args)` (keyword arguments bound into `run`) with respect to the
    floating positional inputs and the module's parameters, for seeded output grads."""
    inputs = [a.detach().clone().requires_grad_(True)
              if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    out = run(*inputs)
    outs = [o for o in torch.utils._pytree.tree_leaves(out)
            if isinstance(o, torch.Tensor) and o.requires_grad]
    generator = torch.Generator(device="cpu").manual_seed(grad_seed)
    grads_out = [torch.randn(o.shape, generator=generator).to(o) for o in outs]
    wrt = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad] + \
        [p for p in module.parameters() if p.requires_grad]
    return list(torch.autograd.grad(outs, wrt, grads_out, allow_unused=True))


@dataclass
class _Verdict:
    ok: bool
    detail: str


class _Recorder:
    """Wraps a kernel to keep the arguments of its first call (what the op receives)."""

    def __init__(self, kernel: BoundKernel) -> None:
        self.kernel = kernel
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.calls:
            self.calls.append(bind_arguments(self.kernel.op, args, kwargs))
        return self.kernel(*args, **kwargs)


class _Watched:
    """Wraps an implementation's kernel to compare the kind of each output (number of
    outputs, dtypes, shapes) with the reference's on the same arguments: a kernel whose
    output the module casts (a down projection under autocast) still has it named. It also
    holds the kernel to its rule of leaving its inputs alone (the first-use check's
    write_problem): a kernel that scaled its input in place and returned it passed the gate
    with "max rel error 0", the module's output compared against itself."""

    def __init__(self, kernel: BoundKernel, reference: BoundKernel) -> None:
        self.kernel, self.reference = kernel, reference
        self.mismatch: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.mismatch is not None:
            return self.kernel(*args, **kwargs)
        bound = bind_arguments(self.kernel.op, args, kwargs)
        before = snapshot_inputs(self.kernel.op, bound)
        with torch.no_grad():  # first: on the inputs as the module gave them
            expected = self.reference(*args, **kwargs)
        out = self.kernel(*args, **kwargs)
        problem = write_problem(out, before)
        if problem is not None:
            restore_inputs(before)
            self.mismatch = problem
            return expected
        problem = output_mismatch(out, expected)
        if problem is not None:
            self.mismatch = f"{problem} (called with {describe_tensors(bound)})"
        return out


@dataclass
class _Probe:
    """One input the gate checks an implementation on: the module's arguments, its output
    through the reference (None: computed when needed), and how the verdict names it."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    reference_out: Any = None
    label: str = ""
    ran: bool = True  # whether reference_out is known


def _probe_label(args: tuple[Any, ...]) -> str:
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None:
        return " on a synthetic input"
    return f" on a synthetic {dtype_name(first.dtype)}{list(first.shape)} input"


@dataclass
class _Gate:
    """Checks candidates on one model's modules, sharing verdicts between identical calls."""

    ctx: PassContext
    measure: bool
    verdicts: dict[tuple[Any, ...], _Verdict] = field(default_factory=dict)

    @contextmanager
    def rng(self) -> Iterator[None]:
        """The caller's random state untouched, the device's too: synthetic inputs and
        seeded runs draw from a forked generator."""
        device = self.ctx.backend.device
        forked = [] if device.type == "cpu" else [device.index or 0]
        try:
            rng = torch.random.fork_rng(devices=forked, device_type=device.type)
            rng.__enter__()
        except (AttributeError, RuntimeError):  # a device type torch cannot fork
            rng = torch.random.fork_rng(devices=[])
            rng.__enter__()
        try:
            yield
        finally:
            rng.__exit__(None, None, None)

    @contextmanager
    def _isolated(self) -> Iterator[None]:
        """Forked RNG seeded alike for every run, under the model's autocast."""
        device_type = self.ctx.backend.device.type
        dtype = self.ctx.state.get("autocast_dtype")
        autocast = torch.autocast(device_type, enabled=False) if dtype is None \
            else torch.autocast(device_type, dtype=dtype)
        with self.rng(), autocast:
            torch.manual_seed(0)
            yield

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._isolated():
            return fn(*args, **kwargs)

    def seconds(self, fn: Callable[[], Any], repeats: int = 15) -> float:
        """Median seconds per call, the device synchronised around each."""
        sync = self.ctx.backend.synchronize
        times = []
        with self._isolated(), torch.no_grad():
            out = fn()
            for _ in range(repeats):
                sync()
                del out
                started = clock()
                out = fn()  # held through the sync: a lazy device (XLA) runs it only then
                sync()
                times.append(clock() - started)
            del out
        return statistics.median(times)

    def check(self, module: nn.Module, pattern: ModulePattern, facts: dict[str, Any],
              candidate: Candidate, args: tuple[Any, ...], reference_out: Any,
              kwargs: dict[str, Any] | None = None,
              more: Callable[[], list[_Probe]] | None = None) -> _Verdict:
        """The verdict on `candidate` for this module's call (`args`, `kwargs`, whose
        output through the reference is `reference_out`) and the probes `more()` makes
        (computed only when the verdict is not known yet)."""
        kwargs = kwargs or {}
        op_call = self.op_call(module, pattern, facts, args, kwargs)
        key = (candidate.provider, candidate.implementation.name, pattern.name,
               self.ctx.training, _signature(args, kwargs), _signature(op_call))
        known = self.verdicts.get(key)
        if known is None:
            probes = [_Probe(args, kwargs, reference_out)] + (more() if more else [])
            known = self.verdicts[key] = self._check(module, pattern, facts, candidate,
                                                     probes, op_call)
        return known

    def op_call(self, module: nn.Module, pattern: ModulePattern, facts: dict[str, Any],
                args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The op's arguments when the module runs this call (empty: it did not call it)."""
        recorder = _Recorder(bind(None, None, pattern.op))
        with torch.no_grad():
            self.run(pattern.forward, module, recorder, facts, *args, **kwargs)
        return recorder.calls[0] if recorder.calls else ()

    def _reference_run(self, module: nn.Module, pattern: ModulePattern,
                       facts: dict[str, Any], probe: _Probe) -> tuple[Any, ...] | None:
        """Fill in `probe.reference_out`; returns the op's arguments in that run (None: the
        pattern cannot run this probe, which is then skipped)."""
        recorder = _Recorder(bind(None, None, pattern.op))
        try:
            with torch.no_grad():
                probe.reference_out = self.run(pattern.forward, module, recorder, facts,
                                               *probe.args, **probe.kwargs)
        except Exception as exc:
            logger.debug("gate probe%s skipped: %s", probe.label, exc)
            return None
        probe.ran = True
        return recorder.calls[0] if recorder.calls else ()

    def _check(self, module: nn.Module, pattern: ModulePattern, facts: dict[str, Any],
               candidate: Candidate, probes: list[_Probe], op_call: tuple[Any, ...]
               ) -> _Verdict:
        impl = candidate.implementation
        declined = decline_reason(impl, op_call) if op_call else None
        if isinstance(declined, DeclinesRaised):
            return _Verdict(False, declined)
        if declined is not None:
            return _Verdict(False, f"declines this module's call: {declined}")
        kernel = bind(impl, candidate.provider, pattern.op)
        reference = bind(None, None, pattern.op)
        args, kwargs = probes[0].args, probes[0].kwargs
        dtype = first_floating_dtype(args) or torch.float32
        tol = _tolerance(dtype, self.ctx)
        checked, label, first_error = 0, "", 0.0
        try:
            for probe in probes:
                label = probe.label
                if not probe.ran:
                    call = self._reference_run(module, pattern, facts, probe)
                    declined = decline_reason(impl, call) if call else None
                    if isinstance(declined, DeclinesRaised):
                        return _Verdict(False, declined + probe.label)
                    if call is None or declined is not None:
                        continue  # the reference runs such calls at run time too
                probe_dtype = first_floating_dtype(probe.args) or torch.float32
                probe_tol = _tolerance(probe_dtype, self.ctx)
                watched = _Watched(kernel, reference)
                with torch.no_grad():
                    out = self.run(pattern.forward, module, watched, facts, *probe.args,
                                   **probe.kwargs)
                if watched.mismatch is not None:
                    return _Verdict(False, watched.mismatch + probe.label)
                ours, theirs = _compared(pattern, probe.reference_out), _compared(pattern, out)
                mismatch = output_mismatch(theirs, ours)
                if mismatch is not None:
                    return _Verdict(False, f"the module's output {mismatch}{probe.label}")
                error = relative_error(theirs, ours)
                if not error <= probe_tol:
                    return _Verdict(False, f"differs from the reference by {error:.3g} "
                                           f"(tolerance {probe_tol:g} in {probe_dtype})"
                                           f"{probe.label}")
                checked += 1
                if probe is probes[0]:
                    first_error = error
            error, label = first_error, ""
            if self.ctx.training:
                theirs = self.run(_gradients, lambda *a: _compared(pattern, pattern.forward(
                    module, kernel, facts, *a, **kwargs)), args, module, 0)
                ours = self.run(_gradients, lambda *a: _compared(pattern, pattern.forward(
                    module, reference, facts, *a, **kwargs)), args, module, 0)
                error = relative_error(theirs, ours)
                if not error <= tol:
                    return _Verdict(False, f"gradients differ from the reference's by "
                                           f"{error:.3g} (tolerance {tol:g} in {dtype})")
            if self.measure:
                fast = self.seconds(lambda: pattern.forward(module, kernel, facts, *args,
                                                            **kwargs))
                slow = self.seconds(lambda: module.forward(*args, **kwargs))
                if fast > slow:
                    return _Verdict(False, f"slower than the module's own code ({fast * 1e6:.0f}"
                                           f" us vs {slow * 1e6:.0f} us)")
                ratio = f"{slow / fast:.2f}x" if fast > 0 else "faster than"
                return _Verdict(True, f"max rel error {error:.2g}, {ratio} the "
                                      "module's own code")
        except Exception as exc:
            return _Verdict(False, f"raised {type(exc).__name__}: {short(exc)}{label}")
        inputs = f" ({checked} inputs checked)" if checked > 1 else ""
        return _Verdict(True, f"max rel error {error:.2g}{inputs}")

    def formula_error(self, module: nn.Module, pattern: ModulePattern, facts: dict[str, Any],
                      args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                      captured: bool = False) -> tuple[float, Any]:
        """(how far the pattern's forward with the reference is from the module's own
        output, the pattern's output on the call): on the call, and on a shifted synthetic
        input in the module's dtype. With `captured`, a module no synthetic input can call
        (its forward needs more than the pattern can make up) is checked on the call alone."""
        kwargs = kwargs or {}
        reference = bind(None, None, pattern.op)
        try:
            probe: tuple[Any, ...] | None = _shifted(
                pattern.example_input(module, facts, _parameter_dtype(module)))
        except Exception:
            if not captured:
                raise
            probe = None
        with torch.no_grad():
            reference_out = self.run(pattern.forward, module, reference, facts, *args,
                                     **kwargs)
            error = relative_error(_compared(pattern, reference_out),
                                   _compared(pattern, self.run(module, *args, **kwargs)))
            if probe is not None:
                error = max(error, relative_error(
                    _compared(pattern, self.run(pattern.forward, module, reference, facts,
                                                *probe)),
                    _compared(pattern, self.run(module, *probe))))
        return error, reference_out


def _compared(pattern: ModulePattern, output: Any) -> Any:
    return output if pattern.compared is None else pattern.compared(output)


# --- the pass ------------------------------------------------------------------------------

def _pattern_problem(result: object) -> str | None:
    if not isinstance(result, (list, tuple)) or not all(
            isinstance(p, ModulePattern) for p in result):
        return f"returned {result!r:.60}, expected a list of ModulePattern"
    return None


def module_patterns(ctx: PassContext) -> list[tuple[str, ModulePattern]]:
    """Plugins' patterns first (tryfirst plugins before vendor plugins), then the core's."""
    host = get_plugin_host()
    found: list[tuple[str, ModulePattern]] = []
    for plugin, patterns in host.call_each("torchbridge_module_patterns",
                                           check=_pattern_problem, backend=ctx.backend):
        found.extend((plugin, p) for p in patterns)
    found.extend(("torchbridge", p) for p in (*BUILTIN_PATTERNS, HF_ATTENTION))
    return found


def _matches(model: nn.Module, ctx: PassContext
             ) -> list[tuple[str, nn.Module, ModulePattern, dict[str, Any]]]:
    patterns = module_patterns(ctx)
    found = []
    for name, module in model.named_modules():
        if getattr(type(module), "_torchbridge_substituted", False):
            continue
        for plugin, pattern in patterns:
            try:
                facts = pattern.match(module)
            except Exception as exc:
                get_plugin_host().record_hook_error(plugin, "torchbridge_module_patterns",
                                                    f"pattern {pattern.name}: {exc}")
                continue
            if facts is not None:
                found.append((name or "(model)", module, pattern, facts))
                break
    return found


Call = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass
class _Captured:
    """The modules the sample run called (by id), and their inputs (positional, and the
    keywords a `**kwargs` parameter takes): one copy per input signature, shared by the
    modules that were called with that signature."""

    ran: set[int] = field(default_factory=set)
    signature_of: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    inputs: dict[tuple[Any, ...], Call] = field(default_factory=dict)

    def call(self, module: nn.Module) -> Call | None:
        signature = self.signature_of.get(id(module))
        return None if signature is None else self.inputs[signature]


def _capture_inputs(model: nn.Module, modules: list[nn.Module], ctx: PassContext,
                    gate: _Gate) -> _Captured:
    """The matched modules' inputs from one run of the sample input, in eval mode (no
    running statistic moves), RNG forked; the model's modes are restored after. When the
    run fails, nothing is captured (synthetic inputs then)."""
    from torchbridge.optimize.measure import sample_call

    captured = _Captured()

    def copy(value: Any) -> Any:
        return value.detach().clone() if isinstance(value, torch.Tensor) else value

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured.ran.add(id(module))
        keywords: dict[str, Any] = {}
        if kwargs:  # keywords become positions where the forward's signature allows
            try:
                bound = inspect.signature(module.forward).bind(*args, **kwargs)
            except TypeError:
                return
            args, keywords = bound.args, bound.kwargs
        if not args or id(module) in captured.signature_of:
            return
        signature = (type(module), _signature(args, keywords))
        captured.signature_of[id(module)] = signature
        captured.inputs.setdefault(signature, (
            tuple(torch.utils._pytree.tree_map(copy, a) for a in args),
            {k: torch.utils._pytree.tree_map(copy, v) for k, v in keywords.items()}))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            gate.run(sample_call(ctx.backend, ctx.sample_input), model)
    except Exception as exc:
        ctx.notes.append(f"kernel_substitution: the sample input did not run ({exc}); "
                         "checked on synthetic inputs")
        captured = _Captured()
    finally:
        for handle in handles:
            handle.remove()
        for m, training in modes.items():
            m.training = training
    return captured


def _takes_keywords(pattern: ModulePattern) -> bool:
    """Whether the pattern's forward takes keyword arguments (**kwargs): patterns written
    for positional calls are checked on synthetic inputs when the captured call has some."""
    try:
        parameters = inspect.signature(pattern.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _synthetic_probes(module: nn.Module, pattern: ModulePattern, facts: dict[str, Any],
                      dtype: torch.dtype, ctx: PassContext) -> list[_Probe]:
    """Without a sample input, the inputs the gate checks an implementation on besides the
    first synthetic one: the same shape in the autocast dtype when the model computes
    under autocast (what a module after a projection receives), and a larger, odd-sized
    input (pattern.larger_input, else the first one grown) in each of those dtypes. At
    most three, each about one short sequence of the module's width."""
    dtypes = [dtype]
    autocast: torch.dtype | None = ctx.state.get("autocast_dtype")
    if autocast is not None and autocast != dtype and dtype.is_floating_point:
        dtypes.append(autocast)
    probes: list[_Probe] = []

    def larger(probe_dtype: torch.dtype) -> tuple[Any, ...]:
        if pattern.larger_input is not None:
            return pattern.larger_input(module, facts, probe_dtype)
        return grown_input(pattern.example_input(module, facts, probe_dtype))

    for i, probe_dtype in enumerate(dtypes):
        makers = [larger] if not i else [
            lambda d: pattern.example_input(module, facts, d), larger]
        for make in makers:
            try:
                args = make(probe_dtype)
            except Exception as exc:  # the pattern's code: this probe is skipped
                logger.debug("gate probe for %s skipped: %s", pattern.name, exc)
                continue
            probes.append(_Probe(args, {}, label=_probe_label(args), ran=False))
    return probes


def _parameter_dtype(module: nn.Module) -> torch.dtype:
    # The ops have no autocast rule: a norm on a float32 residual stream runs in float32
    # under autocast too. The gate runs under the model's autocast all the same.
    return next((p.dtype for p in module.parameters() if p.is_floating_point()),
                torch.float32)


def _substitute_kernels(model: nn.Module, ctx: PassContext) -> nn.Module:
    gate = _Gate(ctx, measure=bool(ctx.state.get("measure")) and ctx.sample_input is not None)
    with gate.rng():
        return _substitute_with(model, ctx, gate)


def _substitute_with(model: nn.Module, ctx: PassContext, gate: _Gate) -> nn.Module:
    matches = _matches(model, ctx)
    captured = _capture_inputs(model, [m for _, m, _, _ in matches], ctx, gate) \
        if ctx.sample_input is not None else _Captured()
    records: list[dict[str, Any]] = ctx.state.setdefault("kernel_substitutions", [])
    # One choice per (op, dtype) for the run: asking every plugin again for each of thirty
    # identical layers would give the same answer.
    choices: dict[tuple[str, torch.dtype], KernelChoice] = {}
    # One checked kernel per implementation, shared by the modules it is substituted into.
    kernels: dict[tuple[str, str, int], BoundKernel] = {}
    for name, module, pattern, facts in matches:
        record: dict[str, Any] = {"module": name, "pattern": pattern.name, "op": pattern.op}
        records.append(record)
        if captured.ran and id(module) not in captured.ran:
            record.update(status="kept", detail="not called when the model ran the sample "
                          "input (another code path computes it)")
            continue
        call = captured.call(module)
        if call is not None and call[1] and not _takes_keywords(pattern):
            call = None  # keyword arguments its forward cannot take: synthetic inputs
        try:
            if call is not None and pattern.replay is not None:
                call = pattern.replay(module, facts, *call)
            args, kwargs = call or (pattern.example_input(
                module, facts, _parameter_dtype(module)), {})
            # Under the model's autocast, as the other runs: a misfit may run the forward.
            misfit = gate.run(pattern.misfit, module, facts, *args, **kwargs) \
                if pattern.misfit else None
            if misfit is None:
                error, reference_out = gate.formula_error(module, pattern, facts, args,
                                                          kwargs, call is not None)
        except Exception as exc:  # the pattern's code on a call it did not foresee
            record.update(status="kept", detail=f"the {pattern.name} pattern could not run "
                          f"its check: {type(exc).__name__}: {exc}")
            continue
        if misfit is not None:
            record.update(status="kept", detail=f"the op's contract does not fit: {misfit}")
            continue
        dtype = first_floating_dtype(args) or torch.float32
        if not error <= _tolerance(dtype, ctx):
            record.update(status="kept", detail=f"not a {pattern.name}: its output differs "
                          f"from the {pattern.op} formula by {error:.3g}")
            continue
        # Implementations are chosen for the dtype the op is called in, which autocast
        # may make the module's matmuls' (attention's q, k, v), not its input's.
        op_dtype = first_floating_dtype(gate.op_call(module, pattern, facts, args, kwargs)) \
            or dtype
        choice = choices.get((pattern.op, op_dtype))
        if choice is None:
            choice = choices[(pattern.op, op_dtype)] = choose(
                pattern.op, ctx.backend, dtype=op_dtype, training=ctx.training,
                info=ctx.device_info)
        rejected = choice.reasons()
        def more(module: nn.Module = module, pattern: ModulePattern = pattern,
                 facts: dict[str, Any] = facts, dtype: torch.dtype = dtype,
                 synthetic: bool = call is None) -> list[_Probe]:
            return _synthetic_probes(module, pattern, facts, dtype, ctx) if synthetic else []

        for candidate in choice.eligible:
            verdict = gate.check(module, pattern, facts, candidate, args, reference_out,
                                 kwargs, more)
            label = f"{candidate.implementation.name} (plugin {candidate.provider})"
            if not verdict.ok:
                rejected.append(f"{label}: {verdict.detail}")
                logger.warning("kernel %s refused for %s: %s", label, name, verdict.detail)
                continue
            kernel = _checked_kernel(choice, candidate, kernels)
            substitute(module, pattern, kernel, facts)
            record.update(status="substituted", implementation=candidate.implementation.name,
                          plugin=candidate.provider, detail=verdict.detail)
            kernel.on_refusal.append(functools.partial(_refused_later, record))
            break
        else:
            record.update(status="kept", detail="the module's own code runs: " + (
                "; ".join(rejected) if rejected else "no implementation for this backend"))
        record["rejected"] = rejected
    return model


def _checked_kernel(choice: KernelChoice, candidate: Candidate,
                    kernels: dict[tuple[str, str, int], BoundKernel]) -> BoundKernel:
    """The kernel a substituted module calls: checked as `torchbridge.get_kernel`'s are
    (BoundKernel.checked). The gate saw the module's captured call (or synthetic ones);
    the module's later calls bring other batch sizes, sequence lengths, layouts and masks,
    and each new signature among them is checked against the reference once, on first
    use; an implementation failing one is refused for the process and the call gets the
    reference's output. After that, a call costs a signature lookup. One kernel per
    implementation for the run: thirty identical layers share its checks."""
    key = (choice.op, candidate.provider, id(candidate.implementation))
    kernel = kernels.get(key)
    if kernel is None:
        kernel = kernels[key] = choice.bound(candidate)
        kernel.checked = True
    return kernel


def _refused_later(record: dict[str, Any], message: str) -> None:
    """A substituted module's kernel refused at a call after the gate passed it: its kernel
    line says so (the module calls the op's reference from then on), not "substituted"."""
    if record.get("status") == "substituted":
        record.update(status="refused", detail=f"{message} (from then on the module "
                      f"calls the {record.get('op')} reference)")


def _check(model: nn.Module, ctx: PassContext) -> str | None:
    known_ops()  # the ops plugins declare exist from here on, whatever the verdict
    if not ctx.config.kernel.enabled:
        return "config kernel.enabled is False"
    if not ctx.config.kernel.substitute:
        return "config kernel.substitute is False"
    matched_ops = sorted({pattern.op for _, _, pattern, _ in _matches(model, ctx)})
    if not matched_ops:
        return "no module matches a kernel pattern"
    served = [op for op in matched_ops if choose(op, ctx.backend, training=ctx.training,
                                                 info=ctx.device_info).eligible]
    if not served:
        return (f"no kernel implementation serves {', '.join(matched_ops)} on "
                f"{ctx.backend.name} (see `torchbridge kernels`)")
    return None


def kernel_substitution_pass() -> OptimizationPass:
    from torchbridge.levels import OptimizationLevel

    return OptimizationPass(
        KERNEL_SUBSTITUTION_PASS, "modules that compute a TorchBridge op call the chosen "
        "implementation, after checking its numbers on the model's shapes",
        OptimizationLevel.O3, _substitute_kernels, _check, order=70, effect=_substituted)


def _substituted(model: nn.Module, ctx: PassContext) -> str | None:
    """The pass's effect: at least one module runs an implementation (the records of the
    modules looked at stay in the report either way)."""
    records = ctx.state.get("kernel_substitutions", [])
    if any(r.get("status") == "substituted" for r in records):
        return None
    return f"no module was substituted ({len(records)} looked at: the report's kernel " \
           "lines say why each kept its own code)"
