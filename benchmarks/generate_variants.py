"""Where generate()'s time goes after prepare_model on a CPU: greedy generate() tokens per
second for the hf suite's decoders, eager float32 against O3 and two forms O3's decoding
steps could take. generate() passes a KV cache, so its calls run O3's forward uncompiled
(the compiled forward serves calls shaped like the sample input): bf16 Linear weights
under autocast. The other rows separate the two halves of that: the whole model in bf16
without autocast (no casts; elementwise ops in bf16 too, so not what O3 computes), and
float32 weights under autocast (the casts, weights cast every call).

    python benchmarks/generate_variants.py [--rounds 7] [--new-tokens 32]

Prints the machine line (CPU model and flags) and one row per decoder; all variants of a
model are timed round-robin in one process (measure.interleaved_latency), medians.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

import torch
import torchbridge
from torchbridge.bench import machine
from torchbridge.hf_models import hf_reference_models
from torchbridge.optimize.measure import interleaved_latency


class _Autocast(torch.nn.Module):
    """generate() of `model` under bf16 autocast."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model.generate(*args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    backend = torchbridge.get_backend()
    print(machine(backend))
    print("| model | eager fp32 tok/s | O3 | whole model bf16, no autocast | fp32 weights "
          "under autocast |")
    print("| --- | --- | --- | --- | --- |")
    for ref in hf_reference_models():
        if not ref.is_decoder:
            continue
        base = ref.build().eval()
        ids = ref.make_input(1)["input_ids"][:, :16]
        variants = {
            "eager": base,
            "O3": backend.prepare_model(copy.deepcopy(base), "O3",
                                        sample_input={"input_ids": ids}),
            "bf16": copy.deepcopy(base).to(torch.bfloat16),
            "autocast": _Autocast(copy.deepcopy(base)),
        }
        calls: list[Callable[[], Any]] = []
        for model in variants.values():
            def generate(model: Any = model, ids: torch.Tensor = ids) -> Any:
                return model.generate(ids, max_new_tokens=args.new_tokens,
                                      min_new_tokens=args.new_tokens, do_sample=False,
                                      pad_token_id=0)
            calls.append(generate)
        with torch.inference_mode():
            seconds = interleaved_latency(calls, backend.synchronize, warmup=1,
                                          repeats=args.rounds)
        rates = [args.new_tokens / s for s in seconds]
        cells = [f"{rates[0]:.0f}"] + [f"{r:.0f} ({r / rates[0]:.2f}x)" for r in rates[1:]]
        print(f"| {ref.name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
