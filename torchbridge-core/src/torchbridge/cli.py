"""`torchbridge` command line. The only module that prints."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _doctor(args: argparse.Namespace) -> int:
    from torchbridge import doctor

    report = doctor.collect()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(doctor.render(report))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from torchbridge import bench

    def progress(done: int, total: int, what: str) -> None:
        filled = int(30 * done / total)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {what:<32}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    report = bench.run(models=args.models, progress=progress)
    if args.plot:
        bench.plot(report, args.plot)
    print(json.dumps(report, indent=2) if args.json else bench.render(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchbridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="versions, plugins, backends, config: for bug reports")
    doc.add_argument("--json", action="store_true", help="machine-readable output")
    doc.set_defaults(func=_doctor)
    bench = sub.add_parser("bench", help="prepare_model benchmark on the reference models")
    bench.add_argument("--models", nargs="+", choices=["mlp", "convnet", "encoder",
                                                      "decoder_lm"])
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG chart (needs matplotlib)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
