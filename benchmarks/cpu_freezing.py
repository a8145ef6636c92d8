"""Inductor freezing at O3 on a CPU, on (the CPU backend's inference_freezing pass, as by
default) and off, without and with quantize="int8": what freezing buys at run time and
costs in the first call.

    python benchmarks/cpu_freezing.py [--models llama gpt2 bert vit resnet] [--rounds 10]

Per model, in one process: eager, plain torch.compile, O3 twice (the same configuration:
how far two identical variants land apart in this run), O3 with freezing off (config
optimization.disabled_passes), and O3 int8 with and without it. Each variant is
prepared with empty compile caches (its first call: prepare_model plus the first forward,
after inductor's one-time setup, as `torchbridge bench` measures it), then all are timed
round-robin (medians). Prints the machine line (CPU model and flags) and a markdown table.
The models are torchbridge.hf_models' at the benchmark's batch sizes.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch
import torchbridge
from torchbridge import bench
from torchbridge.bench_variants import build
from torchbridge.hf_models import BATCHES
from torchbridge.optimize.measure import interleaved_latency

UNFROZEN = {"optimization": {"disabled_passes": ["inference_freezing"]}}
# label: (variant as the benchmark names it, config)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "O3": ("O3", {}),
    "O3 again": ("O3", {}),
    "O3 unfrozen": ("O3", UNFROZEN),
    "O3 int8": ("O3 int8", {}),
    "O3 int8 unfrozen": ("O3 int8", UNFROZEN),
}


def _frozen(prepared: Any) -> str:
    record = next((p for p in prepared.passes if p["name"] == "inference_freezing"), None)
    return "-" if record is None else record["status"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(BATCHES))
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    print(bench.machine())
    print("\n| model | variant | inference_freezing | ms | vs eager | first call s |")
    print("| --- | --- | --- | --- | --- | --- |")
    default = torchbridge.get_backend("cpu")
    for name in args.models:
        batch = BATCHES[name][0]
        model, x = build("hf", name, batch, 1.0)
        prepared: dict[str, Any] = {}
        with bench.cold_compiles() as root:
            with torch.inference_mode():
                expected = bench.sample_call(default, x)(model)
            for label in ("eager", "compile"):
                prepared[label] = bench._prepare(default, label, model, x, expected)
            for label, (variant, config) in VARIANTS.items():
                backend = bench.with_compile_cache(
                    torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(**config)),
                    tempfile.mkdtemp(dir=root))
                prepared[label] = bench._prepare(backend, variant, model, x, expected)
            seconds = interleaved_latency([v.call for v in prepared.values()],
                                          default.synchronize, warmup=2,
                                          repeats=args.rounds,
                                          min_seconds=1.0 * len(prepared))
        eager = seconds[0]
        for (label, v), sec in zip(prepared.items(), seconds, strict=True):
            print(f"| {name} | {label} | {_frozen(v)} | {sec * 1e3:.2f} | "
                  f"{eager / sec:.2f}x | {v.first_call_s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
