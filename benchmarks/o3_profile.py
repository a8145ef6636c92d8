"""Where a call's time goes: eager float32 and the same model prepared at O3 (and at O3
with quantize="int8"), each profiled with torch.profiler (torchbridge.bench_profile's
call_breakdown): milliseconds per call in matrix products (with the rate they reach),
attention kernels, convolutions, dynamo's guard check, and the rest (inductor's fused
loops, the compiled graph's wrapper, allocation, Python). It says which part a goal such
as "2x eager" would have to come from.

    python benchmarks/o3_profile.py [--calls 20] [--models llama gpt2 bert vit resnet]
                                    [--variants O3 "O3 int8"]

The models are torchbridge.hf_models' at the benchmark's first batch size. Each variant is
prepared in this process (inductor's caches as they are: compile time is not measured
here). Prints the machine line (CPU model and flags) and a markdown table.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torchbridge
from torchbridge.bench import machine
from torchbridge.bench_profile import call_breakdown
from torchbridge.hf_models import BATCHES, hf_reference_models


def _row(model: str, variant: str, b: dict[str, Any], eager_wall: float) -> str:
    rate = b["matmul_gflops"]
    unit = "GOP/s" if "int8" in variant else "GFLOP/s"
    matmuls = f"{b['matmuls_ms']:.2f}" + (f" ({rate:.0f} {unit})" if rate else "")
    return (f"| {model} | {variant} | {b['wall_ms']:.2f} ({eager_wall / b['wall_ms']:.2f}x) | "
            f"{b['profiled_ms']:.2f} | {matmuls} | {b['attention_ms']:.2f} | "
            f"{b['convolutions_ms']:.2f} | {b['guards_ms']:.2f} | {b['rest_ms']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2", "bert", "vit",
                                                        "resnet"])
    parser.add_argument("--variants", nargs="+", default=["O3", "O3 int8"],
                        choices=["O3", "O3 int8"])
    args = parser.parse_args()
    print(machine())
    print("| model | variant | call ms (vs eager) | profiled ms | matmuls ms (rate) | "
          "attention ms | convolutions ms | guards ms | rest ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    references = {r.name: r for r in hf_reference_models()}
    backend = torchbridge.get_backend()
    for name in args.models:
        reference = references[name]
        sample = reference.make_input(BATCHES[name][0])
        eager = call_breakdown(reference.build().eval(), sample, args.calls)
        print(_row(name, "eager", eager, eager["wall_ms"]), flush=True)
        for variant in args.variants:
            quantize = "int8" if variant.endswith("int8") else None
            result = backend.optimize(reference.build().eval(), "O3", sample_input=sample,
                                      quantize=quantize)
            breakdown = call_breakdown(result.model, sample, args.calls)
            print(_row(name, variant, breakdown, eager["wall_ms"]), flush=True)
            torch._dynamo.reset()  # each prepared model's graphs go with it


if __name__ == "__main__":
    main()
