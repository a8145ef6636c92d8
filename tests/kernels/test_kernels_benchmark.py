"""benchmarks/kernels.py runs here and finds every eligible implementation within its
dtype's tolerance of the reference (on CPU it checks correctness only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hang_bounds import HANG_S

ROOT = Path(__file__).resolve().parents[2]


def test_the_kernel_benchmark_checks_every_implementation(tmp_path: Path, device: str) -> None:
    out = tmp_path / "kernels.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels.py"),
                           "--backend", device, "--json", str(out)],
                          env=dict(os.environ), capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    checked = [r for entry in report["ops"].values()
               for r in entry["implementations"].values() if "rel_error" in r]
    assert len(checked) >= 4  # the Triton kernels at least
    assert all(r["rel_error"] <= r["tolerance"] for r in checked)
