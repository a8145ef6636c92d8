#!/usr/bin/env bash
# One session on a lent NVIDIA GPU machine that has torch, triton and transformers but no
# package index: TorchBridge's wheels and what it needs beyond them travel in .whl/ (built
# and downloaded on a machine with one, see docs/benchmarks.md "On an NVIDIA H100").
# Each step has its own time limit, so that one slow step leaves the others their time;
# logs go to $OUT (at most 8 files). About 7.5 minutes: with a machine's start (1.5 to 6.5
# minutes on 2026-11-27) it fits a 15-minute device budget once.
#
#     OUT=/tmp/gpu-out bash benchmarks/gpu_session.sh
set -u
export OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
START=$(date +%s)
step() { echo "== $(( $(date +%s) - START )) s: $*" | tee -a "$OUT/device.txt"; }

step "versions and the GPU"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap,clocks.max.sm,clocks.max.mem --format=csv
    python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
    lscpu | grep -E "Model name|^CPU\(s\)"
    timeout 60 python3 -m torchbridge doctor
    timeout 60 python3 -m torchbridge doctor --record "$OUT/h100-recording.json"
} >> "$OUT/device.txt" 2>&1

# -v: each result is printed with its test's name as it comes, so a step cut off at its
# time limit still names what failed (the 2026-11-27 run, with -q, named none of its 65).
step "tests: tests/kernels (compiled for the GPU) beside the default suite (12 workers)"
( timeout 170 python3 -m pytest -v -rfE -p no:cacheprovider tests/kernels -m cuda \
    > "$OUT/tests_kernels.log" 2>&1; echo "exit $?" >> "$OUT/tests_kernels.log" ) &
( timeout 200 python3 -m pytest -v -rfE -p no:cacheprovider -n 12 --dist loadfile tests \
    --ignore=tests/kernels --ignore=tests/xla > "$OUT/tests_default.log" 2>&1
  echo "exit $?" >> "$OUT/tests_default.log" ) &
wait
for log in "$OUT/tests_kernels.log" "$OUT/tests_default.log"; do
    echo "$log: $(grep -c " PASSED" "$log") passed, $(grep -c " SKIPPED" "$log") skipped"
    grep -E " (FAILED|ERROR) " "$log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u
    tail -1 "$log"
done | tee -a "$OUT/device.txt"

step "benchmarks/kernels.py, bfloat16"
timeout 50 python3 benchmarks/kernels.py --backend cuda --dtype bfloat16 > "$OUT/kernels.md" 2>&1
echo "exit $?" >> "$OUT/kernels.md"
tail -25 "$OUT/kernels.md"

step "bench --suite hf at O3, one model at a time (each written when done)"
timeout 150 python3 - >> "$OUT/bench.log" 2>&1 <<'PY'
import json, logging, os
from torchbridge import bench
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
logging.getLogger("torchbridge.optimize").setLevel(logging.WARNING)
out = os.environ["OUT"]
for model in ["llama", "bert", "resnet", "gpt2", "vit"]:
    report = bench.run(models=[model], suite="hf", levels=["O3"], second_process=False)
    with open(f"{out}/bench-hf.jsonl", "a") as f:
        f.write(json.dumps(report) + "\n")
    print(bench.render(report), flush=True)
PY
echo "bench exit $?" >> "$OUT/bench.log"
grep -E "^\| (llama|gpt2|bert|vit|resnet) |exit" "$OUT/bench.log"
step "done"
