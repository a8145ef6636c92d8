"""`backend.enable_caching()`: a kernel compiled ahead of time in one process is found in
the TorchBridge cache by the next, which compiles nothing. Runs without the interpreter,
in subprocesses (Triton compiles for sm_90 here without a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from hang_bounds import HANG_S

SCRIPT = textwrap.dedent('''
    import sys
    import torchbridge, triton, triton.language as tl
    from triton import knobs

    @triton.jit
    def scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2.0, mask=mask)

    hits = []
    knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    config = torchbridge.TorchBridgeConfig(kernel={"cache_dir": sys.argv[1]})
    backend = torchbridge.get_backend("cpu", config=config)
    print("cache", backend.enable_caching())
    kernel = backend.compile_kernel(scale_kernel, {"x_ptr": "*fp32", "n": "i32"},
                                    constexprs={"BLOCK": 128}, target="cuda:90")
    assert ".target sm_90" in kernel.compiled.asm["ptx"]
    print("hit", hits[-1])
''')


def _run(script: Path, cache: Path) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    done = subprocess.run([sys.executable, str(script), str(cache)], env=env,
                          capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_second_process_compiles_nothing(tmp_path: Path) -> None:
    script = tmp_path / "compile_once.py"
    script.write_text(SCRIPT)
    cache = tmp_path / "cache"
    first, second = _run(script, cache), _run(script, cache)
    assert f"cache {cache / 'triton'}" in first
    assert "hit False" in first and "hit True" in second
    assert any((cache / "triton").rglob("scale_kernel.json"))
