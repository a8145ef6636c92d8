"""The prepare_model benchmark: reference models, eager vs torch.compile vs O1/O2/O3.

Each row: median latency after warm-up, first-call time (compilation included), peak
memory where the backend can count it, relative error against eager fp32, and achieved
FLOP/s as a fraction of this machine's matmul peak measured in the same run. Every variant
compiles with empty inductor caches, so that first-call times are real compile costs.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from torchbridge.models import reference_models
from torchbridge.optimize.measure import (
    interleaved_latency,
    median_latency,
    output_drift,
    sample_call,
)
from torchbridge.types import dtype_name

logger = logging.getLogger(__name__)
BATCHES = {"mlp": (32, 256), "convnet": (8, 64), "encoder": (8, 32), "decoder_lm": (4, 16)}
VARIANTS = ("eager", "compile", "O1", "O2", "O3")


@dataclass
class Row:
    model: str
    batch: int
    variant: str
    latency_ms: float
    first_call_s: float
    rel_error: float
    tflops: float
    peak_fraction: float  # of the matmul peak in the dtype the variant computes in
    compute_dtype: str
    peak_memory_bytes: int | None
    speedup_vs_eager: float = 0.0
    speedup_vs_compile: float = 0.0


def matmul_peak(dtype: torch.dtype, size: int = 2048) -> float:
    """FLOP/s of a large square matmul in `dtype` on the CPU (median of 10)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    seconds = median_latency(lambda: a @ b, lambda: None, warmup=3, repeats=10)
    return 2 * size**3 / seconds


def _flops(model: torch.nn.Module, x: Any) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    call = sample_call(_CPU, x)
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        call(model)
    return int(counter.get_total_flops())


class _Host:
    """Stands in for a backend where only to_device is needed: inputs stay where they are."""

    @staticmethod
    def to_device(obj: Any) -> Any:
        return obj


_CPU = _Host()


def run(models: list[str] | None = None, batches: dict[str, tuple[int, ...]] | None = None,
        progress: Callable[[int, int, str], None] | None = None, scale: float = 1.0,
        suite: str = "reference") -> dict[str, Any]:
    """Run the benchmark; `scale` < 1 shrinks the models (for tests, not for figures).
    suite "reference": torchbridge.models; "hf": Hugging Face architectures from their
    configs (torchbridge.hf_models, needs transformers), with an extra variant "O3 no
    sample" (prepared without a sample input), the matmul share and sizes of each model,
    and generate() tokens per second for the decoders."""
    import torch._inductor.config as inductor_config

    import torchbridge

    inductor_config.fx_graph_cache = False
    inductor_config.autotune_local_cache = False
    backend = torchbridge.get_backend()
    low = backend.low_precision_dtype()
    dtypes = [torch.float32] + ([low] if low is not None else [])
    peaks = {dtype_name(d): matmul_peak(d) for d in dtypes}
    variants: tuple[str, ...] = VARIANTS
    chosen: list[Any]
    default_sizes: Mapping[str, tuple[int, ...]]
    if suite == "hf":
        from torchbridge import hf_models

        chosen = hf_models.hf_reference_models(scale)
        default_sizes = hf_models.BATCHES
        variants = (*VARIANTS, "O3 no sample")
    else:
        chosen = reference_models(scale)
        default_sizes = BATCHES
    chosen = [m for m in chosen if models is None or m.name in models]
    sizes: dict[str, tuple[int, ...]] = dict(batches or default_sizes)
    total = sum(len(sizes[m.name]) for m in chosen) * len(variants)
    profiles: dict[str, Any] = {}
    generation: list[dict[str, Any]] = []
    done = 0
    warm = torch.compile(torch.nn.Linear(8, 8))  # pay inductor's one-time import cost here
    with torch.inference_mode():
        warm(torch.randn(2, 8))
    rows: list[Row] = []
    for ref in chosen:
        for batch in sizes[ref.name]:
            torch.manual_seed(0)
            model, x = ref.build().eval(), ref.make_input(batch)

            def step(variant: str, name: str = ref.name, batch: int = batch) -> None:
                nonlocal done
                if progress:
                    progress(done, total, f"{name} batch {batch} {variant}")
                done += 1

            rows.extend(_measure(backend, ref.name, batch, model, x, peaks, step, variants))
            if suite == "hf":
                profiles[f"{ref.name} b{batch}"] = matmul_profile(model, x)
        if suite == "hf" and getattr(ref, "is_decoder", False):
            generation.append(generate_speed(backend, ref.name, ref.build(),
                                             ref.make_input(1)["input_ids"][:, :16]))
    # The peak is the best this machine showed: measured again at the end, since a slow
    # spell at the start would make every "% of peak" look better than it is.
    for d in dtypes:
        peaks[dtype_name(d)] = max(peaks[dtype_name(d)], matmul_peak(d))
    for r in rows:
        r.peak_fraction = r.tflops * 1e12 / peaks[r.compute_dtype]
    if progress:
        progress(total, total, "done")
    by_key = {(r.model, r.batch, r.variant): r for r in rows}
    for r in rows:
        r.speedup_vs_eager = by_key[(r.model, r.batch, "eager")].latency_ms / r.latency_ms
        r.speedup_vs_compile = by_key[(r.model, r.batch, "compile")].latency_ms / r.latency_ms
    return {"backend": backend.name, "device": backend.get_device_info().name,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "matmul_peak_tflops": {k: v / 1e12 for k, v in peaks.items()},
            "rows": [asdict(r) for r in rows], "suite": suite,
            "matmul_profile": profiles, "generation": generation}


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


def _fresh_compile_caches() -> contextlib.AbstractContextManager[Any]:
    """Every variant compiles from nothing: dynamo reset, and an empty inductor cache
    directory with its in-memory code caches cleared. Without it a variant reuses the C++
    kernels an earlier one compiled (plain torch.compile at batch 256 took 0.3 s after the
    batch-32 run had built the same kernels), and first-call times mean nothing."""
    import torch._inductor.utils as inductor_utils

    torch._dynamo.reset()
    fresh = getattr(inductor_utils, "fresh_cache", None) or \
        inductor_utils.fresh_inductor_cache  # name before torch 2.8
    return fresh()  # type: ignore[no-any-return]


@dataclass
class _Variant:
    """One variant of one model, prepared and called once (the first call)."""

    name: str
    call: Callable[[], Any]
    first_call_s: float
    rel_error: float
    compute_dtype: str
    peak_memory_bytes: int | None


def _prepare(backend: Any, variant: str, model: torch.nn.Module, x: Any,
             expected: Any) -> _Variant:
    with _fresh_compile_caches():
        compute_dtype = "float32"
        started = time.perf_counter()
        run_model: Callable[..., Any]
        if variant == "eager":
            run_model = model
        elif variant == "compile":
            run_model = torch.compile(copy.deepcopy(model))
        else:
            # With the sample input, as a user who has one would: passes may measure it.
            # "O3 no sample": as a user without one.
            level, _, blind = variant.partition(" ")
            result = backend.optimize(model, level, sample_input=None if blind else x)
            run_model = result.model
            if any(p.name == "autocast" and p.status == "applied" for p in result.passes):
                compute_dtype = dtype_name(backend.low_precision_dtype())
        call = sample_call(backend, x)
        if backend.get_memory_stats().peak_allocated_bytes is not None:
            backend.reset_peak_memory_stats()
        with torch.inference_mode():
            out = call(run_model)
        backend.synchronize()
        first_call = time.perf_counter() - started
    _, rel = output_drift(expected, out)
    return _Variant(variant, lambda: call(run_model), first_call, rel, compute_dtype,
                    backend.get_memory_stats().peak_allocated_bytes)


def _measure(backend: Any, name: str, batch: int, model: torch.nn.Module, x: Any,
             peaks: dict[str, float], progress: Callable[[str], None],
             variants_run: tuple[str, ...] = VARIANTS) -> list[Row]:
    """Every variant of one model at one batch size: prepared one by one (first call),
    then timed round-robin, so that a slow spell of the machine slows all variants alike
    rather than the one that happened to be running (timed one after the other, an O1
    that changes nothing came out 1.7x slower than eager)."""
    flops = _flops(model, x)
    with torch.inference_mode():
        expected = sample_call(_CPU, x)(model)
    variants = []
    for variant in variants_run:
        progress(variant)
        variants.append(_prepare(backend, variant, model, x, expected))
    seconds = interleaved_latency([v.call for v in variants], backend.synchronize, warmup=2,
                                  repeats=10, min_seconds=1.0 * len(variants))
    rows = []
    for v, sec in zip(variants, seconds, strict=True):
        tflops = flops / sec / 1e12
        rows.append(Row(name, batch, v.name, sec * 1e3, v.first_call_s, v.rel_error, tflops,
                        tflops * 1e12 / peaks[v.compute_dtype], v.compute_dtype,
                        v.peak_memory_bytes))
    return rows


def targets(report: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """Issue 3's targets checked against one run: (target, met, evidence)."""
    rows = report["rows"]
    out = []
    hf = report.get("suite") == "hf"
    for model in sorted({r["model"] for r in rows}):
        best = max((r for r in rows if r["model"] == model and r["variant"] in
                    (("O3",) if hf else ("O1", "O2", "O3"))),
                   key=lambda r: r["speedup_vs_eager"])
        mine = [r for r in rows if r["model"] == model and r["variant"] == best["variant"]]
        ok = all(r["speedup_vs_eager"] >= 2 and r["speedup_vs_compile"] >= 1.5 and
                 r["rel_error"] < 1e-2 for r in mine)
        evidence = "; ".join(f"b{r['batch']}: {r['speedup_vs_eager']:.2f}x eager, "
                             f"{r['speedup_vs_compile']:.2f}x compile, err {r['rel_error']:.1e}"
                             for r in mine)
        out.append((f"{model} at {best['variant']}: >=2x eager, >=1.5x compile, err<1e-2",
                    ok, evidence))
        comp = {r["batch"]: r for r in rows if r["model"] == model and r["variant"] == "compile"}
        first = [(r, comp[r["batch"]]) for r in mine]
        ok = all(r["first_call_s"] <= 1.5 * c["first_call_s"] for r, c in first)
        out.append((f"{model} at {best['variant']}: first call <= 1.5x torch.compile's", ok,
                    "; ".join(f"b{r['batch']}: {r['first_call_s']:.1f}s vs "
                              f"{c['first_call_s']:.1f}s" for r, c in first)))
        blind = [r for r in rows if r["model"] == model and r["variant"] == "O3 no sample"]
        if blind:
            out.append((f"{model} at O3 without a sample input: not slower than eager",
                        all(r["speedup_vs_eager"] >= 1.0 for r in blind),
                        "; ".join(f"b{r['batch']}: {r['speedup_vs_eager']:.2f}x eager"
                                  for r in blind)))
    mlp = [r for r in rows if r["model"] == "mlp" and r["batch"] == 256 and
           r["variant"] in ("O1", "O2", "O3") and r["compute_dtype"] != "float32"]
    if mlp:
        top = max(mlp, key=lambda r: r["peak_fraction"])
        out.append(("mlp batch 256: >=60% of the low-precision matmul peak",
                    top["peak_fraction"] >= 0.6, f"{top['variant']}: "
                    f"{top['peak_fraction']:.0%} of the {top['compute_dtype']} peak"))
    return out


def render(report: dict[str, Any]) -> str:
    peaks = ", ".join(f"{k} {v:.3f}" for k, v in report["matmul_peak_tflops"].items())
    lines = [f"backend {report['backend']} ({report['device']}), torch {report['torch']}, "
             f"{report['threads']} threads; matmul peak TFLOP/s: {peaks}", "",
             "| model | batch | variant | latency ms | vs eager | vs compile | first call s "
             "| rel error | TFLOP/s | % of peak (dtype) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        lines.append(f"| {r['model']} | {r['batch']} | {r['variant']} | {r['latency_ms']:.2f} "
                     f"| {r['speedup_vs_eager']:.2f}x | {r['speedup_vs_compile']:.2f}x "
                     f"| {r['first_call_s']:.1f} | {r['rel_error']:.1e} | {r['tflops']:.3f} "
                     f"| {r['peak_fraction']:.0%} ({r['compute_dtype']}) |")
    for key, prof in report.get("matmul_profile", {}).items():
        lines.append(f"{key}: eager fp32 {prof['eager_ms']:.1f} ms, "
                     f"{prof['kernel_share']:.0%} in matmul/attention/conv kernels; top "
                     f"matmuls (MxKxN, time share, fp32 rate): "
                     f"{', '.join(prof['top_matmuls'])}")
    for g in report.get("generation", []):
        lines.append(f"generate {g['model']} prompt {g['prompt']}, {g['new_tokens']} new "
                     f"tokens: eager {g['eager_tokens_per_s']:.1f} tok/s, O3 "
                     f"{g['O3_tokens_per_s']:.1f} tok/s ({g['speedup']:.2f}x), same tokens: "
                     f"{g['same_tokens']}")
    lines += ["", "targets:"]
    lines += [f"  [{'met' if ok else 'MISSED'}] {name}: {ev}" for name, ok, ev in
              targets(report)]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    keys = sorted({(r["model"], r["batch"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(8, len(keys) * 1.4), 4.5))
    width = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        vals = [next(r["speedup_vs_eager"] for r in rows if (r["model"], r["batch"]) == k
                     and r["variant"] == variant) for k in keys]
        ax.bar([j + i * width for j in range(len(keys))], vals, width, label=variant)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))],
                  [f"{m}\nb{b}" for m, b in keys])
    ax.set_ylabel("speedup over eager fp32")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.legend()
    ax.set_title(f"prepare_model on {report['device']} ({report['backend']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
