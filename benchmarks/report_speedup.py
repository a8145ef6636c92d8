"""Whether the speedup prepare_model reports is what the model then runs at: O3 with a
sample input on Hugging Face models (the suite's and three it does not hold: a T5 encoder,
DeiT, RoBERTa), each in a fresh process (O0's first calls in a process are what the
timing had to deal with), with O0 called once untimed before the timing rounds
(optimize/fastest.WARM_BASELINE, the default) and without, alternating. After
prepare_model, the model as given and the prepared one are timed alone, each in blocks of
10 calls after one untimed call (median of 5 blocks, twice each, alternating): "loop".
A row per process: the report's speedup, the loop's, and their ratio; then per variant
the mean, lowest and highest ratio.

    python benchmarks/report_speedup.py [--models t5enc deit roberta] [--runs 4]

A ratio above 1 is a report that says more than the loop measured. Compare the variants
of one run: this machine is noisy, and the loop's figure moves too.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

VARIANTS = ("O0 warmed", "O0 not warmed")


def _held_out(name: str) -> tuple[Callable[[], torch.nn.Module], Any]:
    import transformers as tf
    g = torch.Generator().manual_seed(1)
    ids = {"input_ids": torch.randint(0, 4000, (4, 96), generator=g)}
    size = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=768)
    if name == "t5enc":
        return (lambda: tf.T5EncoderModel(tf.T5Config(
            d_model=256, d_kv=64, d_ff=768, num_layers=2, num_heads=4, vocab_size=4096)),
            ids)
    if name == "deit":
        return (lambda: tf.DeiTForImageClassification(tf.DeiTConfig(
            image_size=128, patch_size=16, **size)),
            torch.randn(4, 3, 128, 128, generator=g))
    if name == "roberta":
        return (lambda: tf.RobertaForMaskedLM(tf.RobertaConfig(vocab_size=4096, **size)),
                ids)
    from torchbridge.hf_models import BATCHES, hf_reference_models
    spec = {s.name: s for s in hf_reference_models()}[name]
    return spec.build, spec.make_input(BATCHES[name][0])


def _call(model: torch.nn.Module, sample: Any) -> Any:
    return model(**sample) if isinstance(sample, dict) else model(sample)


def _loop(model: torch.nn.Module, sample: Any) -> float:
    blocks = []
    with torch.no_grad():
        for _ in range(5):
            _call(model, sample)
            started = time.perf_counter()
            for _ in range(10):
                _call(model, sample)
            blocks.append((time.perf_counter() - started) / 10)
    return statistics.median(blocks)


def child(name: str, variant: str) -> None:
    import torchbridge
    from torchbridge.optimize import fastest
    fastest.WARM_BASELINE = variant == VARIANTS[0]
    torch.manual_seed(0)
    build, sample = _held_out(name)
    model = build().eval()
    result = torchbridge.get_backend("cpu").optimize(copy.deepcopy(model), "O3",
                                                     sample_input=sample)
    given, prepared = [], []
    for _ in range(2):
        given.append(_loop(model, sample))
        prepared.append(_loop(result.model, sample))
    print(json.dumps({"report": result.speedup,
                      "loop": statistics.mean(given) / statistics.mean(prepared)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["t5enc", "deit", "roberta"])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    from torchbridge.bench import machine
    print(machine())
    print("| run | model | variant | report | loop | report / loop |")
    print("| --- | --- | --- | --- | --- | --- |")
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for run in range(1, args.runs + 1):
        for name in args.models:
            # Alternating which variant goes first: the machine drifts.
            for variant in VARIANTS if run % 2 else VARIANTS[::-1]:
                out = subprocess.run([sys.executable, __file__, "--child", name, variant],
                                     capture_output=True, text=True, check=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                ratio = row["report"] / row["loop"]
                ratios[variant].append(ratio)
                print(f"| {run} | {name} | {variant} | {row['report']:.2f}x | "
                      f"{row['loop']:.2f}x | {ratio:.3f} |", flush=True)
    print()
    print("| variant | report / loop, mean | lowest | highest |")
    print("| --- | --- | --- | --- |")
    for variant, each in ratios.items():
        print(f"| {variant} | {statistics.mean(each):.3f} | {min(each):.3f} | "
              f"{max(each):.3f} |")


if __name__ == "__main__":
    main()
