"""prepare_model without a sample input: what the first call's timing
(optimize/first_call.py) keeps, against the prepared model it replaced. Each model is
prepared at O3 without a sample input twice, with `optimization.time_first_call` off (the
prepared model as it is) and on; each is called once (the first call: compile, and with
the timing on, the check and timing that decide), then eager and both are timed
round-robin with eager in one process (measure.interleaved_latency; each prepared
model in its own round with eager), medians.

    python benchmarks/no_sample_first_call.py [--rounds 200]

Prints the machine line (CPU model and flags) and one row per model: calls in
microseconds, the first call in seconds, and what the timing kept.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torchbridge
from torchbridge.bench import machine
from torchbridge.optimize.measure import interleaved_latency


def _mlp(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 10)).eval()


def _ffn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                               torch.nn.Linear(4096, 1024)).eval()


# (name, model, input): a model too small for compiling or bf16 to pay on a CPU, and one
# whose matmuls gain from bf16.
CASES: list[tuple[str, Callable[[], torch.nn.Module], Callable[[], torch.Tensor]]] = [
    ("MLP 64 wide, batch 1", functools.partial(_mlp, 64), lambda: torch.randn(1, 64)),
    ("MLP 512 wide, batch 8", functools.partial(_mlp, 512), lambda: torch.randn(8, 512)),
    ("FFN 1024-4096-1024, batch 256", _ffn, lambda: torch.randn(256, 1024)),
]


def _prepared(model: torch.nn.Module, x: torch.Tensor, timing: bool
              ) -> tuple[torch.nn.Module, float]:
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"time_first_call": timing}))
    prepared = backend.prepare_model(model, "O3")
    started = time.perf_counter()
    with torch.no_grad():
        prepared(x)
    return prepared, time.perf_counter() - started


def _kept(prepared: torch.nn.Module) -> str:
    result = torchbridge.optimization_result(prepared)
    assert result is not None
    note = next((n for n in result.notes if n.startswith("timed on the first call")), "")
    if "O0 was the fastest" in note:
        return "O0"
    if "uncompiled was the fastest" in note:
        return "uncompiled"
    return "prepared" if note else "not timed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    print(machine(torchbridge.get_backend("cpu")))
    print("| model | eager (in each round) | O3, not timed (vs eager; first call) | "
          "O3, first call timed (vs eager; first call) | kept |")
    print("| --- | --- | --- | --- | --- |")
    for name, build, make_input in CASES:
        model, x = build(), make_input()
        untimed, untimed_first = _prepared(model, x, timing=False)
        timed, timed_first = _prepared(model, x, timing=True)
        # Each against eager in its own round-robin: a call right after a compiled one runs
        # slower on small models (caches), which a three-way round-robin put on one side.
        ratios, eager_us = [], []
        for prepared in (untimed, timed):
            calls: list[Any] = [functools.partial(m, x) for m in (model, prepared)]
            with torch.no_grad():
                eager, ours = interleaved_latency(calls, lambda: None, warmup=3,
                                                  repeats=args.rounds, min_seconds=0)
            ratios.append(f"{ours * 1e6:.1f} us ({eager / ours:.2f}x")
            eager_us.append(f"{eager * 1e6:.1f}")
        print(f"| {name} | {' / '.join(eager_us)} us | {ratios[0]}; {untimed_first:.1f} s) | "
              f"{ratios[1]}; {timed_first:.1f} s) | {_kept(timed)} |", flush=True)


if __name__ == "__main__":
    main()
