"""Page faults and the time of repeated calls, with the CPU backend's heap_reuse pass off
(glibc's malloc as it is) and on, for the Hugging Face models of torchbridge.hf_models.

glibc's thresholds are process-wide and cannot be put back, so each model runs in two
fresh processes, one with the pass off and one with it on. Each process prepares the
variants as `torchbridge bench --suite hf` does, in its order (eager, plain compile, O3,
O3 without a sample input, O3 int8, O3 int8_weight_only), so that the heap has the
history it has in the suite; then calls each variant repeatedly (warm-up, then --calls
calls timed one after the other: the median, and the page faults per call), and then all
of them round-robin, --calls rounds, as the suite times them (each call's page faults
counted alone).

    python benchmarks/heap_faults.py [--calls 30] [--models llama gpt2 bert vit resnet]

Prints the machine line (CPU model and flags) and one row per model and variant.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from torchbridge.bench import machine
from torchbridge.hf_models import BATCHES

_ONE = """
import json, statistics, sys, time, torch, torchbridge
from torchbridge import bench
from torchbridge.builtin.cpu import heap
from torchbridge.hf_models import BATCHES, hf_reference_models

name, on, calls = sys.argv[1], sys.argv[2] == "on", int(sys.argv[3])
reference = {r.name: r for r in hf_reference_models()}[name]
model = reference.build().eval()
sample = reference.make_input(BATCHES[name][0])
backend = torchbridge.get_backend(
    "cpu", torchbridge.TorchBridgeConfig(hardware={"cpu": {"heap_reuse": on}}))
with torch.inference_mode():
    expected = model(**sample) if isinstance(sample, dict) else model(sample)
variants = {v: bench._prepare(backend, v, model, sample, expected)
            for v in ("eager", "compile", "O3", "O3 no sample", "O3 int8",
                      "O3 int8_weight_only")}
rows = {}
with torch.inference_mode():
    for label, variant in variants.items():
        for _ in range(5):
            variant.call()
        seconds, start = [], heap.minor_faults()
        for _ in range(calls):
            began = time.perf_counter()
            variant.call()
            seconds.append(time.perf_counter() - began)
        passes = {p["name"]: p["status"] for p in variant.passes}
        rows[label] = {"ms": statistics.median(seconds) * 1e3,
                       "faults": (heap.minor_faults() - start) / calls,
                       "heap_reuse": passes.get("heap_reuse", "-"),
                       "rr_seconds": [], "rr_faults": 0}
    # Then round-robin, as the suite times them: each call's faults counted alone.
    for _ in range(calls):
        for label, variant in variants.items():
            start, began = heap.minor_faults(), time.perf_counter()
            variant.call()
            rows[label]["rr_seconds"].append(time.perf_counter() - began)
            rows[label]["rr_faults"] += heap.minor_faults() - start
for row in rows.values():
    row["rr_ms"] = statistics.median(row.pop("rr_seconds")) * 1e3
    row["rr_faults"] /= calls
print(json.dumps(rows))
"""


def _one(name: str, on: bool, calls: int) -> dict[str, dict[str, Any]]:
    out = subprocess.run([sys.executable, "-c", _ONE, name, "on" if on else "off",
                          str(calls)], capture_output=True, text=True, check=True)
    answer: dict[str, dict[str, Any]] = json.loads(out.stdout.strip().splitlines()[-1])
    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--models", nargs="+", default=list(BATCHES))
    args = parser.parse_args()

    print(machine())
    print("| model | variant | off: repeated, ms (page faults a call) | off: round-robin | "
          "on: repeated | on: round-robin | heap_reuse pass (on) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        off, on = _one(name, False, args.calls), _one(name, True, args.calls)
        for variant, a in off.items():
            b = on[variant]
            print(f"| {name} | {variant} | {a['ms']:.2f} ({a['faults']:.0f}) | "
                  f"{a['rr_ms']:.2f} ({a['rr_faults']:.0f}) | {b['ms']:.2f} "
                  f"({b['faults']:.0f}) | {b['rr_ms']:.2f} ({b['rr_faults']:.0f}) | "
                  f"{b['heap_reuse']} |", flush=True)


if __name__ == "__main__":
    main()
