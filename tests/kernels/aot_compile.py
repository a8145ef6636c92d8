"""Compile every Triton kernel in torchbridge.kernels.triton ahead of time, without a GPU:
for NVIDIA sm_80 and sm_90 and, where the installed Triton has its AMD backend (PyPI's wheels
do), for gfx942 (MI300). Catches what Triton's interpreter lets through (a tl.dot tile
under 16, libdevice calls, type errors the compiler rejects) in CI on a CPU machine.

    python tests/kernels/aot_compile.py

Prints one line per kernel and target and exits 1 if any compile failed. Must run without
TRITON_INTERPRET=1 (the interpreter replaces the jit kernels). Compiles into a fresh cache
directory, so every run compiles for real, and removes it afterwards.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import traceback


def targets() -> list[object]:
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget

    found = [GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32)]
    if "amd" in backends:
        found.append(GPUTarget("hip", "gfx942", 64))
    return found


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter replaces the kernels to compile")
        return 2
    import triton
    from torchbridge.kernels.triton import TRITON_KERNELS
    from triton.backends import backends

    if "amd" not in backends:
        print(f"triton {triton.__version__} has no AMD backend here: NVIDIA targets only")
    failures = 0
    started = time.perf_counter()
    compiled = 0
    for op_name, op in TRITON_KERNELS.items():
        for spec in op.aot_specs():
            for target in targets():
                name = f"{target.backend}:{target.arch}"  # type: ignore[attr-defined]
                t0 = time.perf_counter()
                try:
                    source = triton.compiler.ASTSource(
                        fn=spec.kernel, signature=dict(spec.signature),
                        constexprs=dict(spec.constexprs))
                    kernel = triton.compile(source, target=target)
                    binary = "cubin" if "cubin" in kernel.asm else "hsaco"
                    size = len(kernel.asm[binary])
                    print(f"ok    {op_name:17} {spec.label:60} {name:11} "
                          f"{binary} {size} B in {time.perf_counter() - t0:.2f}s")
                    compiled += 1
                except Exception:
                    failures += 1
                    print(f"FAIL  {op_name:17} {spec.label:60} {name:11}")
                    traceback.print_exc(file=sys.stdout)
    print(f"{compiled} compiled, {failures} failed, "
          f"in {time.perf_counter() - started:.1f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit(main())  # refuses to run: no cache folder to make
    cache = tempfile.mkdtemp(prefix="torchbridge-aot-")
    os.environ["TRITON_CACHE_DIR"] = cache
    try:
        sys.exit(main())
    finally:
        shutil.rmtree(cache, ignore_errors=True)
