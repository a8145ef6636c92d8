"""Measuring what passes change: output drift and latency. Used by the pipeline and benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def flatten_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a model output (tensor, tuple/list/dict nesting, or an object with
    tensor attributes such as a HF ModelOutput's dict form)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in flatten_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in flatten_tensors(v)]
    return []


def call_args(backend: Any, sample_input: Any) -> tuple[Any, ...]:
    """A sample input as positional call arguments (a tuple means several) on the
    backend's device."""
    args = sample_input if isinstance(sample_input, tuple) else (sample_input,)
    moved: tuple[Any, ...] = backend.to_device(args)
    return moved


def tensor_drift(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[float, float]:
    """(max abs diff, max abs diff / max |reference|) of two same-shape tensors, in float32
    on the CPU."""
    if not reference.numel():
        return 0.0, 0.0
    ref32 = reference.detach().float().cpu()
    diff = (ref32 - candidate.detach().float().cpu()).abs().max().item()
    scale = ref32.abs().max().item()
    return diff, diff / scale if scale > 0 else diff


def output_drift(reference: Any, candidate: Any) -> tuple[float, float]:
    """(max abs diff, max abs diff / max |reference|) over all output tensors, in float32."""
    refs, cands = flatten_tensors(reference), flatten_tensors(candidate)
    if len(refs) != len(cands):
        raise ValueError(f"outputs differ in structure: {len(refs)} vs {len(cands)} tensors")
    max_abs, max_rel = 0.0, 0.0
    for ref, cand in zip(refs, cands, strict=True):
        if ref.shape != cand.shape:
            raise ValueError(f"output shapes differ: {tuple(ref.shape)} vs {tuple(cand.shape)}")
        diff, rel = tensor_drift(ref, cand)
        max_abs, max_rel = max(max_abs, diff), max(max_rel, rel)
    return max_abs, max_rel


def median_latency(fn: Callable[[], Any], synchronize: Callable[[], None], *, warmup: int = 3,
                   repeats: int = 10, min_seconds: float = 0.0) -> float:
    """Median wall time of fn() in seconds after `warmup` calls. Keeps repeating past
    `repeats` until `min_seconds` of samples are collected (to tame noise on short calls)."""
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        synchronize()
        samples: list[float] = []
        started = time.perf_counter()
        while len(samples) < repeats or time.perf_counter() - started < min_seconds:
            t0 = time.perf_counter()
            fn()
            synchronize()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def interleaved_latency(fns: list[Callable[[], Any]], synchronize: Callable[[], None], *,
                        warmup: int = 3, repeats: int = 10, min_seconds: float = 0.2
                        ) -> list[float]:
    """Median seconds of each fn, sampled round-robin so that drift in machine state
    (thread pools waking, caches, frequency, a noisy neighbour) falls on all alike.
    Sampling goes on past `repeats` rounds until `min_seconds` have passed."""
    with torch.inference_mode():
        for _ in range(warmup):
            for fn in fns:
                fn()
        synchronize()
        samples: list[list[float]] = [[] for _ in fns]
        started = time.perf_counter()
        while len(samples[0]) < repeats or time.perf_counter() - started < min_seconds:
            for fn, bucket in zip(fns, samples, strict=True):
                t0 = time.perf_counter()
                fn()
                synchronize()
                bucket.append(time.perf_counter() - t0)
    return [statistics.median(bucket) for bucket in samples]


def compare_latency(baseline: Callable[[], Any], candidate: Callable[[], Any],
                    synchronize: Callable[[], None], *, warmup: int = 3, repeats: int = 10,
                    min_seconds: float = 0.2) -> tuple[float, float]:
    """Median seconds of (baseline, candidate), sampled alternately: timing one after the
    other showed a 1.49x "speedup" for an unchanged model."""
    base, cand = interleaved_latency([baseline, candidate], synchronize, warmup=warmup,
                                     repeats=repeats, min_seconds=2 * min_seconds)
    return base, cand
