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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from torchbridge.models import reference_models
from torchbridge.optimize.measure import interleaved_latency, median_latency, output_drift
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


def _flops(model: torch.nn.Module, x: torch.Tensor) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(x)
    return int(counter.get_total_flops())


def run(models: list[str] | None = None, batches: dict[str, tuple[int, ...]] | None = None,
        progress: Callable[[int, int, str], None] | None = None, scale: float = 1.0
        ) -> dict[str, Any]:
    """Run the benchmark; `scale` < 1 shrinks the models (for tests, not for figures)."""
    import torch._inductor.config as inductor_config

    import torchbridge

    inductor_config.fx_graph_cache = False
    inductor_config.autotune_local_cache = False
    backend = torchbridge.get_backend()
    low = backend.low_precision_dtype()
    dtypes = [torch.float32] + ([low] if low is not None else [])
    peaks = {dtype_name(d): matmul_peak(d) for d in dtypes}
    chosen = [m for m in reference_models(scale) if models is None or m.name in models]
    sizes: dict[str, tuple[int, ...]] = dict(batches or BATCHES)
    total = sum(len(sizes[m.name]) for m in chosen) * len(VARIANTS)
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

            rows.extend(_measure(backend, ref.name, batch, model, x, peaks, step))
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
            "rows": [asdict(r) for r in rows]}


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


def _prepare(backend: Any, variant: str, model: torch.nn.Module, x: torch.Tensor,
             expected: torch.Tensor) -> _Variant:
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
            result = backend.optimize(model, variant, sample_input=x)
            run_model = result.model
            if any(p.name == "autocast" and p.status == "applied" for p in result.passes):
                compute_dtype = dtype_name(backend.low_precision_dtype())
        args = backend.to_device(x)
        if backend.get_memory_stats().peak_allocated_bytes is not None:
            backend.reset_peak_memory_stats()
        with torch.inference_mode():
            out = run_model(args)
        backend.synchronize()
        first_call = time.perf_counter() - started
    _, rel = output_drift(expected, out)
    return _Variant(variant, lambda: run_model(args), first_call, rel, compute_dtype,
                    backend.get_memory_stats().peak_allocated_bytes)


def _measure(backend: Any, name: str, batch: int, model: torch.nn.Module, x: torch.Tensor,
             peaks: dict[str, float], progress: Callable[[str], None]) -> list[Row]:
    """Every variant of one model at one batch size: prepared one by one (first call),
    then timed round-robin, so that a slow spell of the machine slows all variants alike
    rather than the one that happened to be running (timed one after the other, an O1
    that changes nothing came out 1.7x slower than eager)."""
    flops = _flops(model, x)
    with torch.inference_mode():
        expected = model(x)
    variants = []
    for variant in VARIANTS:
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
    for model in sorted({r["model"] for r in rows}):
        best = max((r for r in rows if r["model"] == model and r["variant"] in
                    ("O1", "O2", "O3")), key=lambda r: r["speedup_vs_eager"])
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
