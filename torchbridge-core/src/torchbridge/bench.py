"""The prepare_model benchmark: reference models, eager vs torch.compile vs TorchBridge levels.

Each row: median latency after warm-up (all variants of one model timed round-robin), the
first call (prepare_model or torch.compile plus the first forward, compiled from empty
inductor caches in this process) and, in a fresh process, the first call again reusing
what an earlier process left in a cache folder (torchbridge.bench_firstcall); peak memory
where the backend can count it, relative error against eager fp32, and achieved FLOP/s as
a fraction of this machine's matmul peak measured in the same run. The hf suite adds
quantized rows ("O3 int8" ...) with their accuracy gate's figures. Every report names the
machine (`machine()`); torchbridge.bench_render draws the tables.

Progress: each step is logged at INFO on the "torchbridge.bench" logger and drawn as a bar
on a terminal (torchbridge.progress).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import platform
import tempfile
import time
import unittest.mock
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from torchbridge.bench_profile import generate_speed, matmul_profile
from torchbridge.bench_render import plot, render, targets
from torchbridge.bench_variants import (
    QUANTIZED_MODES,
    build,
    parse_variant,
    placed,
    quantize_argument,
    references,
)
from torchbridge.cpu_features import cpu_flags, cpuinfo_field
from torchbridge.errors import TorchBridgeError
from torchbridge.optimize.measure import (
    interleaved_latency,
    median_latency,
    output_drift,
    sample_call,
)
from torchbridge.progress import progress
from torchbridge.types import dtype_name

__all__ = ["run", "render", "targets", "plot", "machine", "matmul_profile", "generate_speed",
           "BASELINES", "LEVELS", "QUANTIZED_MODES"]

logger = logging.getLogger(__name__)
BASELINES = ("eager", "compile")  # always run: the speedups are against them
LEVELS = ("O1", "O2", "O3")
# The hf suite's extra rows beside O3: prepared without a sample input, and quantized.
HF_EXTRAS = ("O3 no sample", *(f"O3 {mode}" for mode in QUANTIZED_MODES))
VARIANTS = (*BASELINES, *LEVELS)  # the reference suite's default
# The CPU flags that decide how fast low precision runs (torch's names).
SPEED_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "amx_int8", "avx512_vnni", "avx_vnni")


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
    # First call: this row's over plain torch.compile's (None for eager); its two parts
    # (prepare_model or torch.compile, then the first forward) and prepare_model's passes.
    first_call_vs_compile: float | None = None
    prepare_s: float | None = None
    first_forward_s: float = 0.0
    passes: list[dict[str, Any]] = field(default_factory=list)  # name, status, seconds
    # The first call in a fresh process reusing the compiled artifacts of an earlier one
    # (None where not measured); the first of those processes' own first call; the
    # inductor cache hits and misses the second one counted; why it failed, if it did.
    second_process_s: float | None = None
    first_process_s: float | None = None
    second_process_cache: dict[str, int] | None = None
    second_process_error: str | None = None
    # Quantized rows: the mode asked for, what prepare_model did with it (applied or
    # rolled back), its accuracy gate's figures on the sample input, and the report's words.
    quantize: str | None = None
    quantize_status: str | None = None
    quantize_cosine: float | None = None
    quantize_argmax_agreement: float | None = None
    quantize_detail: str | None = None


def machine(backend: Any = None) -> dict[str, Any]:
    """What a figure was measured on: CPU model and the flags that decide low-precision
    speed (present and absent), torch, threads, Python, date; the backend and its device."""
    import torchbridge

    # The host CPU whatever the backend: its name as the CPU backend describes it, its
    # family and model (the generation), and its features.
    cpu = torchbridge.get_backend("cpu").get_device_info().name
    family, model = cpuinfo_field("cpu family"), cpuinfo_field("model\t")
    if family is not None and model is not None:
        cpu += f" (family {family}, model {model})"
    flags = cpu_flags()
    out: dict[str, Any] = {
        "cpu": cpu, "cpu_flags": [f for f in SPEED_FLAGS if f in flags],
        "cpu_flags_absent": [f for f in SPEED_FLAGS if f not in flags],
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    if backend is not None:
        out["backend"] = backend.name
        out["device"] = backend.get_device_info().name
    return out


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def matmul_peak(dtype: torch.dtype, backend: Any = None, size: int | None = None) -> float:
    """FLOP/s of a large square matmul in `dtype` on the backend's device (None: the CPU),
    median of 10: the line each row's "% of peak" is drawn against, so it must be the
    device the rows ran on (a GPU's rows over the host CPU's peak read far over 100%).
    Size 2048 on a CPU, 8192 elsewhere (a GPU needs that many to fill its units)."""
    device = torch.device("cpu") if backend is None else backend.device
    size = size or (2048 if device.type == "cpu" else 8192)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = (lambda: None) if backend is None else backend.synchronize
    seconds = median_latency(lambda: a @ b, sync, warmup=3, repeats=10)
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


def variants_for(suite: str, levels: Iterable[str] | None) -> tuple[str, ...]:
    """The variants a run measures: the baselines, then each level. In the hf suite a plain
    "O3" brings its extra rows (no sample input, each quantize mode); a level may also name
    one such row itself ("O3 int8"). Level aliases become their names ("O3")."""
    from torchbridge.levels import OptimizationLevel

    chosen = []
    for variant in LEVELS if levels is None else levels:
        level, _, rest = variant.partition(" ")
        parse_variant(variant)
        variant = " ".join([OptimizationLevel.parse(level).value, *([rest] if rest else [])])
        chosen.append(variant)
        if suite == "hf" and variant == "O3":
            chosen.extend(HF_EXTRAS)
    return tuple(dict.fromkeys([*BASELINES, *chosen]))


def _warm_inductor() -> None:
    """Pay inductor's one-time import and setup cost before any variant is timed. The
    warm-up compiles a generated C++ kernel (the ReLU): a Linear alone compiles to a call
    of an existing matmul, which left 2-5 s of first-time setup to the first variant that
    generated code (ViT's plain torch.compile: 8.6 s as the process's first, 2.9 s after
    an O3; 2-core AMD EPYC, torch 2.13) and to the suite's first model's compile row."""
    warm = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
    with torch.inference_mode():
        warm(torch.randn(2, 8))


@contextlib.contextmanager
def cold_compiles() -> Iterator[str]:
    """Where `_measure` runs: yields the folder under which each variant gets its own
    compile cache (its `cache_root`), kept until every variant has been timed (a recompile
    may need its folder). Inductor's on-disk caches are off in this process meanwhile (put
    back afterwards), so that no variant's first call reuses what another compiled; the
    compile pass points TORCHINDUCTOR_CACHE_DIR at each variant's folder (config
    optimization.compile_cache_dir), and the caller's process gets its own value back.
    Inductor's one-time setup is paid on entry, before any variant is timed."""
    import torch._inductor.config as inductor_config

    with tempfile.TemporaryDirectory(prefix="torchbridge-bench-") as caches, \
            inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False), \
            unittest.mock.patch.dict(os.environ):
        _warm_inductor()
        yield caches


def run(models: list[str] | None = None, batches: dict[str, tuple[int, ...]] | None = None,
        scale: float = 1.0, suite: str = "reference", *, backend: str | None = None,
        levels: list[str] | None = None, batch: int | None = None,
        second_process: bool = True) -> dict[str, Any]:
    """Run the benchmark; `scale` < 1 shrinks the models (for tests, not for figures).

    suite "reference": torchbridge.models; "hf": Hugging Face architectures from their
    configs (torchbridge.hf_models, needs transformers), with extra rows beside O3 ("O3
    no sample": prepared without a sample input; "O3 int8" and the other quantize modes,
    skipped with the report's reason where the backend does not support them), the
    matmul share and sizes of each model, and generate() tokens per second for decoders.

    `backend`: a backend name (default: the selected one). `levels`: the TorchBridge
    variants beside eager and plain torch.compile (default O1, O2, O3; see
    variants_for). `batch`: one batch size for every model, instead of `batches` or the
    suite's own. `second_process=False` leaves out the fresh-process first calls (each
    costs two Python processes preparing the model)."""
    import torchbridge
    from torchbridge import bench_firstcall

    chosen_backend = torchbridge.get_backend(backend)
    low = chosen_backend.low_precision_dtype()
    dtypes = [torch.float32] + ([low] if low is not None else [])
    peaks = {dtype_name(d): matmul_peak(d, chosen_backend) for d in dtypes}
    variants = variants_for(suite, levels)
    refs, default_sizes = references(suite, scale)
    chosen = [m for m in refs if models is None or m.name in models]
    sizes: dict[str, tuple[int, ...]] = (
        {m.name: (batch,) for m in chosen} if batch is not None
        else dict(batches or default_sizes))
    again = [v for v in variants if second_process and bench_firstcall.reused(v)]
    steps = sum(len(sizes[m.name]) for m in chosen) * (len(variants) + len(again))
    profiles: dict[str, Any] = {}
    generation: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    load_at_start = _load_average()
    rows: list[Row] = []
    with cold_compiles() as cache_root, progress(steps, "bench") as bar:
        done = 0

        def step(what: str) -> None:
            nonlocal done
            done += 1
            logger.info("bench %d/%d: %s", done, steps, what)
            bar.step(what)

        for ref in chosen:
            for size in sizes[ref.name]:
                model, x = build(suite, ref.name, size, scale)
                label = f"{ref.name} batch {size}"
                measured, gone = _measure(chosen_backend, ref.name, size, model, x, peaks,
                                          functools.partial(_labelled, step, label), variants,
                                          cache_root=cache_root)
                skipped.extend(gone)
                for row in measured:
                    if row.variant in again:
                        step(f"{label} {row.variant} second process")
                        _second_process(row, suite, scale, chosen_backend.name)
                for s in gone:  # the steps counted for them, so that the count ends at total
                    if s["variant"] in again:
                        step(f"{label} {s['variant']} second process: none, {s['status']}")
                rows.extend(measured)
                if suite == "hf" and chosen_backend.device.type == "cpu":
                    # Host wall time per op: where a CPU's eager call goes. A GPU's ops
                    # run asynchronously, so timing them from the host says nothing.
                    profiles[f"{ref.name} b{size}"] = matmul_profile(model, x)
            if suite == "hf" and getattr(ref, "is_decoder", False):
                generation.append(generate_speed(chosen_backend, ref.name, ref.build(),
                                                 ref.make_input(1)["input_ids"][:, :16]))
    # The peak is the best this machine showed: measured again at the end, since a slow
    # spell at the start would make every "% of peak" look better than it is.
    for d in dtypes:
        peaks[dtype_name(d)] = max(peaks[dtype_name(d)], matmul_peak(d, chosen_backend))
    for r in rows:
        r.peak_fraction = r.tflops * 1e12 / peaks[r.compute_dtype]
    compare(rows)
    host = machine(chosen_backend)
    # Other processes' load on the machine, which slows what they share (1-minute
    # averages, as uptime shows them; None where the OS does not say).
    host["load_average"] = {"start": load_at_start, "end": _load_average()}
    return {"backend": chosen_backend.name, "device": host["device"],
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": host, "suite": suite, "variants": list(variants),
            "matmul_peak_tflops": {k: v / 1e12 for k, v in peaks.items()},
            "rows": [asdict(r) for r in rows], "skipped": skipped,
            "matmul_profile": profiles, "generation": generation}


def _labelled(step: Callable[[str], None], label: str, variant: str) -> None:
    step(f"{label} {variant}")


def compare(rows: list[Row]) -> None:
    """Each row's speedups over eager and plain torch.compile of the same model and batch,
    and its first call over torch.compile's."""
    by_key = {(r.model, r.batch, r.variant): r for r in rows}
    for r in rows:
        eager, compiled = by_key[(r.model, r.batch, "eager")], by_key[(r.model, r.batch,
                                                                       "compile")]
        r.speedup_vs_eager = eager.latency_ms / r.latency_ms
        r.speedup_vs_compile = compiled.latency_ms / r.latency_ms
        if r.variant != "eager":
            r.first_call_vs_compile = r.first_call_s / compiled.first_call_s


def _second_process(row: Row, suite: str, scale: float, backend: str) -> None:
    from torchbridge import bench_firstcall

    try:
        first, second = bench_firstcall.measure(suite, row.model, row.batch, row.variant,
                                                scale=scale, backend=backend)
    except bench_firstcall.FirstCallError as exc:
        logger.warning("bench: %s %s batch %d: second process failed: %s", row.model,
                       row.variant, row.batch, exc)
        row.second_process_error = str(exc)
        return
    row.first_process_s = first["first_call_s"]
    row.second_process_s = second["first_call_s"]
    row.second_process_cache = second["cache"]


@contextlib.contextmanager
def _fresh_compile_caches() -> Iterator[None]:
    """Every variant compiles from nothing: dynamo reset, and an empty inductor cache
    directory with its in-memory code caches cleared. Without it a variant reuses the C++
    kernels an earlier one compiled (plain torch.compile at batch 256 took 0.3 s after the
    batch-32 run had built the same kernels), and first-call times mean nothing. The
    folder is removed afterwards, also when preparing failed (inductor keeps it then)."""
    import torch._inductor.utils as inductor_utils

    torch._dynamo.reset()
    fresh = getattr(inductor_utils, "fresh_cache", None) or \
        inductor_utils.fresh_inductor_cache  # name before torch 2.8
    with tempfile.TemporaryDirectory(prefix="torchbridge-bench-inductor-") as folder, \
            fresh(dir=folder):
        yield


@dataclass
class _Variant:
    """One variant of one model, prepared and called once (the first call)."""

    name: str
    call: Callable[[], Any]
    prepare_s: float | None  # None: eager, nothing to prepare
    first_forward_s: float
    rel_error: float
    compute_dtype: str
    peak_memory_bytes: int | None
    passes: list[dict[str, Any]] = field(default_factory=list)
    quantize: dict[str, Any] | None = None  # quantize_outcome's answer

    @property
    def first_call_s(self) -> float:
        return (self.prepare_s or 0.0) + self.first_forward_s


def quantize_outcome(result: Any) -> dict[str, Any]:
    """What prepare_model did with the quantize mode asked for, from its report
    (OptimizationResult.quantization_outcome): mode, status ("applied", "rolled back":
    the accuracy gate failed, "skipped": not supported here), detail (how, or why not,
    with the gate's figures when rolled back), and when applied the gate's cosine and
    argmax agreement on the sample input."""
    outcome: dict[str, Any] = result.quantization_outcome()
    return {"cosine": None, "argmax_agreement": None, **outcome}


def unsupported_quantize(backend: Any, mode: str) -> str | None:
    """Why the quantize pass would skip `mode` on this backend's device (None: it runs),
    asked of the pass's own support table without preparing the model: a skipped mode
    would otherwise cost a whole O3 preparation to learn the reason."""
    from torchbridge.optimize.quantize_gate import unsupported

    why = unsupported(mode, backend.get_device_info(), backend.device.type)
    return None if why is None else f"{mode}: {why}"


def _prepare(backend: Any, variant: str, model: torch.nn.Module, x: Any,
             expected: Any) -> _Variant:
    with _fresh_compile_caches():
        compute_dtype = "float32"
        passes: list[dict[str, Any]] = []
        quantized = None
        started = time.perf_counter()
        run_model: Callable[..., Any]
        prepare_s: float | None = None
        if variant == "eager":
            run_model = placed(backend, model)
        elif variant == "compile":
            run_model = torch.compile(placed(backend, model))
            prepare_s = time.perf_counter() - started
        else:
            # With the sample input, as a user who has one would: passes may measure it.
            # "O3 no sample": as a user without one.
            level, with_sample, mode = parse_variant(variant)
            result = backend.optimize(model, level, sample_input=x if with_sample else None,
                                      quantize=quantize_argument(mode))
            prepare_s = time.perf_counter() - started
            run_model = result.model
        call = sample_call(backend, x)
        if backend.get_memory_stats().peak_allocated_bytes is not None:
            backend.reset_peak_memory_stats()
        forward_started = time.perf_counter()
        with torch.inference_mode():
            out = call(run_model)
        backend.synchronize()
        first_forward = time.perf_counter() - forward_started
        if variant not in ("eager", "compile"):
            # Read after the first forward: without a sample input, that call decides what
            # is kept (optimize/first_call.py), and the report then says what runs.
            # The passes, then prepare_model's stages outside them (the O0 reference run,
            # the final check, keep-the-faster timing), named in parentheses.
            passes = [{"name": p.name, "status": p.status, "seconds": p.seconds}
                      for p in result.passes] + [
                {"name": f"({stage.replace('_', ' ')})", "status": "stage", "seconds": sec}
                for stage, sec in result.stage_seconds.items()]
            if any(p.name == "autocast" and p.status == "applied" for p in result.passes):
                compute_dtype = dtype_name(backend.low_precision_dtype())
            if mode is not None:
                quantized = quantize_outcome(result)
    _, rel = output_drift(expected, out)
    return _Variant(variant, lambda: call(run_model), prepare_s, first_forward, rel,
                    compute_dtype, backend.get_memory_stats().peak_allocated_bytes, passes,
                    quantized)


def with_compile_cache(backend: Any, path: str) -> Any:
    """`backend` with config optimization.compile_cache_dir = `path`."""
    from torchbridge.backend import Backend

    config = backend.config
    config = config.model_copy(update={"optimization": config.optimization.model_copy(
        update={"compile_cache_dir": path})})
    return Backend(backend.status, config, index=backend.device.index or 0)


def _measure(backend: Any, name: str, batch: int, model: torch.nn.Module, x: Any,
             peaks: dict[str, float], progress: Callable[[str], None],
             variants_run: tuple[str, ...] = VARIANTS, cache_root: str | None = None
             ) -> tuple[list[Row], list[dict[str, Any]]]:
    """Every variant of one model at one batch size: prepared one by one (first call),
    then timed round-robin, so that a slow spell of the machine slows all variants alike
    rather than the one that happened to be running (timed one after the other, an O1
    that changes nothing came out 1.7x slower than eager). Returns the rows and the
    variants not timed: model, batch, variant, status "skipped" (a quantize mode the
    backend does not support) or "failed" (prepare_model raised), and the reason.
    With `cache_root`, each TorchBridge variant keeps its compiled artifacts in an empty
    folder of its own there (config optimization.compile_cache_dir): its first call is a
    cold one whatever the user's config names."""
    flops = _flops(model, x)
    with torch.inference_mode():
        expected = sample_call(_CPU, x)(model)
    variants, skipped = [], []
    for variant in variants_run:
        progress(variant)
        mode = parse_variant(variant)[2] if variant not in BASELINES else None
        why = None if mode is None else unsupported_quantize(backend, mode)
        if why is not None:
            skipped.append({"model": name, "batch": batch, "variant": variant,
                            "status": "skipped", "reason": why})
            continue
        try:
            prepared = _prepare(backend if variant in BASELINES or cache_root is None else
                                with_compile_cache(backend, tempfile.mkdtemp(dir=cache_root)),
                                variant, model, x, expected)
        except TorchBridgeError as exc:
            if variant in BASELINES:
                raise
            # One variant that prepare_model cannot prepare is a finding of the run, not
            # its end: the row says so, the other variants are measured.
            logger.warning("bench: %s batch %d %s failed: %s", name, batch, variant, exc)
            skipped.append({"model": name, "batch": batch, "variant": variant,
                            "status": "failed", "reason": f"{type(exc).__name__}: {exc}"})
            continue
        if prepared.quantize is not None and prepared.quantize["status"] == "skipped":
            skipped.append({"model": name, "batch": batch, "variant": variant,
                            "status": "skipped", "reason": prepared.quantize["detail"]})
            continue
        variants.append(prepared)
    seconds = interleaved_latency([v.call for v in variants], backend.synchronize, warmup=2,
                                  repeats=10, min_seconds=1.0 * len(variants))
    rows = []
    for v, sec in zip(variants, seconds, strict=True):
        tflops = flops / sec / 1e12
        q = v.quantize or {}
        rows.append(Row(name, batch, v.name, sec * 1e3, v.first_call_s, v.rel_error, tflops,
                        tflops * 1e12 / peaks[v.compute_dtype], v.compute_dtype,
                        v.peak_memory_bytes, prepare_s=v.prepare_s,
                        first_forward_s=v.first_forward_s, passes=v.passes,
                        quantize=q.get("mode"), quantize_status=q.get("status"),
                        quantize_cosine=q.get("cosine"),
                        quantize_argmax_agreement=q.get("argmax_agreement"),
                        quantize_detail=q.get("detail")))
    return rows, skipped
