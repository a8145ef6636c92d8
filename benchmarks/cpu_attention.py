"""O3 with the CPU backend's bfloat16 attention (cpu_bf16_matmul_attention, offered to the
kernel_substitution pass by config hardware.cpu.bf16_matmul_attention) against O3 as it is
by default (torch's flash attention kernel in bfloat16), both against eager float32: the
Hugging Face models of torchbridge.hf_models that have attention, timed round-robin in one
process, medians.

    python benchmarks/cpu_attention.py [--rounds 50] [--models llama gpt2 bert vit]

Prints the machine line (CPU model and flags) and one row per model.
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
from torchbridge.optimize.measure import interleaved_latency


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2", "bert", "vit"])
    args = parser.parse_args()
    print(machine())
    flash = torchbridge.TorchBridgeConfig()  # the default: torch's kernel
    matmul = torchbridge.TorchBridgeConfig(hardware={"cpu": {"bf16_matmul_attention": True}})
    references = {r.name.split("-")[0]: r for r in hf_reference_models()}
    for name in args.models:
        reference = references[name]
        model = reference.build().eval()
        sample = reference.make_input(BATCHES[name][0])

        def call(m: torch.nn.Module, sample: Any = sample) -> torch.Tensor:
            with torch.inference_mode():
                return _logits(m(**sample) if isinstance(sample, dict) else m(sample))

        variants: dict[str, torch.nn.Module] = {"eager": model}
        for label, config in (("o3 flash", flash), ("o3 bf16 matmul", matmul)):
            result = torchbridge.get_backend("cpu", config).optimize(
                copy.deepcopy(model), "O3", sample_input=sample)
            used = sorted({s.get("implementation", "its own code")
                           for s in result.kernel_substitutions
                           if s["op"] == "scaled_dot_product_attention"
                           and s["status"] == "substituted"}) or ["its own code"]
            print(f"{name} {label}: attention runs {', '.join(used)}")
            variants[label] = result.model
        expected = call(model)
        medians = interleaved_latency(
            [functools.partial(call, m) for m in variants.values()], lambda: None, warmup=1,
            repeats=args.rounds, min_seconds=0)
        seconds = dict(zip(variants, medians, strict=True))
        base = seconds["eager"]
        cells = []
        for label, m in variants.items():
            median = seconds[label]
            error = ((call(m) - expected).abs().max() / expected.abs().max()).item()
            cells.append(f"{label} {median * 1e3:.2f} ms ({base / median:.2f}x, "
                         f"max rel error {error:.4f})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
