"""What this CPU's matmuls allow: every nn.Linear (and GPT-2's Conv1D) of the Hugging Face
models of torchbridge.hf_models, at the shapes the benchmark's sample input gives them,
timed alone in float32, bfloat16 and int8 (torch._int_mm, what quantize="int8" compiles
to), round-robin in one process, medians. Per model: the eager model's time, its Linears'
float32 time (their share of eager), and how much faster the same Linears run in bfloat16
and int8. That last figure bounds what O3 (bfloat16) and O3 int8 can gain on the Linears.

    python benchmarks/cpu_gemm_rates.py [--rounds 30] [--models llama gpt2 bert vit]
    python benchmarks/cpu_gemm_rates.py --rows 1 --models llama gpt2

The ResNet is left out: its time is in convolutions, not Linears. `--rows 1`: every Linear
given one row, as in a step of generate() for one sequence (each weight multiplies one
token's activations); the eager column is then left out, the model's forward being another
shape.

Prints the machine line (CPU model and flags) and a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torchbridge.bench import machine
from torchbridge.hf_models import BATCHES, hf_reference_models


def _linear_shapes(model: torch.nn.Module, sample: Any) -> list[tuple[int, int, int]]:
    """(rows, in, out) of every Linear call on the sample, in call order."""
    shapes: list[tuple[int, int, int]] = []

    def record(module: torch.nn.Module, inputs: tuple[Any, ...], _: Any) -> None:
        x = inputs[0]
        out = module.weight.shape[0 if isinstance(module, torch.nn.Linear) else 1]
        shapes.append((x.numel() // x.shape[-1], x.shape[-1], out))

    # nn.Linear, and transformers' Conv1D (GPT-2's projections: addmm with the weight
    # stored in x out)
    hooks = [m.register_forward_hook(record) for m in model.modules()
             if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"]
    with torch.inference_mode():
        model(**sample) if isinstance(sample, dict) else model(sample)
    for hook in hooks:
        hook.remove()
    return shapes


def _calls(rows: int, k: int, n: int) -> dict[str, Callable[[], Any]]:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    xb, wb = x.bfloat16(), w.bfloat16()
    x8 = torch.randint(-127, 127, (rows, k), dtype=torch.int8, generator=g)
    w8 = torch.randint(-127, 127, (n, k), dtype=torch.int8, generator=g).t()
    # _int_mm wants more than 16 rows; smaller calls are left to float (torchao does too)
    int8 = (lambda: torch._int_mm(x8, w8)) if rows > 16 and k % 8 == 0 and n % 8 == 0 \
        else (lambda: F.linear(x, w))
    return {"float32": lambda: F.linear(x, w), "bfloat16": lambda: F.linear(xb, wb),
            "int8": int8}


def _median_seconds(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    with torch.inference_mode():
        for fn in fns.values():
            fn()
        for _ in range(rounds):
            for name, fn in fns.items():
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--models", nargs="+", default=["llama", "gpt2", "bert", "vit"])
    parser.add_argument("--rows", type=int, help="every Linear given this many rows (a "
                        "decoding step: 1 per sequence)")
    args = parser.parse_args()
    print(machine())
    references = {r.name.split("-")[0]: r for r in hf_reference_models()}
    print("| model | eager | Linears in float32 (share of eager) | bfloat16 | int8 | "
          "bfloat16 / float32 rate | int8 / float32 rate |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        reference = references[name]
        model = reference.build().eval()
        sample = reference.make_input(BATCHES[name][0])

        def run(model: torch.nn.Module = model, sample: Any = sample) -> Any:
            return model(**sample) if isinstance(sample, dict) else model(sample)

        # --rows: the model's forward is another shape than the Linears timed, not timed
        eager = None if args.rows is not None else \
            _median_seconds({"eager": run}, args.rounds)["eager"]
        totals = {"float32": 0.0, "bfloat16": 0.0, "int8": 0.0}
        per_shape: dict[tuple[int, int, int], dict[str, float]] = {}
        shapes = _linear_shapes(model, sample)
        if args.rows is not None:
            shapes = [(args.rows, k, n) for _, k, n in shapes]
        for shape in sorted(set(shapes)):
            per_shape[shape] = _median_seconds(_calls(*shape), args.rounds)
        for shape in shapes:
            for dtype in totals:
                totals[dtype] += per_shape[shape][dtype]
        fp32 = totals["float32"]
        eager_cell = "-" if eager is None else f"{eager * 1e3:.2f} ms"
        share = f"{fp32 * 1e3:.2f} ms" + ("" if eager is None else f" ({fp32 / eager:.0%})")
        print(f"| {name} | {eager_cell} | {share} | "
              f"{totals['bfloat16'] * 1e3:.2f} ms | {totals['int8'] * 1e3:.2f} ms | "
              f"{fp32 / totals['bfloat16']:.2f}x | {fp32 / totals['int8']:.2f}x |")


if __name__ == "__main__":
    main()
