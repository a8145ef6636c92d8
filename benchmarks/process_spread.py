"""How far one process's figures are from another's: the same model prepared at O3 and
timed round-robin against eager float32 in several fresh processes, one after another.
The benchmark tables come from one process each; this says how much a row can move when
the same command runs again.

    python benchmarks/process_spread.py [--processes 5] [--models bert llama] [--quantize int8]

Prints the machine line (CPU model and flags), each process's medians (eager, O3 and
their ratio), then per model the smallest, median and largest of each across processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any


def child(name: str, quantize: str | None, rounds: int) -> dict[str, float]:
    import torchbridge
    from torchbridge.hf_models import BATCHES, hf_reference_models
    from torchbridge.optimize.measure import interleaved_latency, sample_call

    backend = torchbridge.get_backend()
    reference = {r.name: r for r in hf_reference_models()}[name]
    model = reference.build()
    sample = reference.make_input(BATCHES[name][0])
    prepared = backend.optimize(model, "O3", sample_input=sample, quantize=quantize).model
    call = sample_call(backend, sample)
    eager, o3 = interleaved_latency([lambda: call(model), lambda: call(prepared)],
                                    backend.synchronize, warmup=3, repeats=rounds,
                                    min_seconds=0)
    return {"eager": eager * 1e3, "O3": o3 * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=["bert", "llama"])
    parser.add_argument("--quantize", default=None, help="a quantize mode for the O3 side")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.quantize, args.rounds)))
        return
    from torchbridge.bench import machine

    print(machine())
    label = f"O3 {args.quantize}" if args.quantize else "O3"
    for name in args.models:
        runs: list[dict[str, Any]] = []
        for i in range(args.processes):
            argv = [sys.executable, __file__, "--child", name, "--rounds", str(args.rounds)]
            if args.quantize:
                argv += ["--quantize", args.quantize]
            out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
            run = json.loads(out.strip().splitlines()[-1])
            run["ratio"] = run["eager"] / run["O3"]
            runs.append(run)
            print(f"{name} process {i + 1}: eager {run['eager']:.2f} ms, {label} "
                  f"{run['O3']:.2f} ms, {run['ratio']:.2f}x", flush=True)
        for key, unit in (("eager", " ms"), ("O3", " ms"), ("ratio", "x")):
            values = sorted(r[key] for r in runs)
            print(f"{name} {label if key == 'O3' else key}: min {values[0]:.2f}{unit}, "
                  f"median {statistics.median(values):.2f}{unit}, max {values[-1]:.2f}{unit} "
                  f"(max/min {values[-1] / values[0]:.2f})")


if __name__ == "__main__":
    main()
