"""Startup cost: what `import torchbridge` adds to `import torch`, discovery + selection, and
what checking the plugins' Detections costs.

    python benchmarks/startup.py [--runs 15] [--json]

Each figure is the median over fresh interpreter processes (imports are per process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

# pydantic's own import cost after torch (the names torchbridge.config imports), in a process
# that never imports torchbridge: the floor under get_backend(), whose config is pydantic.
PYDANTIC = r"""
import json, time
import torch; t0 = time.perf_counter()
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, SerializeAsAny,
                      ValidationError, create_model, field_validator)
t1 = time.perf_counter()
print(json.dumps({"pydantic": t1 - t0}))
"""

# What discovery spends checking Detections: every check run on every Detection of this
# machine's plugins, repeated, per Detection.
CHECKS = r"""
import json, time, torchbridge
from torchbridge import selection
from torchbridge.plugins import get_plugin_host
host = get_plugin_host()
found = []
for impl in host.implementations("torchbridge_detect"):
    ok, result = host.call_one(impl, "torchbridge_detect", {})
    if ok and result is not None:
        for det in (result if isinstance(result, (list, tuple)) else [result]):
            found.append((det, impl.plugin_name, host.records[impl.plugin_name].group == "builtin"))
repeats = 2000
t0 = time.perf_counter()
for _ in range(repeats):
    for det, plugin, builtin in found:
        selection.detection_problem(det, plugin, builtin)
per = (time.perf_counter() - t0) / (repeats * len(found))
print(json.dumps({"check_us": per * 1e6, "detections": len(found)}))
"""

PROBE = r"""
import json, sys, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
import torchbridge; t2 = time.perf_counter()
best = torchbridge.detect_best_backend(); t3 = time.perf_counter()
backend = torchbridge.get_backend(); t4 = time.perf_counter()
sdks = [m for m in ("torch_xla", "amdsmi", "pynvml", "intel_extension_for_pytorch",
                  "torch._dynamo", "torch._inductor") if m in sys.modules]
from torchbridge.plugins import plugin_records
print(json.dumps({"torch": t1 - t0, "torchbridge": t2 - t1, "detect": t3 - t2,
                  "get_backend": t4 - t3, "best": best, "sdks": sdks,
                  "plugins": sorted(r.name for r in plugin_records() if r.status == "loaded")}))
"""


BOUND_BEYOND_PYDANTIC_MS = 30


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
    for run in runs:
        out = subprocess.run([sys.executable, "-c", PYDANTIC], capture_output=True,
                             text=True, check=True).stdout
        run.update(json.loads(out.strip().splitlines()[-1]))
    med = {k: statistics.median(r[k] for r in runs) * 1e3
           for k in ("torch", "torchbridge", "detect", "get_backend", "pydantic")}
    checks = json.loads(subprocess.run([sys.executable, "-c", CHECKS], capture_output=True,
                                       text=True, check=True).stdout.strip().splitlines()[-1])
    summary = {"runs": args.runs, "median_ms": med, "selected": runs[0]["best"],
               "detection_check_us": checks["check_us"],
               "detections_per_discovery": checks["detections"],
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
    print(f"  import pydantic (after torch, alone)  {med['pydantic']:8.1f} ms")
    beyond, discovery = med["get_backend"] - med["pydantic"], med["torchbridge"] + med["detect"]
    print(f"  get_backend() beyond pydantic         {beyond:8.1f} ms")
    print(f"  import + discovery                    {discovery:8.1f} ms")
    print(f"  checking one Detection                {checks['check_us']:8.1f} us "
          f"({checks['detections']} per discovery)")
    print(f"  selected: {summary['selected']}; plugins: {', '.join(summary['plugins_loaded'])}")
    print(f"  vendor SDKs and compiler modules imported: "
          f"{summary['vendor_sdks_imported'] or 'none'}")
    # The bound get_backend() is held to: pydantic's import (its config is pydantic models)
    # plus 30 ms of our own, without torch._dynamo or inductor (about 1.5 s here).
    met = beyond <= BOUND_BEYOND_PYDANTIC_MS and not any(
        m.startswith("torch._") for m in summary["vendor_sdks_imported"])
    print(f"  bound: get_backend() <= import pydantic + {BOUND_BEYOND_PYDANTIC_MS} ms, "
          f"no torch._dynamo/_inductor: {'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
