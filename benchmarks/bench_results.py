"""Run `torchbridge bench` and keep what it measured in benchmarks/results/: the report as
JSON and the rendered tables as Markdown, named after the suite, the machine and the date
(bench-hf-amd-epyc-family-25-model-17-2t-2026-11-23-23-50.json); the machine is in the content
too (report["machine"], and the first line of every table).

    python benchmarks/bench_results.py --suite hf [--models llama bert] [--batch 4] \\
        [--level O3 --level O2] [--no-second-process]
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path

from torchbridge import bench

RESULTS = Path(__file__).resolve().parent / "results"


def result_name(report: dict[str, object]) -> str:
    machine = report["machine"]
    assert isinstance(machine, dict)
    cpu = re.sub(r"[^a-z0-9]+", "-", str(machine["cpu"]).lower()).strip("-")
    when = re.sub(r"[^0-9]+", "-", str(machine["date"])[:16]).strip("-")  # to the minute
    return f"bench-{report['suite']}-{cpu}-{machine['threads']}t-{when}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=["reference", "hf"], default="hf")
    parser.add_argument("--models", nargs="+")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--level", action="append", help="a level or variant ('O3 int8'); "
                        "repeat for several (default O1 O2 O3)")
    parser.add_argument("--no-second-process", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("torchbridge.optimize").setLevel(logging.WARNING)
    started = time.perf_counter()
    report = bench.run(models=args.models, suite=args.suite, batch=args.batch,
                       levels=args.level, second_process=not args.no_second_process)
    report["wall_s"] = time.perf_counter() - started
    command = "python benchmarks/bench_results.py " + " ".join(sys.argv[1:])
    report["command"] = command.strip()
    RESULTS.mkdir(exist_ok=True)
    name = result_name(report)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    text = bench.render(report)
    (RESULTS / f"{name}.md").write_text(
        f"`{report['command']}` ({report['wall_s'] / 60:.0f} min)\n\n{text}\n")
    print(text)
    print(f"\nwritten: {RESULTS / name}.json and .md ({report['wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
