"""Each op's implementations against its reference and against torch.compile of the
reference, on the selected backend's device.

    python benchmarks/kernels.py [--backend cuda] [--dtype bfloat16] [--json out.json]

For each op: the median latency of the reference (eager), torch.compile(reference), and
every implementation eligible here, the bytes each call must move divided by its latency,
and that as a share of a device-to-device copy's bandwidth measured in the same run (what
the device can really move); for the matrix products (linear at a 7B model's MLP shape,
attention) the TFLOP/s instead. Every implementation's output is compared with the
reference's first. On CPU only correctness is checked: Triton runs there only under its
interpreter, whose timings mean nothing.

A latency is the median over 7 batches of 10 back-to-back calls, each batch timed as a
whole up to the device's synchronize, so that the host's wait for the device (tens of
microseconds on a GPU) is paid once per batch, not per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torchbridge
from torchbridge.kernels import ops
from torchbridge.kernels.choice import choose
from torchbridge.kernels.implementations import TOLERANCES
from torchbridge.optimize.kernel_substitution import relative_error


def cases(device: torch.device, dtype: torch.dtype, small: bool) -> dict[str, tuple[Any, ...]]:
    rows, hidden, inner = (64, 256, 512) if small else (8192, 4096, 11008)
    batch, heads, seq, head_dim = (1, 2, 32, 64) if small else (4, 32, 1024, 128)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    return {
        "rms_norm": (t(rows, hidden), t(hidden), 1e-6),
        "add_rms_norm": (t(rows, hidden), t(rows, hidden), t(hidden), 1e-6),
        "silu_mul": (t(rows, inner), t(rows, inner)),
        "rotary_embedding": (t(batch, heads, seq, head_dim), t(batch, 1, seq, head_dim),
                             t(batch, 1, seq, head_dim)),
        "scaled_dot_product_attention": (t(batch, heads, seq, head_dim),
                                         t(batch, heads, seq, head_dim),
                                         t(batch, heads, seq, head_dim), None, True),
        # A 7B model's MLP up-projection: 8192 tokens, 4096 -> 11008.
        "linear": (t(rows, hidden), t(inner, hidden), None),
    }


def flops(op: str, args: tuple[Any, ...]) -> int | None:
    """Floating-point operations of one call of a matrix-product op (None for the rest)."""
    if op == "linear":
        x, weight = args[0], args[1]
        return 2 * x.numel() * weight.shape[0]
    if op == "scaled_dot_product_attention":
        q, k = args[0], args[1]
        causal = args[4]
        work = 4 * q.numel() * k.shape[-2]  # q @ k^T and p @ v
        return work // 2 if causal else work
    return None


def bytes_moved(args: tuple[Any, ...], out: Any) -> int:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    tensors += list(out) if isinstance(out, tuple) else [out]
    return sum(t.numel() * t.element_size() for t in tensors)


def median_seconds(fn: Callable[[], Any], sync: Callable[[], None], batches: int = 7,
                   calls: int = 10) -> float:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(batches):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - started) / calls)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, sync: Callable[[], None]) -> float:
    src = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
    seconds = median_seconds(lambda: src.clone(), sync, batches=5, calls=4)
    return 2 * src.numel() / seconds


def run(backend_name: str | None, dtype: torch.dtype) -> dict[str, Any]:
    backend = torchbridge.get_backend(backend_name)
    on_cpu = backend.device.type == "cpu"
    sync = backend.synchronize
    report: dict[str, Any] = {"backend": backend.name, "device": str(backend.device),
                              "dtype": str(dtype), "ops": {}}
    if on_cpu:
        report["note"] = ("CPU: only correctness is checked; Triton kernels run here only "
                          "under the interpreter, whose timings mean nothing")
    else:
        report["device_name"] = backend.get_device_info().name
        report["copy_bandwidth_gbs"] = copy_bandwidth(backend.device, sync) / 1e9
    for op, args in cases(backend.device, dtype, small=on_cpu).items():
        report["ops"][op] = measure_op(op, args, backend, dtype, report.get(
            "copy_bandwidth_gbs"))
    return report


def measure_op(op: str, args: tuple[Any, ...], backend: Any, dtype: torch.dtype,
               copy_gbs: float | None) -> dict[str, Any]:
    """One op: each implementation's error against the reference; with a device (copy_gbs
    measured), the latencies and bandwidth shares of the reference, its compile and each."""
    sync = backend.synchronize
    reference = getattr(ops, op)
    ref_out = reference(*args)
    entry: dict[str, Any] = {"implementations": {}}
    choice = choose(op, backend, dtype=dtype)
    for candidate in choice.candidates:
        name = f"{candidate.implementation.name} ({candidate.provider})"
        if candidate.reason is not None:
            entry["implementations"][name] = {"skipped": candidate.reason}
            continue
        kernel = choice.bound(candidate)
        result: dict[str, Any] = {"rel_error": relative_error(kernel(*args), ref_out),
                                  "tolerance": TOLERANCES.get(dtype)}
        if copy_gbs is not None:
            result["seconds"] = median_seconds(lambda k=kernel: k(*args), sync)
        entry["implementations"][name] = result
    if copy_gbs is None:
        return entry
    compiled = torch.compile(definition_of(op))
    entry["reference_seconds"] = median_seconds(lambda: reference(*args), sync)
    entry["compile_seconds"] = median_seconds(lambda: compiled(*args), sync)
    moved = entry["bytes"] = bytes_moved(args, ref_out)
    work = entry["flops"] = flops(op, args)
    timed = [(entry, f"{key}_") for key in ("reference", "compile")] + [
        (result, "") for result in entry["implementations"].values() if "seconds" in result]
    for holder, prefix in timed:
        seconds = holder[f"{prefix}seconds"]
        holder[f"{prefix}bandwidth_share"] = moved / seconds / (copy_gbs * 1e9)
        if work is not None:
            holder[f"{prefix}tflops"] = work / seconds / 1e12
    return entry


def _rate(holder: dict[str, Any], prefix: str = "") -> str:
    if f"{prefix}tflops" in holder:
        return f"{holder[f'{prefix}tflops']:6.1f} TFLOP/s"
    return f"{holder[f'{prefix}bandwidth_share']:6.1%} of copy bandwidth"


def definition_of(op: str) -> Callable[..., Any]:
    from torchbridge.kernels import reference

    fn: Callable[..., Any] = reference(op)
    return fn


def render(report: dict[str, Any]) -> str:
    lines = [f"kernels on {report['backend']} ({report['device']}, {report['dtype']})"]
    if "note" in report:
        lines.append(report["note"])
    else:
        lines.append(f"{report['device_name']}: device-to-device copy "
                     f"{report['copy_bandwidth_gbs']:.0f} GB/s")
    for op, entry in report["ops"].items():
        lines.append(f"{op}:")
        if "reference_seconds" in entry:
            for key, label in (("reference", "reference (eager)"),
                               ("compile", "torch.compile(reference)")):
                lines.append(f"  {label:<34} {entry[f'{key}_seconds'] * 1e6:9.1f} us  "
                             + _rate(entry, f"{key}_"))
        for name, result in entry["implementations"].items():
            if "skipped" in result:
                lines.append(f"  {name:<34} not here: {result['skipped']}")
                continue
            line = f"  {name:<34} "
            if "seconds" in result:
                line += f"{result['seconds'] * 1e6:9.1f} us  {_rate(result)}  "
            line += f"rel error {result['rel_error']:.2g} (tolerance {result['tolerance']})"
            lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", help="backend name (default: the selected one)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16",
                                                                "bfloat16"])
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args()
    report = run(args.backend, getattr(torch, args.dtype))
    print(render(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
