"""`torchbridge` command line. The only module that prints."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _doctor(args: argparse.Namespace) -> int:
    import logging

    from torchbridge import doctor

    # The report lists every plugin error and warning itself; logging them too would print
    # each twice.
    logging.getLogger("torchbridge").setLevel(logging.ERROR)
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

    report = bench.run(models=args.models, progress=progress, suite=args.suite)
    if args.plot:
        bench.plot(report, args.plot)
    print(json.dumps(report, indent=2) if args.json else bench.render(report))
    return 0


def _load_model(spec: str, batch: int) -> tuple[object, object]:
    """A reference model name (mlp, convnet, encoder, decoder_lm; small size), or
    "package.module:function" returning (model, sample_input)."""
    import importlib

    from torchbridge.models import reference_models

    if ":" in spec:
        module_name, _, func = spec.partition(":")
        built = getattr(importlib.import_module(module_name), func)()
        if not (isinstance(built, tuple) and len(built) == 2):
            raise SystemExit(f"torchbridge validate: {spec} must return (model, sample_input)")
        return built[0], built[1]
    for ref in reference_models(scale=0.25):
        if ref.name == spec:
            import torch

            torch.manual_seed(0)
            return ref.build(), ref.make_input(batch)
    raise SystemExit(f"torchbridge validate: unknown model {spec!r}; use mlp, convnet, "
                     "encoder, decoder_lm or package.module:function")


def _validate(args: argparse.Namespace) -> int:
    from torchbridge.validation import validate

    model, sample = _load_model(args.model, args.batch)
    backends = args.backends.split(",") if args.backends else None
    report = validate(model, sample, backends, level=args.level,  # type: ignore[arg-type]
                      tolerance=args.tolerance)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.summary())
    return 0 if report.passed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchbridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="versions, plugins, backends, config: for bug reports")
    doc.add_argument("--json", action="store_true", help="machine-readable output")
    doc.set_defaults(func=_doctor)
    bench = sub.add_parser("bench", help="prepare_model benchmark on the reference models")
    bench.add_argument("--models", nargs="+", choices=["mlp", "convnet", "encoder",
                                                      "decoder_lm", "llama", "gpt2", "bert",
                                                      "vit", "resnet"])
    bench.add_argument("--suite", choices=["reference", "hf"], default="reference",
                       help="hf: Hugging Face architectures from their configs (needs "
                       "transformers)")
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG chart (needs matplotlib)")
    bench.set_defaults(func=_bench)
    val = sub.add_parser("validate", help="run a model on several backends and compare "
                         "outputs with the first; exit status 1 on a mismatch")
    val.add_argument("--model", default="mlp", help="mlp, convnet, encoder, decoder_lm, or "
                     "package.module:function returning (model, sample_input)")
    val.add_argument("--backends", help="comma-separated, first is the reference "
                     "(default: every available backend)")
    val.add_argument("--level", default="O0", help="prepare_model level on each backend")
    val.add_argument("--tolerance", type=float, help="max |diff| / max |reference| "
                     "(default: the level's)")
    val.add_argument("--batch", type=int, default=4)
    val.add_argument("--json", action="store_true")
    val.set_defaults(func=_validate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
