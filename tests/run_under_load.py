"""Run pytest while other processes keep every CPU busy: the check that the tests do not
depend on the machine's speed (a loaded 2-core machine must pass the suite).

    python tests/run_under_load.py [--load N] [--max-seconds S] [pytest arguments...]

starts N busy-looping processes (default: one per CPU), runs `python -m pytest` with the
given arguments, and stops the load however pytest ends. Each busy loop also stops by
itself after S seconds (default 3600) or when this script is gone, so no load outlives it,
even when this script is killed. The exit status is pytest's.

Examples: `python tests/run_under_load.py tests/test_misbehaving_plugins.py` (one file,
about a minute on 2 cores), `python tests/run_under_load.py --load 2` (the whole suite)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# Burns one CPU until the deadline or until its parent (this script) is gone.
BUSY_LOOP = """
import os, sys, time
end = time.monotonic() + float(sys.argv[1])
parent = os.getppid()
while time.monotonic() < end and os.getppid() == parent:
    for _ in range(100_000):
        pass
"""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", type=int, default=os.cpu_count() or 2,
                        help="busy-looping processes (default: one per CPU)")
    parser.add_argument("--max-seconds", type=float, default=3600.0,
                        help="each busy loop stops by itself after this long")
    args, pytest_args = parser.parse_known_args(argv)
    load = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(args.max_seconds)])
            for _ in range(args.load)]
    try:
        print(f"run_under_load: {args.load} busy process(es) "
              f"({', '.join(str(p.pid) for p in load)}) on {os.cpu_count()} CPU(s)",
              flush=True)
        return subprocess.call([sys.executable, "-m", "pytest", *pytest_args])
    finally:
        for process in load:
            process.kill()
        for process in load:
            process.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
