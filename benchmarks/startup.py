"""Startup cost: what `import torchbridge` adds to `import torch`, and discovery + selection.

    python benchmarks/startup.py [--runs 15] [--json]

Each figure is the median over fresh interpreter processes (imports are per process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROBE = r"""
import json, sys, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
import torchbridge; t2 = time.perf_counter()
best = torchbridge.detect_best_backend(); t3 = time.perf_counter()
backend = torchbridge.get_backend(); t4 = time.perf_counter()
sdks = [m for m in ("torch_xla", "amdsmi", "pynvml", "intel_extension_for_pytorch")
        if m in sys.modules]
from torchbridge.plugins import plugin_records
print(json.dumps({"torch": t1 - t0, "torchbridge": t2 - t1, "detect": t3 - t2,
                  "get_backend": t4 - t3, "best": best, "sdks": sdks,
                  "plugins": sorted(r.name for r in plugin_records() if r.status == "loaded")}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                             check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    med = {k: statistics.median(r[k] for r in runs) * 1e3
           for k in ("torch", "torchbridge", "detect", "get_backend")}
    summary = {"runs": args.runs, "median_ms": med, "selected": runs[0]["best"],
               "vendor_sdks_imported": sorted({m for r in runs for m in r["sdks"]}),
               "plugins_loaded": runs[0]["plugins"]}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"median over {args.runs} fresh processes:")
    print(f"  import torch                          {med['torch']:8.1f} ms")
    print(f"  import torchbridge (after torch)      {med['torchbridge']:8.1f} ms")
    print(f"  detect_best_backend() (first call)    {med['detect']:8.1f} ms")
    print(f"  get_backend() (config load, facade)   {med['get_backend']:8.1f} ms")
    print(f"  selected: {summary['selected']}; plugins: {', '.join(summary['plugins_loaded'])}")
    print(f"  vendor SDKs imported: {summary['vendor_sdks_imported'] or 'none'}")


if __name__ == "__main__":
    main()
