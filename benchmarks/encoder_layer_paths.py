"""What O3 costs and gains on models built from nn.TransformerEncoderLayer (the reference
suite's encoder and decoder LM), pass by pass: plain torch.compile, O3, and O3 without its
compile pass, without transformer_composite (the layers keep PyTorch's fused fast path,
which runs in bfloat16 once low_precision_weights stored the weights so), or without both.

Each variant's first call (prepare_model or torch.compile, and the first forward) runs in
a fresh process with empty inductor caches, inductor's one-time setup paid before by a
warm-up compile that builds a kernel. Then one process prepares every variant and times
them round-robin (median ms a call, with eager beside), and gives each one's largest
relative error against float32 eager on the sample input.

    python benchmarks/encoder_layer_paths.py [--models encoder decoder_lm] [--batches 8 32]

Rows of one run compare; a first call moves by a few tenths of a second between processes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torchbridge
from torchbridge import TorchBridgeConfig, models
from torchbridge.bench import machine
from torchbridge.optimize.measure import interleaved_latency, tensor_drift

# variant -> the O3 passes it disables (None: plain torch.compile; "eager": the model)
VARIANTS: dict[str, list[str] | None] = {
    "compile": None,
    "O3": [],
    "O3 without compile": ["compile"],
    "O3 without transformer_composite": ["transformer_composite"],
    "O3 without both": ["transformer_composite", "compile"],
}
BATCHES = {"encoder": (8, 32), "decoder_lm": (4, 16)}


def _build(name: str, batch: int) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    spec = {m.name: m for m in models.reference_models()}[name]
    return spec.build().eval(), spec.make_input(batch)


def _prepared(variant: str, model: torch.nn.Module, x: torch.Tensor) -> Any:
    disabled = VARIANTS[variant]
    if disabled is None:
        return torch.compile(model), None
    config = TorchBridgeConfig(optimization={"disabled_passes": disabled})
    result = torchbridge.get_backend("cpu", config).optimize(model, "O3", sample_input=x)
    return result.model, result


def _first_call(name: str, batch: int, variant: str) -> None:
    """In a fresh process: prints {"first_call_s", "kept"} as JSON."""
    cache = tempfile.mkdtemp(prefix="tb-encoder-paths-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        torch.compile(lambda t: (t * 2).relu().sum())(torch.randn(3, 8))  # inductor's setup
        torch._dynamo.reset()
        model, x = _build(name, batch)
        with torch.no_grad():
            start = time.perf_counter()
            prepared, result = _prepared(variant, model, x)
            prepared(x)
            seconds = time.perf_counter() - start
        kept = None if result is None else \
            [p.name for p in result.passes if p.status == "applied"]
        print(json.dumps({"first_call_s": seconds, "kept": kept}))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _steady(name: str, batch: int) -> dict[str, tuple[float, float]]:
    """variant -> (median ms a call, largest relative error against eager), one process."""
    model, x = _build(name, batch)
    with torch.no_grad():
        reference = model(x)
        calls = {"eager": model}
        for variant in VARIANTS:
            calls[variant] = _prepared(variant, model, x)[0]
        errors = {}
        for variant, call in calls.items():
            errors[variant] = tensor_drift(reference, call(x))[1]
        seconds = interleaved_latency([lambda c=c: c(x) for c in calls.values()],
                                      lambda: None, warmup=2, repeats=15)
    return {v: (s * 1e3, errors[v]) for v, s in zip(calls, seconds, strict=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(BATCHES), choices=list(BATCHES))
    parser.add_argument("--batches", nargs="+", type=int)
    parser.add_argument("--first-call", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if args.first_call:
        name, batch, variant = args.first_call
        _first_call(name, int(batch), variant)
        return
    print(machine())
    print("| model | batch | variant | first call s | kept | ms a call | vs eager "
          "| rel error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        for batch in args.batches or BATCHES[name]:
            firsts = {}
            for variant in VARIANTS:
                out = subprocess.run([sys.executable, __file__, "--first-call", name,
                                      str(batch), variant], capture_output=True, text=True,
                                     check=True)
                firsts[variant] = json.loads(out.stdout.strip().splitlines()[-1])
            steady = _steady(name, batch)
            eager_ms = steady["eager"][0]
            for variant, (ms, error) in steady.items():
                first = firsts.get(variant)
                kept = "-" if first is None or first["kept"] is None else \
                    ", ".join(p for p in first["kept"] if p != "device_placement")
                first_s = "-" if first is None else f"{first['first_call_s']:.2f}"
                print(f"| {name} | {batch} | {variant} | {first_s} | {kept} | {ms:.2f} | "
                      f"{eager_ms / ms:.2f}x | {error:.1e} |", flush=True)


if __name__ == "__main__":
    main()
