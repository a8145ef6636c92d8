"""Where a benchmark model's time goes, beside the latency rows of torchbridge.bench: the
share of an eager call spent in matrix products (and their shapes), and generate() tokens
per second for decoders."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

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


def _matmul_shape(name: str, args: Any) -> tuple[int, int, int, int] | None:
    """(batch, M, K, N) of a matrix product's arguments."""
    mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
    if name == "aten::linear" and mats:
        x, w = args[0], args[1]
        return 1, x.numel() // x.shape[-1], x.shape[-1], w.shape[0]
    if len(mats) < 2:
        return None
    a, b = mats[-2], mats[-1]
    return (a.shape[0] if a.dim() == 3 else 1), a.shape[-2], a.shape[-1], b.shape[-1]


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
            shape = _matmul_shape(name, args) if name in _MATMULS else None
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


def generate_speed(backend: Any, name: str, model: torch.nn.Module, ids: torch.Tensor,
                   new_tokens: int = 32) -> dict[str, Any]:
    """Greedy generate() tokens per second: eager fp32 against prepare_model at O3 (with
    the prompt as sample input), medians of 5 sampled alternately after one warm-up; and
    whether the tokens are the same."""
    prepared = backend.prepare_model(model, "O3", sample_input={"input_ids": ids})
    out: dict[str, Any] = {"model": name, "prompt": list(ids.shape), "new_tokens": new_tokens}
    tokens = {}
    calls: list[Callable[[], Any]] = []
    for label, m in (("eager", model), ("O3", prepared)):
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
