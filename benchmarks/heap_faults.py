"""Page faults and the time of repeated calls, with the CPU backend's heap_reuse pass off
(glibc's malloc as it is) and on, for the Hugging Face models of torchbridge.hf_models at
O3 and O3 with quantize="int8".

glibc's thresholds are process-wide and cannot be put back, so each (model, variant,
heap_reuse) runs in a fresh process of its own, as a user's would: the eager model is
called once first (a user comparing outputs), then the prepared model is called
repeatedly (warm-up, then --calls calls timed one after the other; the median, and the
page faults per call). The two settings of one row run one after the other.

    python benchmarks/heap_faults.py [--calls 30] [--models llama gpt2 bert vit resnet]
        [--variants O3 "O3 int8"]

Prints the machine line (CPU model and flags) and one row per model and variant.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

_ONE = """
import json, re, statistics, sys, time, torch, torchbridge
from torchbridge.builtin.cpu import heap
from torchbridge.hf_models import BATCHES, hf_reference_models

name, variant, on, calls = sys.argv[1], sys.argv[2], sys.argv[3] == "on", int(sys.argv[4])
reference = {r.name: r for r in hf_reference_models()}[name]
model = reference.build().eval()
sample = reference.make_input(BATCHES[name][0])
config = torchbridge.TorchBridgeConfig(hardware={"cpu": {"heap_reuse": on}})
backend = torchbridge.get_backend("cpu", config)
call = (lambda m: m(**sample)) if isinstance(sample, dict) else (lambda m: m(sample))
with torch.inference_mode():
    call(model)
    result = backend.optimize(model, "O3", sample_input=sample,
                              quantize="int8" if variant.endswith("int8") else None)
    prepared = result.model
    for _ in range(5):
        call(prepared)
    seconds, start = [], heap.minor_faults()
    for _ in range(calls):
        began = time.perf_counter()
        call(prepared)
        seconds.append(time.perf_counter() - began)
    faults = (heap.minor_faults() - start) / calls
record = next(p for p in result.passes if p.name == "heap_reuse")
said = " ".join([record.detail or "", *(n for n in result.notes if n.startswith("heap_reuse"))])
fresh = re.search(r"takes ([0-9.]+ MiB) of fresh pages", said)
print(json.dumps({"ms": statistics.median(seconds) * 1e3, "faults": faults,
                  "status": record.status, "fresh": fresh.group(1) if fresh else "-"}))
"""


def _one(name: str, variant: str, on: bool, calls: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _ONE, name, variant, "on" if on else "off",
                          str(calls)], capture_output=True, text=True, check=True)
    answer: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2", "bert", "vit",
                                                        "resnet"])
    parser.add_argument("--variants", nargs="+", default=["O3", "O3 int8"])
    args = parser.parse_args()
    from torchbridge.bench import machine

    print(machine())
    print("| model | variant | heap_reuse off: ms a call (page faults a call) | on: ms a "
          "call (page faults a call) | off / on | the pass, with heap_reuse on |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        for variant in args.variants:
            off = _one(name, variant, False, args.calls)
            on = _one(name, variant, True, args.calls)
            print(f"| {name} | {variant} | {off['ms']:.2f} ({off['faults']:.0f}) | "
                  f"{on['ms']:.2f} ({on['faults']:.0f}) | {off['ms'] / on['ms']:.2f}x | "
                  f"{on['status']}; a call takes {on['fresh']} of fresh pages |", flush=True)


if __name__ == "__main__":
    main()
