"""Where a benchmark model's time goes, beside the latency rows of torchbridge.bench: the
share of an eager call spent in matrix products (and their shapes), where a prepared
(compiled) model's call goes, and generate() tokens per second for decoders."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from torchbridge.bench_variants import placed
from torchbridge.optimize.measure import interleaved_latency, sample_call


class _Host:
    """Stands in for a backend where only to_device is needed: inputs stay where they are."""

    @staticmethod
    def to_device(obj: Any) -> Any:
        return obj


_CPU = _Host()


_MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear"}
_ATTENTION = {"aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_attention_math", "aten::convolution"}


def _product_dims(name: str, shapes: list[Any]) -> tuple[int, int, int, int] | None:
    """(batch, M, K, N) of a matrix product from its arguments' shapes; None when they do
    not say (int4's packed weights)."""
    # Where the two matrices are: addmm and baddbmm take their addend first; the others
    # take the matrices first (then scales, or the out= tensor of _int_mm.out).
    first = 1 if name in ("aten::addmm", "aten::baddbmm") else 0
    a, b = ([int(d) for d in s] if isinstance(s, (list, tuple)) else []
            for s in shapes[first:first + 2]) if len(shapes) >= first + 2 else ([], [])
    if len(a) < 2 or len(b) < 2 or name == "aten::_weight_int4pack_mm":
        return None
    if name == "aten::linear" or name.startswith(("mkldnn::", "onednn::",
                                                  "aten::_weight_int8")):
        return 1, math.prod(a[:-1]), a[-1], b[0]  # input (..., K), weight (N, K)
    return (a[0] if len(a) == 3 else 1), a[-2], a[-1], b[-1]


def matmul_profile(model: torch.nn.Module, x: Any, calls: int = 3) -> dict[str, Any]:
    """Where an eager fp32 call's time goes: the share of wall time in matrix products,
    attention and convolution kernels, and the matmul shapes (M x K x N) taking the most
    time, each with its share and achieved GFLOP/s. Compiling or bf16 can only speed up
    what these kernels allow; the rest is Python, dispatch and elementwise work."""
    from torch.utils._python_dispatch import TorchDispatchMode

    times: dict[str, list[float]] = {}  # shape -> [seconds, flops]
    kernel_seconds = [0.0]

    class Timer(TorchDispatchMode):  # type: ignore[misc,no-untyped-call,unused-ignore]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            name = func._schema.name
            if name not in _MATMULS and name not in _ATTENTION:
                return func(*args, **(kwargs or {}))
            started = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            seconds = time.perf_counter() - started
            kernel_seconds[0] += seconds
            shape = _product_dims(name, [list(a.shape) if isinstance(a, torch.Tensor)
                                         else [] for a in args]) \
                if name in _MATMULS else None
            if shape is not None:
                batch, m, k, n = shape
                entry = times.setdefault(f"{m}x{k}x{n}" + (f" (x{batch})" if batch > 1
                                                           else ""), [0.0, 0.0])
                entry[0] += seconds
                entry[1] += 2.0 * batch * m * k * n
            return out

    call = sample_call(_CPU, x)
    with torch.no_grad():
        call(model)
        started = time.perf_counter()
        for _ in range(calls):
            call(model)
        total = (time.perf_counter() - started) / calls
        with Timer():  # type: ignore[no-untyped-call,unused-ignore]
            for _ in range(calls):
                call(model)
    top = sorted(times.items(), key=lambda kv: -kv[1][0])[:3]
    return {"eager_ms": total * 1e3, "kernel_share": min(kernel_seconds[0] / calls / total, 1.0),
            "top_matmuls": [f"{k} {v[0] / calls / total:.0%} at {v[1] / v[0] / 1e9:.0f} GFLOP/s"
                            for k, v in top]}


# What call_breakdown puts in which part, by the profiler's event names (self time, so that
# nested events are not counted twice). Matrix products in every form a prepared model
# runs them: float (oneDNN or MKL), int8 (torch._int_mm, oneDNN's qlinear), int8 weights.
_PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_int_mm",
             "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm", "aten::_scaled_mm",
             "mkldnn::_linear_pointwise", "onednn::qlinear_pointwise"}
_GUARDS = "TorchDynamo Cache Lookup"


def _part(name: str) -> str:
    if name in _PRODUCTS or name.startswith("onednn::qlinear"):
        return "matmuls"
    if name.startswith("aten::") and "scaled_dot_product" in name:
        return "attention"
    if name.startswith(("aten::", "mkldnn::", "onednn::")) and "convolution" in name:
        return "convolutions"
    if name == _GUARDS:
        return "guards"
    return "rest"


def _product_flops(name: str, shapes: list[Any]) -> float:
    """2 x batch x M x K x N of a matrix product from its recorded input shapes; 0 when
    they do not say."""
    dims = _product_dims(name, shapes)
    return 2.0 * math.prod(dims) if dims else 0.0


def call_breakdown(model: Any, x: Any, calls: int = 20) -> dict[str, Any]:
    """Where a call of a (prepared) model on the CPU goes, measured with torch.profiler
    over `calls` calls under inference_mode: milliseconds per call in matrix products
    (with the rate they reach, GFLOP/s or int8 GOP/s), attention kernels, convolutions,
    dynamo's guard check, and the rest (inductor's fused loops, the compiled graph's
    wrapper, allocation, Python). The parts add up to the profiled call, which profiling
    makes slower than an unprofiled one ("wall_ms", timed before), an eager model's many
    small ops most."""
    from torch.profiler import ProfilerActivity, profile

    call = sample_call(_CPU, x)
    with torch.inference_mode():
        for _ in range(3):
            call(model)
        started = time.perf_counter()
        for _ in range(calls):
            call(model)
        wall = (time.perf_counter() - started) / calls
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(calls):
                call(model)
    parts = dict.fromkeys(("matmuls", "attention", "convolutions", "guards", "rest"), 0.0)
    flops = counted = 0.0  # the rate covers the products whose shapes say their FLOPs
    for event in prof.key_averages(group_by_input_shape=True):
        part = _part(event.key)
        seconds = event.self_cpu_time_total / 1e6 / calls
        parts[part] += seconds
        if part == "matmuls" and (each := _product_flops(event.key, event.input_shapes)):
            flops += each * event.count / calls
            counted += seconds
    total = sum(parts.values())
    out: dict[str, Any] = {"wall_ms": wall * 1e3, "profiled_ms": total * 1e3}
    out.update({f"{k}_ms": v * 1e3 for k, v in parts.items()})
    out["matmul_gflops"] = flops / counted / 1e9 if counted else None
    return out


def generate_speed(backend: Any, name: str, model: torch.nn.Module, ids: torch.Tensor,
                   new_tokens: int = 32) -> dict[str, Any]:
    """Greedy generate() tokens per second: eager fp32 against prepare_model at O3 (with
    the prompt as sample input), medians of 5 sampled alternately after one warm-up; and
    whether the tokens are the same."""
    eager = placed(backend, model)
    prepared = backend.prepare_model(model, "O3", sample_input={"input_ids": ids})
    ids = backend.to_device(ids)
    out: dict[str, Any] = {"model": name, "prompt": list(ids.shape), "new_tokens": new_tokens}
    tokens = {}
    calls: list[Callable[[], Any]] = []
    for label, m in (("eager", eager), ("O3", prepared)):
        def gen(m: Any = m) -> Any:
            return m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            tokens[label] = gen()
        calls.append(gen)
    # Sampled alternately, so that a busy spell of the machine slows both alike.
    seconds = interleaved_latency(calls, backend.synchronize, warmup=1, repeats=5)
    for label, sec in zip(("eager", "O3"), seconds, strict=True):
        out[f"{label}_tokens_per_s"] = ids.shape[0] * new_tokens / sec
    out["speedup"] = out["O3_tokens_per_s"] / out["eager_tokens_per_s"]
    out["same_tokens"] = bool(torch.equal(tokens["eager"], tokens["O3"]))
    return out
