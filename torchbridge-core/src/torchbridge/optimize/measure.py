"""Measuring what passes change: output drift and latency. Used by the pipeline and benchmarks."""

from __future__ import annotations

import contextlib
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from torchbridge import trees
from torchbridge.errors import ModelOptimizationError


def flatten_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a model output, whatever holds them (torchbridge.trees)."""
    return trees.tensors(obj)


def split_sample(sample_input: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sample input as (positional, keyword) call arguments: a tuple is the positional
    arguments, a dict (not a dict subclass such as a ModelOutput) or another mapping that
    is not a dict (a tokenizer's BatchEncoding, a UserDict) the keyword arguments (HF
    style: input_ids=..., attention_mask=...), anything else the one argument."""
    if type(sample_input) is dict or (isinstance(sample_input, Mapping)
                                      and not isinstance(sample_input, dict)):
        if not all(isinstance(k, str) for k in sample_input):
            raise ModelOptimizationError("a dict sample_input holds keyword arguments: its "
                                         f"keys must be strings, got {list(sample_input)!r}")
        return (), dict(sample_input)
    if type(sample_input) is tuple:
        return sample_input, {}
    return (sample_input,), {}


def call_args(backend: Any, sample_input: Any) -> tuple[Any, ...]:
    """A sample input as positional call arguments on the backend's device. Kept for
    passes written before keyword sample inputs; new code uses sample_call."""
    args, kwargs = split_sample(sample_input)
    if kwargs:
        raise ModelOptimizationError("this pass calls the model with positional arguments "
                                     "only; the sample input is keyword arguments")
    moved: tuple[Any, ...] = backend.to_device(args)
    return moved


def sample_call(backend: Any, sample_input: Any) -> Callable[[Any], Any]:
    """`call(model)`: the model called on the sample input, moved to the backend's device
    once. Every call sees the same input values, and the caller's tensors are never passed
    to a model: the calls get a private copy. A model that writes to its input (`x.mul_(2)`)
    would otherwise change the caller's sample and give each later call (O0's reference,
    the check after each pass, the timing) another input, so that every pass looked as if
    it drifted. Tensor version counters tell such a write (an in-place op bumps them, at a
    cost of nothing); the copy is then put back to the sample's values before the next
    call."""
    pristine = backend.to_device(split_sample(sample_input))
    with torch.inference_mode(False):  # version counters: inference tensors have none
        args, kwargs = trees.map_tensors(_private_copy, pristine)
    inputs, originals = trees.tensors((args, kwargs)), trees.tensors(pristine)
    versions = [t._version for t in inputs]

    def call(model: Any) -> Any:
        try:
            return model(*args, **kwargs)
        finally:
            if any(t._version != v for t, v in zip(inputs, versions, strict=True)):
                _restore(inputs, originals)
                versions[:] = [t._version for t in inputs]
    return call


def _private_copy(t: torch.Tensor) -> torch.Tensor:
    copied = t.detach().clone()
    return copied.requires_grad_() if t.requires_grad else copied


def _restore(copies: list[torch.Tensor], originals: list[torch.Tensor]) -> None:
    with torch.no_grad(), torch.inference_mode(False):
        for copied, original in zip(copies, originals, strict=True):
            if copied.shape != original.shape:  # resized in place (x.resize_)
                copied.resize_(original.shape)
            copied.copy_(original)


# What nn.Module keeps in its own __dict__ (parameters, buffers, submodules, hooks): the
# passes and lazy modules change those for good; preserved_state leaves them alone.
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) | {"_compiled_call_impl"}


class _Attributes:
    """A module's own Python attributes (a call counter, a list the forward appends to, a
    tensor it keeps outside its buffers), to put back after calls made to measure: the
    model you pass is left as it was given."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.cls = module, module.__class__
        self.table: dict[str, Any] = {k: v for k, v in module.__dict__.items()
                                      if k not in _MODULE_INTERNALS}
        self.contents: dict[str, Any] = {k: v.copy() for k, v in self.table.items()
                                         if isinstance(v, (list, dict, set))}
        self.tensors: dict[str, torch.Tensor] = {
            k: v.detach().clone() for k, v in self.table.items()
            if isinstance(v, torch.Tensor) and _restorable(v)}

    def restore(self) -> None:
        module = self.module
        if module.__class__ is not self.cls:  # a lazy module materialized: its own change
            return
        now = module.__dict__
        for key in [k for k in now if k not in _MODULE_INTERNALS and k not in self.table]:
            del now[key]
        now.update(self.table)
        for key, saved in self.contents.items():
            container = self.table[key]  # refilled, not compared: tensors compare elementwise
            container.clear()
            if isinstance(container, list):
                container.extend(saved)
            else:
                container.update(saved)
        with torch.no_grad():
            for key, copy in self.tensors.items():
                tensor = self.table[key]
                try:
                    tensor.copy_(copy)
                except RuntimeError:  # resized, or an inference tensor: its values all the same
                    now[key] = copy


_HOOK_DICTS = tuple(k for k, v in sorted(torch.nn.Module().__dict__.items())
                    if "hook" in k and isinstance(v, dict))


def _hooks(modules: list[torch.nn.Module]) -> list[tuple[Any, ...]]:
    """The hooks registered on each module (their handles' ids), to tell whether a call
    registered some."""
    return [tuple(tuple(getattr(m, name, None) or ()) for name in _HOOK_DICTS)
            for m in modules]


def _restorable(t: torch.Tensor) -> bool:
    # Plain tensors only: a Parameter kept as an attribute is an alias of the module's own,
    # which calls do not change (and copying every such weight at every check would cost).
    return type(t) is torch.Tensor and t.layout == torch.strided and t.device.type != "meta"


@contextlib.contextmanager
def preserved_state(model: Any) -> Iterator[None]:
    """Runs inside leave no trace on the model or the process: the global RNG is forked
    (reseeded to 0 inside, so that reference and candidate draw the same dropout masks),
    every buffer (BatchNorm running statistics, step counters, caches) is restored
    afterwards, each module's training flag too, and its own Python attributes (counters,
    lists and dicts the forward fills, tensors kept outside the buffers). Gradients are
    off."""
    modules = list(model.modules())
    training = [m.training for m in modules]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    attributes = [_Attributes(m) for m in modules]
    hooks = _hooks(modules)
    devices = sorted({str(b.device) for b, _ in buffers if b.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(0)
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                if buffer.shape == saved.shape and buffer.dtype == saved.dtype:
                    buffer.copy_(saved)
        for module, flag in zip(modules, training, strict=True):
            module.training = flag
        # A call that registered hooks set the model up for good (transformers registers
        # its output-capturing hooks at the first call asking for hidden states, and marks
        # the model so): its attributes go with the hooks, which stay; putting the mark
        # back made the next call register them twice, and the outputs came back twice.
        if _hooks(modules) == hooks:
            for kept in attributes:
                kept.restore()


def largest_magnitude(t: torch.Tensor) -> float:
    """The largest magnitude in `t` (NaN when it holds a NaN), one pass, no copy."""
    return float(torch.linalg.vector_norm(t, ord=math.inf))


def largest_finite(t: torch.Tensor) -> float:
    """The largest magnitude among the finite values of `t` (0.0 when none is)."""
    largest = largest_magnitude(t)
    if math.isfinite(largest):
        return largest
    finite = t[torch.isfinite(t)]
    return largest_magnitude(finite) if finite.numel() else 0.0


def tensor_drift(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[float, float]:
    """(max abs diff, max abs diff / max finite |reference|) of two same-shape tensors, in
    float32 on the CPU. Equal values (infinities, NaN in both) count as no difference; a
    NaN or infinity in only one of them as an infinite one."""
    if not reference.numel():
        return 0.0, 0.0
    ref32 = reference.detach().float().cpu()
    cand32 = candidate.detach().float().cpu()
    # Where both are finite (the usual case), two reductions give the answer: the rule
    # below for NaN and infinities walks the tensors ten times more. Checking outputs is
    # a part of every first call, six times or more: a pair of 4 x 128 x 16384 float32
    # tensors took 0.19 s a check that way, 0.04 s this way (ad hoc, 2-core EPYC).
    scale = largest_magnitude(ref32)
    if math.isfinite(scale):  # no NaN or infinity in the reference
        diff = largest_magnitude(ref32 - cand32)
        if math.isfinite(diff):  # nor in the candidate
            return diff, diff / scale if scale > 0 else diff
    same = (ref32 == cand32) | (ref32.isnan() & cand32.isnan())
    delta = torch.where(same, torch.zeros_like(ref32), (ref32 - cand32).abs())
    diff = delta.nan_to_num(nan=math.inf, posinf=math.inf).max().item()
    scale = largest_finite(ref32)
    return diff, diff / scale if scale > 0 else diff


class UncheckableOutput(ValueError):
    """The outputs hold nothing the checks can compare (output_drift)."""


def output_drift(reference: Any, candidate: Any) -> tuple[float, float]:
    """(max abs diff, max abs diff / max |reference|) over every tensor and number in the
    outputs (dataclass fields and Python floats included), in float32. Raises ValueError
    naming the difference when the outputs differ in structure, or when they hold objects
    the walker cannot look into and nothing it can compare."""
    problem = trees.structure_difference(reference, candidate)
    if problem is not None:
        raise ValueError(problem)
    max_abs, max_rel = 0.0, 0.0
    compared, opaque = 0, set()
    for ref, cand in zip(trees.leaves(reference), trees.leaves(candidate), strict=True):
        if isinstance(ref, torch.Tensor):
            diff, rel = tensor_drift(ref, cand)
        elif isinstance(ref, (int, float, complex)) and not isinstance(ref, bool):
            diff = abs(ref - cand)
            rel = diff / abs(ref) if ref else diff
        else:  # strings, None, cache objects: their type was checked above
            if ref is not None and not isinstance(ref, (str, bytes, bool)):
                opaque.add(type(ref).__name__)
            continue
        compared += 1
        if diff != diff:  # NaN where the reference has none
            diff = rel = float("inf")
        max_abs, max_rel = max(max_abs, diff), max(max_rel, rel)
    if not compared and opaque:
        # An output object the walker cannot look into (a class of the model's own that is
        # neither a dataclass nor a dict): a drift of 0 would say every pass was checked
        # when none was, and the casts back to the model's dtype would not reach inside.
        raise UncheckableOutput(
            f"the output ({', '.join(sorted(opaque))}) holds no tensor the checks can see, so "
            "no pass can be checked against it: return tensors in a tuple, dict or "
            "dataclass, or register the type with torch.utils._pytree.register_pytree_node")
    return max_abs, max_rel


def median_latency(fn: Callable[[], Any], synchronize: Callable[[], None], *, warmup: int = 3,
                   repeats: int = 10, min_seconds: float = 0.0) -> float:
    """Median wall time of fn() in seconds after `warmup` calls. Keeps repeating past
    `repeats` until `min_seconds` of samples are collected (to tame noise on short calls)."""
    with torch.inference_mode():
        for _ in range(warmup):
            out = fn()
            synchronize()
            del out
        samples: list[float] = []
        started = time.perf_counter()
        while len(samples) < repeats or time.perf_counter() - started < min_seconds:
            t0 = time.perf_counter()
            out = fn()
            synchronize()
            samples.append(time.perf_counter() - t0)
            del out
    return statistics.median(samples)


# How one call is timed: timer(label, fn) runs fn once and returns its seconds. The label
# names the candidate ("O0", "prepared", ...): tests inject a timer that answers by label,
# so that a decision made from a measurement is tested without depending on the machine.
Timer = Callable[[str, Callable[[], Any]], float]


def wall_timer(synchronize: Callable[[], None]) -> Timer:
    """The real timer: wall time of fn() until the device has finished it.

    The output is held until synchronize() returns: on a lazy device (XLA) a sync runs the
    graphs of the tensors still alive, and one whose output was dropped never ran. Timed
    so, an XLA model's calls measured its tracing (0.08 ms against 248 ms run), and the
    race undid compile and autocast on those figures."""
    def time_call(label: str, fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        out = fn()
        synchronize()
        seconds = time.perf_counter() - t0
        del out
        return seconds
    return time_call


# With max_repeats: a candidate this many times slower than the fastest (medians, after
# `repeats` rounds) is timed no more.
OUT_OF_RACE = 1.5


def round_robin(candidates: dict[str, Callable[[], Any]], timer: Timer, *, warmup: int = 3,
                repeats: int = 10, min_seconds: float = 0.2, max_repeats: int | None = None,
                margin: float = 0.05, inference_mode: bool = True,
                baseline: str | None = None) -> dict[str, float]:
    """Median seconds of each candidate, sampled round-robin so that drift in machine state
    (thread pools waking, caches, frequency, a noisy neighbour) falls on all alike.
    Sampling goes on past `repeats` rounds until the samples add up to `min_seconds`
    (counted from the samples, not a clock, so that an injected timer decides it too).

    Each round takes the candidates in another order (shuffled by a generator of its own,
    seeded: the same orders in every run, the global RNG untouched). A call is slower after
    another model's call that left the caches full of its own data: in a fixed order, the
    candidate after the largest one paid for it in every round (two identical O3 models of
    a Hugging Face suite, one timed right after plain compile's float32 model: 5-7% apart
    on all five models, the one after it slower; benchmarks/cpu_freezing.py, 2-core AMD
    EPYC, 2026-11-25).

    With `max_repeats`, sampling stops early once the fastest median leads the next by more
    than `margin`, and goes on to `max_repeats` rounds while they are closer: a clear
    winner costs few calls of the model, a close race gets more samples, and a candidate
    already OUT_OF_RACE times slower than the fastest sits the extra rounds out (its
    median is from the rounds it ran: O0 at 19 ms took half of each extra round of BERT's
    race between 7.5 ms compiled and 8.0 ms uncompiled). After two rounds, one whose
    every sample is OUT_OF_RACE times another's slowest already sits out the rest (O0 at
    222 ms a call against 64 ms compiled: a Llama's first call one O0 call shorter).

    `baseline` (with `max_repeats`), the candidate the others are to beat: once it is out
    of the race, `repeats` rounds decide among the rest, close or not. What they then
    choose between is a few percent of a call, all of them well ahead of the baseline; the
    extra rounds each cost a call of every one left (BERT at twice the suite's width, 42 ms
    compiled against 46 ms uncompiled: six extra rounds, 0.5 s of its first call).

    `inference_mode=False`: the calls run in the caller's grad mode. A compiled model
    called under another grad mode than the one it was compiled in recompiles (dynamo
    guards on it): timed so, its first samples are a compile, not a call."""
    cap = max(max_repeats or repeats, repeats)
    with torch.inference_mode() if inference_mode else contextlib.nullcontext():
        for _ in range(warmup):
            for fn in candidates.values():
                fn()
        samples: dict[str, list[float]] = {label: [] for label in candidates}
        total, rounds = 0.0, 0
        order, shuffler = list(candidates.items()), random.Random(0)
        early: set[str] = set()  # out of the race after two rounds
        while True:
            shuffler.shuffle(order)
            if max_repeats is not None and rounds >= repeats:
                best = min(statistics.median(bucket) for bucket in samples.values())
                order = [(label, fn) for label, fn in order
                         if statistics.median(samples[label]) <= best * OUT_OF_RACE]
            elif max_repeats is not None and rounds >= 2:
                # Out of the race sooner where no sample can be noise: each of its samples
                # OUT_OF_RACE times another candidate's slowest.
                leader = min(max(bucket) for bucket in samples.values())
                early |= {label for label, _ in order
                          if min(samples[label]) > leader * OUT_OF_RACE}
                order = [(label, fn) for label, fn in order if label not in early]
            for label, fn in order:
                seconds = timer(label, fn)
                samples[label].append(seconds)
                total += max(seconds, 0.0)
            rounds += 1
            if rounds >= 100 * repeats:
                break  # a timer that answers 0: enough rounds
            if rounds < repeats or total < min_seconds:
                continue
            if rounds >= cap or _decided(samples, margin) or _out(samples, baseline):
                break
    # A candidate out after two rounds has two samples, whose median is their mean: one
    # slow sample would make it look slower, and the winner's lead larger, than measured.
    # Its figure is the faster sample.
    return {label: min(bucket) if label in early else statistics.median(bucket)
            for label, bucket in samples.items()}


def _out(samples: dict[str, list[float]], label: str | None) -> bool:
    """Whether candidate `label` is OUT_OF_RACE times slower than the fastest (medians)."""
    if label is None or label not in samples:
        return False
    best = min(statistics.median(bucket) for bucket in samples.values())
    return statistics.median(samples[label]) > best * OUT_OF_RACE


def _decided(samples: dict[str, list[float]], margin: float) -> bool:
    medians = sorted(statistics.median(bucket) for bucket in samples.values())
    return len(medians) < 2 or medians[1] > medians[0] * (1 + margin)


def interleaved_latency(fns: list[Callable[[], Any]], synchronize: Callable[[], None], *,
                        warmup: int = 3, repeats: int = 10, min_seconds: float = 0.2
                        ) -> list[float]:
    """Median seconds of each fn, sampled round-robin (round_robin with the wall timer)."""
    named = {str(i): fn for i, fn in enumerate(fns)}
    seconds = round_robin(named, wall_timer(synchronize), warmup=warmup, repeats=repeats,
                          min_seconds=min_seconds)
    return [seconds[str(i)] for i in range(len(fns))]
