"""The first call in a second process: what a user waits for when a process prepares a model
that an earlier process prepared already, reusing the compiled artifacts it left.

`measure()` runs this module twice in fresh Python processes sharing one cache folder:

    python -m torchbridge.bench_firstcall --suite hf --model llama --batch 4 --variant O3 \\
        --cache-dir DIR

Each builds the same model and input (torchbridge.bench_variants.build: seeded), then times
prepare_model (or torch.compile) plus the first forward and prints one JSON line: the
seconds, and inductor's cache hits and misses. The first process fills the folder, the
second reuses it. TorchBridge variants find the folder through config
`optimization.compile_cache_dir`; inductor's own default folder (TORCHINDUCTOR_CACHE_DIR)
is set to an empty one per process, so that nothing else is reused behind the config's
back. Plain torch.compile finds it through TORCHINDUCTOR_CACHE_DIR, inductor's caches on
(their default). Importing torch, transformers and inductor is not timed, as in the
benchmark's own first-call column.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

MARK = "torchbridge-bench-firstcall: "
# Enough for a cold prepare of the largest benchmark model on a loaded 2-core machine;
# a hang rather than a figure beyond it.
TIMEOUT_S = 900


class FirstCallError(RuntimeError):
    """A first-call process failed or printed no result."""


def reused(variant: str) -> bool:
    """Whether the benchmark measures `variant`'s second process: plain torch.compile and
    each TorchBridge variant prepared with a sample input (eager compiles nothing; "O3 no
    sample" compiles what O3 does, so it would cost two more processes to say the same)."""
    return variant != "eager" and not variant.endswith("no sample")


def run_child(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """One process of this module: its JSON result. Tests replace it to check the plumbing
    without starting Python."""
    try:
        done = subprocess.run([sys.executable, "-m", "torchbridge.bench_firstcall", *argv],
                              env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        raise FirstCallError(f"no result after {TIMEOUT_S} s: {' '.join(argv)}") from exc
    found = [line[len(MARK):] for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not found:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise FirstCallError(f"exit status {done.returncode}: {tail}")
    result: dict[str, Any] = json.loads(found[-1])
    return result


def measure(suite: str, model: str, batch: int, variant: str, *, scale: float = 1.0,
            backend: str | None = None, threads: int | None = None
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(first process, second process) results for one variant: each {"first_call_s",
    "prepare_s", "first_forward_s", "cache": {counter: count}}. The folders are removed
    afterwards."""
    import torch

    argv = ["--suite", suite, "--model", model, "--batch", str(batch), "--variant", variant,
            "--scale", repr(scale), "--threads", str(threads or torch.get_num_threads())]
    if backend is not None:
        argv += ["--backend", backend]
    results = []
    with tempfile.TemporaryDirectory(prefix="torchbridge-bench-cache-") as cache:
        for _ in range(2):
            with tempfile.TemporaryDirectory(prefix="torchbridge-bench-inductor-") as own:
                env = dict(os.environ, TORCHBRIDGE_PROGRESS="0")
                env["TORCHINDUCTOR_CACHE_DIR"] = cache if variant == "compile" else own
                results.append(run_child([*argv, "--cache-dir", cache], env))
    return results[0], results[1]


def _cache_counters() -> dict[str, int]:
    """Inductor's FX graph cache and AOTAutograd's cache: hits, misses, bypasses."""
    if "torch._dynamo" not in sys.modules:  # nothing was compiled: nothing to count
        return {}
    from torch._dynamo.utils import counters

    out = {k: int(v) for k, v in counters["inductor"].items()
           if k.startswith("fxgraph_cache_")}
    out.update({f"aot_{k}": int(v) for k, v in counters["aot_autograd"].items()
                if k.startswith("autograd_cache_")})
    return out


def first_call(suite: str, model_name: str, batch: int, variant: str, scale: float,
               backend_name: str | None, cache_dir: str) -> dict[str, Any]:
    """Prepare plus first forward of one variant in this process, as a user's would be."""
    import torch

    import torchbridge
    from torchbridge.bench_variants import build, parse_variant, placed, quantize_argument

    if variant == "compile" or parse_variant(variant)[0] not in ("O0", "O1"):
        # Imported before the clock starts, as in the benchmark's process: O0 and O1
        # compile nothing and leave it out (seconds on a loaded machine).
        import torch._dynamo
        import torch._inductor.compile_fx
    from torchbridge.config import TorchBridgeConfig
    from torchbridge.optimize.measure import sample_call

    model, x = build(suite, model_name, batch, scale)
    config = TorchBridgeConfig.load()
    config = config.model_copy(update={"optimization": config.optimization.model_copy(
        update={"compile_cache_dir": cache_dir})})
    backend = torchbridge.get_backend(backend_name, config=config)
    call = sample_call(backend, x)
    started = time.perf_counter()
    prepared: Any
    if variant == "compile":
        prepared = torch.compile(placed(backend, model))
    else:
        level, with_sample, mode = parse_variant(variant)
        prepared = backend.prepare_model(model, level, sample_input=x if with_sample else None,
                                         quantize=quantize_argument(mode))
    prepare_s = time.perf_counter() - started
    with torch.inference_mode():
        out = call(prepared)
    backend.synchronize()  # with the output alive: a lazy device (XLA) runs it only then
    total = time.perf_counter() - started
    del out
    return {"first_call_s": total, "prepare_s": prepare_s,
            "first_forward_s": total - prepare_s, "cache": _cache_counters()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchbridge.bench_firstcall",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=["reference", "hf"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--variant", required=True, help="compile, O1-O3, 'O3 int8' ...")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--backend")
    parser.add_argument("--cache-dir", required=True)
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = first_call(args.suite, args.model, args.batch, args.variant, args.scale,
                        args.backend, args.cache_dir)
    print(MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
