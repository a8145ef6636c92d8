"""O3 on a CPU with oneDNN weight prepacking (config hardware.cpu.weight_prepack: None, the
default, prepacks while float convolutions or linear layers remain) against O3 without it
(False), both against eager float32: the Hugging Face models of torchbridge.hf_models,
timed round-robin in one process, medians.

    python benchmarks/cpu_prepack.py [--rounds 30] [--models llama gpt2 bert vit resnet]

Inductor registers its weight-pack patterns at the first frozen compile that wants them
and keeps them for the process (builtin/cpu/prepack.py), so every model is prepared
without prepacking first, then with it. Prints the machine line (CPU model and flags),
one line per prepared variant (the passes applied and what the report says of
prepacking) and one row per model. (No first-call figures: the variants share the
process's compile caches.)
"""

from __future__ import annotations

import argparse
import copy
import functools
from typing import Any

import torch
import torchbridge
from torchbridge.bench import machine
from torchbridge.hf_models import BATCHES, hf_reference_models
from torchbridge.optimize.measure import interleaved_latency, sample_call

VARIANTS = {"o3 unpacked": {"weight_prepack": False}, "o3 prepacked": {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(BATCHES))
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    print(machine())
    references = {r.name: r for r in hf_reference_models()}
    models = {name: references[name].build().eval() for name in args.models}
    samples = {name: references[name].make_input(BATCHES[name][0]) for name in args.models}
    prepared: dict[str, dict[str, torch.nn.Module]] = {name: {} for name in args.models}
    for label, cpu in VARIANTS.items():  # unpacked first: see the module's docstring
        backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
            hardware={"cpu": cpu}))
        for name in args.models:
            result = backend.optimize(copy.deepcopy(models[name]), "O3",
                                      sample_input=samples[name])
            kept = [p.name for p in result.passes if p.status == "applied"]
            packing = [n for n in result.notes if "prepack" in n][:1]
            print(f"{name} {label}: applied {', '.join(kept)}; {' '.join(packing)}",
                  flush=True)
            prepared[name][label] = result.model
    backend = torchbridge.get_backend("cpu")
    print("| model | eager ms | " + " | ".join(VARIANTS) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in VARIANTS) + " |")
    for name in args.models:
        call = sample_call(backend, samples[name])
        variants: dict[str, Any] = {"eager": models[name], **prepared[name]}
        medians = interleaved_latency([functools.partial(call, m) for m in variants.values()],
                                      backend.synchronize, warmup=3, repeats=args.rounds,
                                      min_seconds=0)
        seconds = dict(zip(variants, medians, strict=True))
        base = seconds["eager"]
        cells = [f"{seconds[label] * 1e3:.2f} ms ({base / seconds[label]:.2f}x)"
                 for label in VARIANTS]
        print(f"| {name} | {base * 1e3:.2f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
