"""What cpu_bf16_matmul_attention costs a user's first call: plain torch.compile, O3 with
torch's flash attention kernel (config hardware.cpu.bf16_matmul_attention = false) and O3
with cpu_bf16_matmul_attention (= true), each prepared plus called once in a fresh Python
process with empty inductor caches, then again in a second process sharing the first's
cache (torchbridge.bench_firstcall, as `bench --suite hf` measures its first-call
columns). The Hugging Face models of torchbridge.hf_models that have attention; the
variants alternate within each round.

    python benchmarks/first_call_attention.py [--rounds 2] [--models llama gpt2 bert vit]

Prints the machine line (CPU model and flags) and one row per model and round.
"""

from __future__ import annotations

import argparse
import os

from torchbridge import bench_firstcall
from torchbridge.bench import machine
from torchbridge.hf_models import BATCHES

SETTING = "TORCHBRIDGE_HARDWARE__CPU__BF16_MATMUL_ATTENTION"  # read by each child's config
# label: (variant, the setting); plain torch.compile reads no TorchBridge config.
VARIANTS = {"compile": ("compile", None), "O3 flash": ("O3", "false"),
            "O3 bf16 matmul": ("O3", "true")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2", "bert", "vit"])
    args = parser.parse_args()
    print(machine())
    columns = ["round", "model", *(f"{v} first s (second s)" for v in VARIANTS),
               "O3 flash / compile", "O3 bf16 matmul / compile"]
    print("| " + " | ".join(columns) + " |")
    print("| --- " * len(columns) + "|")
    for round_ in range(1, args.rounds + 1):
        for name in args.models:
            first: dict[str, float] = {}
            cells = []
            for label, (variant, setting) in VARIANTS.items():
                if setting is not None:
                    os.environ[SETTING] = setting
                one, two = bench_firstcall.measure("hf", name, BATCHES[name][0], variant)
                first[label] = one["first_call_s"]
                cells.append(f"{one['first_call_s']:.1f} ({two['first_call_s']:.1f})")
            ratios = [f"{first[v] / first['compile']:.2f}x"
                      for v in ("O3 flash", "O3 bf16 matmul")]
            print(f"| {round_} | {name} | " + " | ".join(cells + ratios) + " |", flush=True)


if __name__ == "__main__":
    main()
