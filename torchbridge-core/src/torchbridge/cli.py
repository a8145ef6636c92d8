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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchbridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="versions, plugins, backends, config: for bug reports")
    doc.add_argument("--json", action="store_true", help="machine-readable output")
    doc.set_defaults(func=_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
