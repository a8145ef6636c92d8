"""Changing how a model runs without wrapping it: its forward is replaced on the instance.

A wrapper module (an autocast module, torch.compile's OptimizedModule) hides the model: its
attributes and methods (a Hugging Face model's `config` and `generate()`), its class for
isinstance, and its state_dict keys (`module.`, `_orig_mod.` prefixes). Setting `forward`
on the instance keeps the model the object it was: nn.Module.__call__ finds the new forward,
so hooks still fire around it, and `generate()`, which calls `self(...)`, runs it too.

Each installed forward gets its own code object: torch.compile keeps compiled graphs per
code object and falls back to eager after `recompile_limit` (8) variants, so prepared
models sharing one forward function would run uncompiled from the ninth on.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import operator
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from torchbridge import trees
from torchbridge.errors import ModelOptimizationError
from torchbridge.optimize.kv_cache import same_dtype_updates
from torchbridge.suggestions import shortened

logger = logging.getLogger(__name__)


def _own_code(fn: Callable[..., Any], like: Callable[..., Any]) -> Callable[..., Any]:
    assert isinstance(fn, types.FunctionType)
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                               fn.__defaults__, fn.__closure__)
    # HF generate() reads forward's signature (which arguments it may pass): keep it.
    functools.update_wrapper(fresh, like)
    return fresh


_RECIPE = "_torchbridge_forward_recipe"
# The instance attributes install_forward (and watch_dtype_conversion) set: how the model
# runs, not what it holds.
FORWARD_KEYS = frozenset({"forward", "__deepcopy__", "__reduce_ex__", _RECIPE, "_apply"})
# On a module with a forward of its own, once its model was converted to another floating
# dtype after prepare_model (watch_dtype_conversion): that dtype.
CONVERTED = "_torchbridge_converted_to"
# On a model whose weights low_precision_weights stored in low precision: which, to put
# back when it trains (training_weights.py); once they are back in a dtype of their own
# (training, a conversion), why, for the report.
LOW_PRECISION_CAST = "_torchbridge_low_precision_weights"
WEIGHTS_RESTORED = "_torchbridge_weights_restored"


def install_forward(model: nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]],
                    redo: Callable[[nn.Module], Any] | None = None) -> None:
    """model.forward = make(current forward), with its own code object. `redo(copy)`
    installs the same on a deep copy: a forward held on the instance would otherwise be
    copied as it is and run the original model's weights."""
    inner = model.forward
    model.forward = _own_code(make(inner), inner)  # type: ignore[method-assign]
    model.__dict__[_RECIPE] = [*model.__dict__.get(_RECIPE, []), redo]  # a new list:
    # a snapshot taken before this pass holds the old one
    # copy.deepcopy looks __deepcopy__ up on the instance: the copy gets its own forward.
    model.__dict__["__deepcopy__"] = types.MethodType(_deepcopy_prepared, model)
    # So does pickle __reduce_ex__: the installed forward (compiled, autocast) is a closure
    # that does not pickle, and torch.save(model) failed with "Can't pickle <function
    # Sequential.forward>: it's not the same object as ...". It now says what to do.
    model.__dict__["__reduce_ex__"] = types.MethodType(_refuse_pickling, model)


def _refuse_pickling(model: nn.Module, protocol: Any) -> Any:
    raise ModelOptimizationError(
        f"this {type(model).__name__} was prepared by prepare_model, which runs it through "
        "a forward of its own (compiled, under autocast, ...) that does not pickle: save "
        "its weights instead (model.state_dict(), or torchbridge.save_checkpoint(model, "
        "path)), load them into the model as built, and prepare that again")


def _deepcopy_prepared(model: nn.Module, memo: dict[int, Any]) -> nn.Module:
    state = {k: v for k, v in model.__dict__.items() if k not in FORWARD_KEYS}
    recipe = model.__dict__.get(_RECIPE, [])
    copied = model.__class__.__new__(model.__class__)
    memo[id(model)] = copied
    copied.__dict__.update(copy.deepcopy(state, memo))
    for redo in recipe:
        if redo is not None:
            redo(copied)
    return copied


def autocast_forward(model: nn.Module, device_type: str, dtype: torch.dtype,
                     out_dtype: torch.dtype, fresh: bool = True) -> None:
    """Forward under torch.autocast; floating outputs in `dtype` come back in `out_dtype`
    (the model's own dtype), in the same containers. `fresh` False: installed again on a
    deep copy, which keeps the original's conversion (CONVERTED) as it stands."""

    # Registering an output type pytree does not know yet is Python bookkeeping that
    # dynamo cannot trace: that first time, the cast runs outside the compiled region.
    # Once the types are known (the autocast check on the sample input registers them),
    # the cast is traced with the model: a break at the end of the graph cost a second
    # compiled frame with its own guards, measured 2-10% of a call (ViT 8.70 against
    # 8.23 ms, ResNet-18-like 4.06 against 3.71 ms, O3 on the 2-core AMD EPYC).
    # Decorated here, not at import: torch.compiler.disable imports torch._dynamo (about
    # 1.5 s), which get_backend() must not pay (tests/test_startup.py).
    cast_back_eager = torch.compiler.disable(_cast_back)  # type: ignore[no-untyped-call,unused-ignore]
    # Setting attributes on a cache object is nothing for dynamo to trace (a compiled
    # forward only meets a cache where the sample input holds one).
    caches_eager = torch.compiler.disable(same_dtype_updates)  # type: ignore[no-untyped-call,unused-ignore]

    def make(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if CONVERTED in model.__dict__:
                return inner(*args, **kwargs)
            if kwargs.get("past_key_values") is not None:
                caches_eager(kwargs["past_key_values"])
            with torch.autocast(device_type=device_type, dtype=dtype):
                out = inner(*args, **kwargs)
            if torch.compiler.is_compiling() and trees.known_types(out):
                return _cast_back(out, dtype, out_dtype)
            return cast_back_eager(out, dtype, out_dtype)
        return forward

    if fresh:
        for module in model.modules():  # left by an earlier preparation of this model
            module.__dict__.pop(CONVERTED, None)
    install_forward(model, make, lambda twin: autocast_forward(twin, device_type, dtype,
                                                               out_dtype, fresh=False))
    watch_dtype_conversion(model, out_dtype)


def watch_dtype_conversion(model: nn.Module, out_dtype: torch.dtype) -> None:
    """`model.half()`, `.double()`, `.bfloat16()` or `.to(dtype)` after prepare_model make
    its floating parameters one dtype: from then on the model computes in that dtype as
    converted, without autocast and without casting outputs back (each module with a
    forward of its own is marked CONVERTED). Autocast in bfloat16 had kept computing a
    float64 model in bfloat16, returned float32 from a bfloat16 one, and a float16 one
    raised ("mixed dtype (CPU)"). Converted back to `out_dtype`, the model's own dtype, it
    runs under autocast again. Either way the weights low_precision_weights cast are in a
    dtype of their own from then on (WEIGHTS_RESTORED, for the report; nothing to restore
    for training). A move to another device (the same dtypes) changes nothing. Installed as
    the instance's `_apply`, through which every such Module method goes; a conversion of a
    submodule alone is not seen."""

    def _apply(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        before = _floating_dtypes(model)
        out = type(model)._apply(model, fn, *args, **kwargs)  # type: ignore[no-untyped-call,unused-ignore]
        after = _floating_dtypes(model)
        if after != before and len(after) == 1:
            (now,) = after
            if model.__dict__.pop(LOW_PRECISION_CAST, None) is not None:
                name = str(now).removeprefix("torch.")
                model.__dict__.setdefault(
                    WEIGHTS_RESTORED, f"the model was converted to {name} after "
                    f"prepare_model returned, so the weights stored in low precision are "
                    f"{name} now")
            for module in model.modules():
                if _RECIPE in module.__dict__:
                    if now == out_dtype:
                        module.__dict__.pop(CONVERTED, None)
                    else:
                        module.__dict__[CONVERTED] = now
            logger.info("%s converted to %s after prepare_model: it computes in %s%s",
                        type(model).__name__, now, now, "" if now != out_dtype else
                        " under autocast again")
        return out

    model.__dict__["_apply"] = _apply


def _floating_dtypes(model: nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters() if p.is_floating_point()}


def _cast_back(out: Any, dtype: torch.dtype, out_dtype: torch.dtype) -> Any:
    return trees.map_tensors(lambda t: t.to(out_dtype) if t.dtype == dtype else t, out)


def autocast_when_called_alone(module: nn.Module, device_type: str, dtype: torch.dtype,
                                out_dtype: torch.dtype) -> None:
    """A module holding low-precision weights runs under autocast also when it is called
    outside the model's forward, which autocast covers: transformers' generate() calls an
    encoder-decoder's encoder directly (T5, BART, Whisper), CLIP's feature methods its
    text and vision models; their float32 activations met bfloat16 weights there ("mat1
    and mat2 must have the same dtype"). Its floating outputs in `dtype` come back in
    `out_dtype` then, as the model's own forward returns them. Inside the model's
    forward, one check of the autocast state."""

    def make(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if torch.is_autocast_enabled(device_type) or CONVERTED in module.__dict__:
                return inner(*args, **kwargs)
            if kwargs.get("past_key_values") is not None:
                same_dtype_updates(kwargs["past_key_values"])
            with torch.autocast(device_type=device_type, dtype=dtype):
                out = inner(*args, **kwargs)
            return _cast_back(out, dtype, out_dtype)
        return forward

    install_forward(module, make, lambda twin: autocast_when_called_alone(
        twin, device_type, dtype, out_dtype))


def outputs_cast_back(module: nn.Module, dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    """A module's floating outputs in `dtype` come back in `out_dtype`: an embedding whose
    weight low_precision_weights stored in `dtype` (it is tied to an LM head) gives the
    model's own dtype, as it did, wherever it is called from."""

    def make(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if CONVERTED in module.__dict__:
                return inner(*args, **kwargs)
            return _cast_back(inner(*args, **kwargs), dtype, out_dtype)
        return forward

    install_forward(module, make, lambda twin: outputs_cast_back(twin, dtype, out_dtype))


class CompileState:
    """What the compiled forward of one model went through: the first error, if any, and
    the call signature it is compiled for; and what it was compiled with (torch.compile's
    options, inductor settings around its calls), so that passes can show their effect."""

    def __init__(self, options: dict[str, Any] | None = None,
                 inductor_config: dict[str, Any] | None = None) -> None:
        self.error: BaseException | None = None
        self.signature: tuple[int, frozenset[str]] | None = None
        # Signatures of calls that ran uncompiled because they differ from `signature`
        # (each logged once): what a user asks about when such calls are slow.
        self.uncompiled_signatures: set[tuple[int, frozenset[str]]] = set()
        self.bypass = False  # calls run the uncompiled forward (timing it against this)
        self.options = dict(options or {})
        self.inductor_config = dict(inductor_config or {})
        # Why the compiled forward is no longer used though it did not fail: it froze the
        # weights (inductor freezing), and they changed since. Calls run uncompiled then.
        self.stale: str | None = None
        self.frozen: FrozenTensors | None = None  # what it froze, watched while it runs
        self.code: types.CodeType | None = None  # the code object torch.compile compiles

    def recompile_limit_reached(self) -> str | None:
        """Why dynamo compiles this forward no more, or None: it holds as many compiled
        variants as torch._dynamo.config.recompile_limit allows, so that a call matching
        none of them (a guard that fails at every call) runs uncompiled (eager). Read from
        dynamo's cache on the forward's own code object: cheap, not done on every call."""
        if self.code is None or "torch._dynamo" not in sys.modules:
            return None
        try:
            from torch._dynamo import config as dynamo_config
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            entries = len(_debug_get_cache_entry_list(self.code))
            limit = int(dynamo_config.recompile_limit)
        except Exception:  # another torch, without them: nothing to tell
            return None
        if entries < limit:
            return None
        # Not torch.compiler.config.allow_unspec_int_on_nn_module set around the traced
        # call (torch._dynamo.patch_dynamo_config): it ended the recompiles of a forward
        # counting its calls in an int attribute, but a forward with a graph break then
        # entered the setting at run time, at every call (23 against 59 us a call, a
        # two-Linear model with one break, 2-core AMD EPYC).
        return (f"dynamo compiled it {entries} times, its recompile limit "
                f"(torch._dynamo.config.recompile_limit = {limit}): a guard failed call "
                "after call, on a value the forward reads or changes (an int attribute it "
                "counts calls in, a float, a global, an input's rank); calls that match "
                "none of those compiled variants run uncompiled (eager), and dynamo "
                "compiles it no more (an int attribute: set "
                "torch.compiler.config.allow_unspec_int_on_nn_module = True before "
                "preparing, or keep the count in a tensor)")


def call_signature(args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> tuple[int, frozenset[str]]:
    """How a call looks: positional count and the keywords given (None counts as not)."""
    return len(args), frozenset(k for k, v in kwargs.items() if v is not None)


def describe_signature(signature: tuple[int, frozenset[str]]) -> str:
    positional, keywords = signature
    return f"{positional} positional argument(s) and keywords {sorted(keywords) or 'none'}"


def compiled_forward(model: nn.Module, compile: Callable[[Callable[..., Any]], Any],
                     inductor_config: dict[str, Any] | None = None,
                     options: dict[str, Any] | None = None) -> CompileState:
    """Forward compiled by `compile(fn)`. Compiling happens at the first call; if the
    compiled forward raises where the uncompiled one runs, the model keeps running
    uncompiled, with one logged warning, and `state.error` holds the compile error.

    The compiled path serves calls shaped like the first one (the sample input's, when
    prepare_model had one): the same positional count and keywords. Other calls run the
    uncompiled forward. HF `generate()` calls forward with a KV cache, cache positions and
    a shape that grows every step: compiled, each step recompiled or failed guards
    (measured: 0.07x eager tokens per second); uncompiled, decoding runs as the prepared
    but uncompiled model does, while the calls it was prepared for stay compiled.

    `inductor_config`: settings of torch._inductor.config in force around every compiled
    call, so around every compile and recompile (see core_passes._compile for why)."""
    state = CompileState(options, inductor_config)
    freezing = bool((inductor_config or {}).get("freezing"))

    def make(inner: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return inner(*args, **kwargs)

        fresh = _own_code(call, inner)
        state.code = fresh.__code__
        compiled = compile(fresh)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if torch.jit.is_tracing():  # type: ignore[attr-defined,no-untyped-call,unused-ignore]
                # torch.jit.trace records the ops the forward runs; a compiled call fails
                # there, and its error turned compile off for the model's own later calls.
                return inner(*args, **kwargs)
            signature = call_signature(args, kwargs)
            if state.signature is None:
                state.signature = signature
            if state.error is not None or state.bypass or state.stale is not None:
                return inner(*args, **kwargs)
            frozen = state.frozen
            if frozen is not None and (changed := frozen.changed()) is not None:
                state.stale, state.frozen = changed, None  # its copies of buffers go too
                logger.warning("the compiled forward of %s holds its weights as they were "
                               "when it compiled (inductor freezing), and %s; it runs "
                               "uncompiled from now on", type(model).__name__, changed)
                return inner(*args, **kwargs)
            if signature != state.signature:
                if signature not in state.uncompiled_signatures:
                    state.uncompiled_signatures.add(signature)
                    logger.info("%s called with %s: it runs uncompiled (compiled for %s)",
                                type(model).__name__, describe_signature(signature),
                                describe_signature(state.signature))
                out = inner(*args, **kwargs)
            else:
                if freezing and frozen is None:  # before the compile freezes them
                    frozen = state.frozen = FrozenTensors(model)
                try:
                    with _patched_inductor(inductor_config), \
                            _grad_mode_compiled_for(args, kwargs):
                        out = compiled(*args, **kwargs)
                except Exception as exc:
                    out = inner(*args, **kwargs)  # raises the model's own error if it has one
                    state.error, state.frozen = exc, None
                    logger.warning("the compiled forward of %s failed (%s: %s); it runs "
                                   "uncompiled from now on", type(model).__name__,
                                   type(exc).__name__, exc)
                    return out
            if frozen is not None:
                frozen.called()  # what the call itself changed (a buffer it updates) is live
            return out
        return forward

    install_forward(model, make,
                    lambda twin: compiled_forward(twin, compile, inductor_config, options))
    return state


class FrozenTensors:
    """The parameters and buffers of a model whose compiled forward froze them: inductor
    freezing compiles their values into the graph as constants, so that a load_state_dict
    or an in-place write after that compile was taken in part (what the graph kept as
    given, a bias, read live; what it folded or prepacked, a weight, not): the output was
    neither model's. Taken when the forward first compiles; `changed()` says, before
    each call, whether any of them changed since: its version counter (which every
    in-place write moves on) or its storage (`.data = ...`). A tensor replaced in its
    slot makes dynamo compile the forward again, freezing the tensors as they are then:
    those are watched from then on.
    No values are read: before and after a call, 2.2 us for 9 tensors and 25 us for 144
    by themselves; 3.5-3.8 us more on a 28-36 us frozen call of a 9-tensor MLP (min of
    interleaved runs, 2-core AMD EPYC). With other models' calls in between, the reads
    miss the caches: 11 us alone but about 0.12 ms a call for the Hugging Face suite's
    ResNet (74 tensors), timed round-robin with eager and plain compile (1.75 against
    1.63 ms, docs/benchmarks.md). Forwards compiled without freezing pay nothing.

    Buffers are also copied: prepare_model's checks put every buffer back after their
    calls (copy_, which counts as a write), so a buffer written is compared by value
    before it counts as changed. A tensor the forward itself writes (a step counter, a
    running statistic, a cache) is an input of the graph, read live: once a call changed
    it, it is no longer watched."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # The slow paths re-settle several lists in turn: calls from several threads take
        # them one at a time (the fast path reads without it, and a torn read only sends a
        # call down the slow path).
        self._lock = threading.RLock()
        self.take()

    def take(self) -> None:
        """Watch the model's tensors as they are now. prepare_model calls this once more
        as it returns (report.attach_result), to take what its own work after the compile
        left: its checks put the buffers back (copy_), and a distributed wrapper broadcast
        rank 0's weights into the model (DistributedDataParallel: the same values)."""
        # Each slot: the module's table (_parameters, _buffers), the key, the tensor, its
        # name, and a copy of its values where it is a buffer.
        slots: list[tuple[dict[str, Any], str, torch.Tensor, str, torch.Tensor | None]] = []
        # FSDP writes the weights into the model at every call (all-gathered, the same
        # values): nothing here could tell that from a change. Not watched.
        modules = [] if _under_fsdp(self.model) else \
            self.model.named_modules(remove_duplicate=True)
        with torch.no_grad():
            for prefix, module in modules:
                for table in (module._parameters, module._buffers):
                    for key, t in table.items():
                        if not isinstance(t, torch.Tensor):
                            continue
                        copied = t.detach().clone() if table is module._buffers and \
                            _plain(t) else None
                        slots.append((table, key, t, f"{prefix}.{key}" if prefix
                                      else key, copied))
        with self._lock:
            self.slots = slots
            self._settle([self._probe(i) for i in range(len(self.slots))])

    def _settle(self, probes: list[tuple[int, ...] | None]) -> None:
        """Watch the slots whose probes could be taken, as those probes say they are."""
        kept = [i for i, probe in enumerate(probes) if probe is not None]
        self.slots = [self.slots[i] for i in kept]
        self.probes = [probes[i] for i in kept]
        self._tables = [table for table, *_ in self.slots]
        self._keys = [key for _, key, *_ in self.slots]
        plain = [len(probe) == 3 for probe in self.probes if probe is not None]
        self._plain = [t for (_, _, t, *_), p in zip(self.slots, plain, strict=True) if p]
        self._expected = self._read_from(self.probes, plain)

    @staticmethod
    def _read_from(probes: list[Any], plain: list[bool]) -> tuple[list[int], ...]:
        return ([probe[0] for probe in probes],
                [probe[1] for probe, p in zip(probes, plain, strict=True) if p],
                [probe[2] for probe, p in zip(probes, plain, strict=True) if p])

    def _read(self) -> tuple[list[int], ...] | None:
        # C loops (map) over the slots: the tensors in them, and the version counters and
        # storages of the tensors watched.
        try:
            return (list(map(id, map(operator.getitem, self._tables, self._keys))),
                    list(map(_VERSION, self._plain)),
                    list(map(torch.Tensor.data_ptr, self._plain)))
        except Exception:  # a slot emptied: slot by slot
            return None

    def _probe(self, i: int) -> tuple[int, ...] | None:
        table, key, _, _, _ = self.slots[i]
        try:
            t = table[key]
            if not _plain(t):
                return (id(t),)
            return (id(t), t._version, t.data_ptr())
        except Exception:
            return None

    def changed(self) -> str | None:
        """None when every watched tensor is as the compiled forward froze it; else what
        changed, in words. (The tensors are held here: an id is not reused meanwhile.)"""
        if self._read() == self._expected:
            return None
        with self._lock:
            return self._changed()

    def _changed(self) -> str | None:
        if self._read() == self._expected:  # settled by another thread meanwhile
            return None
        if any(table.get(key) is not t for table, key, t, _, _ in self.slots):
            # A tensor replaced in its slot (load_state_dict(assign=True), an attribute
            # set): dynamo's guards hold to each tensor, so the forward compiles again,
            # freezing every tensor as it is now (measured on torch 2.13). Watch those.
            self.take()
            return None
        changed, probes = [], list(self.probes)
        for i, (_, _, t, name, copied) in enumerate(self.slots):
            now = self._probe(i)
            if now == probes[i]:
                continue
            if now is not None and len(now) == 3 and copied is not None and \
                    _same_values(t, copied):  # written back as it was
                probes[i] = now
                continue
            changed.append(name)
        if changed:
            return (f"{shortened(changed, 3)} changed after it compiled (a load_state_dict, an "
                    "in-place write, or its .data replaced)")
        self._settle(probes)
        return None

    def called(self) -> None:
        """After a call: what it wrote (version counters) is the forward's own doing,
        read live by the graph; no longer watched."""
        if list(map(_VERSION, self._plain)) == self._expected[1]:
            return
        with self._lock:
            self._settle([probe if self._probe(i) == probe else None
                          for i, probe in enumerate(self.probes)])


_VERSION = operator.attrgetter("_version")


def _under_fsdp(model: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kinds = tuple(k for k in (getattr(fsdp, "FSDPModule", None),
                              getattr(fsdp, "FullyShardedDataParallel", None))
                  if isinstance(k, type))
    return bool(kinds) and any(isinstance(m, kinds) for m in model.modules())


def _plain(t: torch.Tensor) -> bool:
    """A tensor whose version counter and storage can be read: not an inference tensor
    (no version counter), nor a subclass or a meta tensor (no storage of its own)."""
    return type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided \
        and t.device.type != "meta" and not t.is_inference()


def _same_values(live: torch.Tensor, saved: torch.Tensor) -> bool:
    if live.shape != saved.shape or live.dtype != saved.dtype or live.device != saved.device:
        return False
    with torch.no_grad():
        if torch.equal(live, saved):
            return True
        return (live.is_floating_point() or live.is_complex()) and \
            torch.equal(live.isnan(), saved.isnan()) and \
            torch.equal(live.nan_to_num(0.0), saved.nan_to_num(0.0))


def _grad_mode_compiled_for(args: tuple[Any, ...], kwargs: dict[str, Any]
                            ) -> contextlib.AbstractContextManager[Any]:
    """Calls under torch.inference_mode() run the compiled forward under no_grad instead,
    when no input is an inference tensor: the graphs prepare_model compiled on the sample
    input (under no_grad, as its checks and timing run) then serve them. Dynamo guards on
    the dispatch keys inference mode changes, so the first such call would compile the
    model again: 4.6-6.4 s of the first call for GPT-2, BERT and ViT at O3 on the 2-core
    CI machine. Outputs are then ordinary tensors without grad, which inference-mode code
    can use as its own. An inference tensor input keeps the caller's mode: outside
    inference mode it could not be updated in place."""
    if not torch.is_inference_mode_enabled() or any(
            t.is_inference() for t in trees.tensors((args, kwargs))):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))  # turns grad mode on: then off
    stack.enter_context(torch.no_grad())
    return stack


@contextlib.contextmanager
def _patched_inductor(settings: dict[str, Any] | None) -> Iterator[None]:
    # On every call of a prepared model: set and restore the few settings directly
    # (about 4 us) rather than through inductor_config.patch (about 16 us).
    if not settings:
        yield
        return
    import torch._inductor.config as inductor_config

    # Dotted names ("cpp.weight_prepack") are settings of inductor's nested sections.
    places = [(_section(inductor_config, name), name.rpartition(".")[2]) for name in settings]
    saved = [getattr(owner, attr) for owner, attr in places]
    for (owner, attr), value in zip(places, settings.values(), strict=True):
        setattr(owner, attr, value)
    try:
        yield
    finally:
        for (owner, attr), value in zip(places, saved, strict=True):
            setattr(owner, attr, value)


def _section(config: Any, name: str) -> Any:
    for part in name.split(".")[:-1]:
        config = getattr(config, part)
    return config


@contextlib.contextmanager
def uncompiled(state: CompileState) -> Iterator[None]:
    """Calls inside run the forward the model had before it was compiled."""
    state.bypass = True
    try:
        yield
    finally:
        state.bypass = False


def compile_state(model: nn.Module) -> CompileState | None:
    """The state of the model's compiled forward, found through the forwards installed
    around it (scoped settings, autocast); None when the model is not compiled."""
    todo: list[Any] = [model.__dict__.get("forward")]
    seen: set[int] = set()
    while todo:
        fn = todo.pop()
        if id(fn) in seen or len(seen) > 64:
            continue
        seen.add(id(fn))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, CompileState):
                return value
            if isinstance(value, types.FunctionType):
                todo.append(value)
        # A forward that is an object, not a closure (optimize/first_call.py), names the
        # forward it wraps.
        if not isinstance(fn, types.FunctionType) and hasattr(fn, "__wrapped__"):
            todo.append(fn.__wrapped__)
    return None
