"""Where a first call's time goes outside compiling, on the Hugging Face suite's models at
a larger shape: prepare_model at O3 with a sample input, then the first forward, against
plain torch.compile's first call in the same process (inductor's one-time setup paid
before both by a warm-up compile that builds a kernel; compile first, so that O3 finds
no C++ kernel of its own graph in inductor's cache). Prints the machine line, then a row
per model: plain compile's first call, O3's, and O3's stages and passes (from its report).

    python benchmarks/first_call_stages.py [--models llama bert] [--scale 2] [--batch 4]

Compare rows of one run, or runs at two commits on one machine (`git checkout`); a fresh
process for each run: inductor's in-memory caches would serve a second.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any

import torch
import torchbridge
from torchbridge.bench import machine
from torchbridge.hf_models import hf_reference_models


def _call(model: Any, sample: Any) -> Any:
    with torch.inference_mode():
        return model(**sample) if isinstance(sample, dict) else model(sample)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama", "bert"])
    parser.add_argument("--scale", type=float, default=2.0)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    # Empty caches: neither plain compile nor O3 finds its kernels from an earlier run.
    cache = tempfile.mkdtemp(prefix="tb-first-call-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        _run(args)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _run(args: argparse.Namespace) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    print(machine())
    # The warm-up builds a C++ kernel (a pointwise op inside the compiled function):
    # inductor's one-time checks of the vector ISAs the C++ compiler builds (4.7 s on a
    # 2-core EPYC) fall in it, not in the first variant's first call.
    torch.compile(lambda x: (x * 2).relu().sum())(torch.randn(3, 8))
    backend = torchbridge.get_backend("cpu")
    specs = {spec.name: spec for spec in hf_reference_models(args.scale)}
    print("| model | eager call s | compile first call s | O3 first call s | vs compile "
          "| O3 compile pass s | O3 outside the compile pass s | where (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        spec = specs[name]
        sample = spec.make_input(args.batch)
        model = spec.build().eval()
        started = time.perf_counter()
        _call(model, sample)
        eager = time.perf_counter() - started
        started = time.perf_counter()
        _call(torch.compile(spec.build().eval()), sample)
        plain = time.perf_counter() - started
        started = time.perf_counter()
        result = backend.optimize(spec.build().eval(), "O3", sample_input=sample)
        _call(result.model, sample)
        o3 = time.perf_counter() - started
        compile_pass = sum(p.seconds or 0.0 for p in result.passes if p.name == "compile")
        parts = {p.name: p.seconds or 0.0 for p in result.passes
                 if p.name != "compile" and (p.seconds or 0.0) >= 0.05}
        parts.update({f"({k})": v for k, v in result.stage_seconds.items() if v >= 0.05})
        where = ", ".join(f"{k} {v:.2f}" for k, v in sorted(parts.items(),
                                                             key=lambda kv: -kv[1]))
        print(f"| {name} | {eager:.3f} | {plain:.1f} | {o3:.1f} | {o3 / plain:.2f}x | "
              f"{compile_pass:.1f} | {o3 - compile_pass:.1f} | {where} |")


if __name__ == "__main__":
    main()
