"""With quantize="int8" on a CPU: the rest of the model in float32 (autocast off) or in
bfloat16 (autocast on), for the Hugging Face models of torchbridge.hf_models. Each model
is prepared at O3 with int8 both ways (the autocast pass's threshold on nn.Linear's share
of the FLOPs, quantize.INT8_FLOAT32_MIN_LINEAR_SHARE, patched to force each), timed
round-robin with eager float32 and plain O3 in one process (measure.interleaved_latency),
medians. The last column is what prepare_model chooses by default.

    python benchmarks/int8_autocast.py [--rounds 30] [--models llama gpt2 bert vit resnet]

Prints the machine line (CPU model and flags) and one row per model.
"""

from __future__ import annotations

import argparse
import functools
import unittest.mock
from typing import Any

import torch
import torchbridge
from torchbridge.bench import machine
from torchbridge.hf_models import BATCHES, hf_reference_models
from torchbridge.optimize import quantize
from torchbridge.optimize.measure import interleaved_latency, sample_call
from torchbridge.optimize.passes import PassContext


def _share(backend: Any, model: torch.nn.Module, sample: Any) -> float | None:
    ctx = PassContext(backend, torchbridge.OptimizationLevel.O3, backend.config,
                      backend.get_device_info(), training=False, sample_input=sample)
    return quantize.linear_flop_share(model, ctx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2", "bert", "vit",
                                                        "resnet"])
    args = parser.parse_args()
    backend = torchbridge.get_backend("cpu")
    print(machine(backend))
    print("| model | nn.Linear share of FLOPs | eager | O3 | int8, float32 activations | "
          "int8, bf16 activations | default choice |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    references = {r.name: r for r in hf_reference_models()}
    for name in args.models:
        reference = references[name]
        model = reference.build()
        sample = reference.make_input(BATCHES[name][0])
        variants: dict[str, torch.nn.Module] = {
            "eager": model, "O3": backend.optimize(model, "O3", sample_input=sample).model}
        for label, threshold in (("float32", 0.0), ("bf16", 1.01)):
            with unittest.mock.patch.object(quantize, "INT8_FLOAT32_MIN_LINEAR_SHARE",
                                            threshold):
                result = backend.optimize(model, "O3", sample_input=sample, quantize="int8")
            autocast = next(p.status for p in result.passes if p.name == "autocast")
            assert autocast == ("skipped" if label == "float32" else "applied"), \
                result.summary()
            variants[label] = result.model
        call = sample_call(backend, sample)
        seconds = interleaved_latency([functools.partial(call, m) for m in variants.values()],
                                      backend.synchronize, warmup=3, repeats=args.rounds,
                                      min_seconds=0)
        ms = {label: s * 1e3 for label, s in zip(variants, seconds, strict=True)}
        share = _share(backend, model, sample)
        chosen = "float32" if share is not None and \
            share >= quantize.INT8_FLOAT32_MIN_LINEAR_SHARE else "bf16"

        def cell(label: str, ms: dict[str, float] = ms) -> str:
            return f"{ms[label]:.2f} ms ({ms['eager'] / ms[label]:.2f}x)"

        print(f"| {name} | {share if share is None else round(share, 2)} | "
              f"{ms['eager']:.2f} ms | {cell('O3')} | {cell('float32')} | {cell('bf16')} | "
              f"{chosen} |", flush=True)


if __name__ == "__main__":
    main()
