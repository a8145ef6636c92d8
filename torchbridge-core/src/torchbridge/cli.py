"""`torchbridge` command line. The only module that prints.

Every argument is checked before any work starts. An ordinary mistake (a bad argument, an
unknown backend, a bad TORCHBRIDGE_* variable or config file, a model that cannot be
imported) is one line on stderr naming the problem and exit status 2; `--debug` adds the
traceback. A validation mismatch is exit status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn


class UsageError(Exception):
    """An ordinary mistake on the command line: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the usage block and exits; one line naming the problem is
        # easier to read, and `--help` is there for the rest.
        raise UsageError(f"{message} (see {self.prog} --help)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be finite and positive, got {text!r}")
    return value


def _level(text: str) -> str:
    from torchbridge.errors import ConfigurationError
    from torchbridge.levels import OptimizationLevel

    try:
        return OptimizationLevel.parse(text).value
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _backend_list(text: str) -> list[str]:
    from torchbridge.errors import DeviceError
    from torchbridge.selection import parse_backend_spec

    names = [part.strip() for part in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated backend names such as "
                                         f"cpu,tpu, got {text!r}")
    for name in names:
        try:
            parse_backend_spec(name)
        except DeviceError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def _load_config() -> Any:
    """Every config source, read before any work: a bad file or variable stops us here."""
    from torchbridge.config import TorchBridgeConfig

    return TorchBridgeConfig.load()


def _doctor(args: argparse.Namespace) -> int:
    import logging

    from torchbridge import doctor

    # The report lists every plugin error and warning itself; logging them too would print
    # each twice.
    logging.getLogger("torchbridge").setLevel(logging.ERROR)
    if args.record is not None:
        return _record(args.record)
    report = doctor.collect()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(doctor.render(report))
    return 0


def _record(path: str) -> int:
    """doctor --record FILE: what each plugin's probe sees here, as a recording."""
    from torchbridge import recording

    data = recording.capture()
    recording.write(path, data)
    found = recording.vendor_devices(data)
    for entry in data["plugins"]:
        answer = entry["probe"]
        state = (f"{answer['device_count']} device(s)" if answer["available"]
                 else f"none ({answer['reason']})")
        print(f"{entry['plugin']:>8} ({entry['backend']}): {state}")
    if not found:
        print("no vendor device was found: the recording holds the cpu backend and each "
              "plugin's reason")
    print(f"recording written to {path}; check it, then see the README (Recordings) to "
          "contribute it")
    return 0


def _version_line() -> str:
    import torchbridge

    line = f"torchbridge {torchbridge.__version__}"
    contract = getattr(torchbridge, "CONTRACT_VERSION", None)
    return f"{line} (plugin contract {contract})" if contract is not None else line


def _check_plot_path(path: str) -> None:
    """--plot needs matplotlib, a folder that exists and a format matplotlib writes:
    checked before a benchmark that takes minutes, not after it."""
    from pathlib import Path

    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    target = Path(path)
    if not target.parent.is_dir():
        raise UsageError(f"--plot {path}: folder {target.parent} does not exist")
    if target.is_dir():
        raise UsageError(f"--plot {path}: is a directory")
    formats = Figure().canvas.get_supported_filetypes()
    suffix = target.suffix.lstrip(".").lower()
    if suffix and suffix not in formats:
        raise UsageError(f"--plot {path}: matplotlib cannot write .{suffix} files; use one "
                         f"of {', '.join(sorted(formats))}")


SUITES = {"reference": ("mlp", "convnet", "encoder", "decoder_lm"),
          "hf": ("llama", "gpt2", "bert", "vit", "resnet")}


def _bench(args: argparse.Namespace) -> int:
    foreign = [m for m in args.models or () if m not in SUITES[args.suite]]
    if foreign:
        other = next(s for s, names in SUITES.items() if foreign[0] in names)
        raise UsageError(f"--models {' '.join(foreign)}: not in the {args.suite} suite "
                         f"({', '.join(SUITES[args.suite])}); add --suite {other}")
    if args.plot:
        _check_plot_path(args.plot)
    _load_config()
    from torchbridge import bench

    def progress(done: int, total: int, what: str) -> None:
        filled = int(30 * done / total)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {what:<32}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    report = bench.run(models=args.models, progress=progress, suite=args.suite)
    # The results first: a plot that fails must not cost the run.
    print(json.dumps(report, indent=2) if args.json else bench.render(report))
    if args.plot:
        try:
            bench.plot(report, args.plot)
        except OSError as exc:
            raise UsageError(f"--plot {args.plot}: {exc.strerror or exc}") from exc
    return 0


def _kernels(args: argparse.Namespace) -> int:
    import logging

    from torchbridge import doctor, get_backend
    from torchbridge.kernels.choice import kernel_table

    logging.getLogger("torchbridge").setLevel(logging.ERROR)
    backend = get_backend(args.backend)
    table = kernel_table(backend, training=args.training)
    if args.json:
        print(json.dumps(table, indent=2, default=str))
    else:
        mode = "training" if args.training else "inference"
        print(f"kernels on {backend.name} ({mode}):")
        print("\n".join(doctor.render_kernels(table)))
    return 0
def _import_factory(spec: str) -> Any:
    """The function named by "package.module:function"."""
    import importlib
    import os

    module_name, _, func = spec.partition(":")
    if not module_name or not func:
        raise UsageError(f"--model {spec!r}: expected package.module:function")
    # `python -m torchbridge` can import from the working directory; the console script
    # should find the same modules.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise UsageError(f"--model {spec}: cannot import {module_name}: "
                         f"{type(exc).__name__}: {exc}") from exc
    factory = getattr(module, func, None)
    if not callable(factory):
        raise UsageError(f"--model {spec}: module {module_name} has no function {func!r}")
    return factory


def _load_model(spec: str, batch: int) -> tuple[object, object]:
    """A reference model name (mlp, convnet, encoder, decoder_lm; small size), or
    "package.module:function" returning (model, sample_input)."""
    from torch import nn

    from torchbridge.models import reference_models

    if ":" in spec:
        factory = _import_factory(spec)
        try:
            built = factory()
        except Exception as exc:
            raise UsageError(f"--model {spec}: the function raised {type(exc).__name__}: "
                             f"{exc}") from exc
        if not (isinstance(built, tuple) and len(built) == 2
                and isinstance(built[0], nn.Module)):
            raise UsageError(f"--model {spec} must return (model, sample_input) with an "
                             f"nn.Module, got {type(built).__name__}")
        return built[0], built[1]
    for ref in reference_models(scale=0.25):
        if ref.name == spec:
            import torch

            torch.manual_seed(0)
            return ref.build(), ref.make_input(batch)
    raise UsageError(f"unknown model {spec!r}; use mlp, convnet, encoder, decoder_lm or "
                     "package.module:function")


def _usable_backends(requested: list[str] | None, config: Any) -> list[Any]:
    """The backends to compare, created before the model is built. A named backend that
    is unavailable stays a name, so that the report shows why it failed; fewer than two
    usable ones, an unknown name or an unusable reference is a UsageError saying what
    validate needs."""
    from torchbridge.backend import get_backend
    from torchbridge.errors import BackendUnavailableError, DeviceError
    from torchbridge.selection import list_backends, normalize_name, parse_backend_spec

    statuses = {s.name: s for s in list_backends()}
    if requested is None:
        requested = [name for name, s in statuses.items() if s.available]
    chosen: list[Any] = []
    unusable: list[str] = []
    for spec in requested:
        name = normalize_name(parse_backend_spec(spec)[0])
        if name not in statuses:
            raise UsageError(f"unknown backend {spec!r}; known backends: "
                             f"{', '.join(statuses)}")
        try:
            chosen.append(get_backend(spec, config))
        except (BackendUnavailableError, DeviceError) as exc:
            if not chosen:
                raise UsageError(f"the reference backend (the first) cannot run: {exc}"
                                 ) from exc
            unusable.append(f"{spec}: {exc}")
            chosen.append(spec)
    usable = [b for b in chosen if not isinstance(b, str)]
    if len(usable) < 2:
        others = [f"{name} ({s.reason or 'unavailable'})" for name, s in statuses.items()
                  if not s.available]
        why = "; ".join(unusable) or ("unavailable here: " + ", ".join(others)
                                      if others else "no other backend is installed")
        names = ", ".join(b.name for b in usable) or "none"
        raise UsageError(f"validate compares outputs across at least two usable backends, "
                         f"but has only {len(usable)} ({names}); {why}. Install the plugin "
                         "and runtime of another backend, or name two that run here with "
                         "--backends")
    return chosen


def _validate(args: argparse.Namespace) -> int:
    import logging

    from torchbridge.validation import validate

    # The report (or the error line) states each backend's failure; logged too, it would
    # be printed twice.
    logging.getLogger("torchbridge.validation").setLevel(logging.ERROR)

    config = _load_config()
    backends = _usable_backends(args.backends, config)
    model, sample = _load_model(args.model, args.batch)
    try:
        report = validate(model, sample, backends, level=args.level,  # type: ignore[arg-type]
                          tolerance=args.tolerance)
    except RuntimeError as exc:
        # validate raises this one RuntimeError itself when the model does not run on the
        # reference backend (most often: the sample input does not fit the model).
        if not str(exc).startswith("the reference backend "):
            raise
        raise UsageError(f"--model {args.model}: {exc}") from exc
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.summary())
    return 0 if report.passed else 1


def _launch(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from torchbridge.distributed.launch import launch

    try:
        launch(args.torchrun_args)
    except ChildFailedError as exc:  # the workers' tracebacks are already on stderr
        print(exc.format_msg(), file=sys.stderr)  # type: ignore[no-untyped-call]
        return 1
    return 0


def _add_launch(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    # Every argument goes to the launcher unparsed: torchrun's own options (rendezvous,
    # nodes, restarts) pass through unchanged; torchbridge.distributed.launch checks them
    # all before torchrun starts (a mistake is a LaunchError: one line, exit status 2).
    launch = sub.add_parser("launch", prefix_chars="+", add_help=False,
                            help="start a training script on N processes per node (torchrun "
                            "underneath); --nproc-per-node auto: the backend's device count")
    launch.add_argument("torchrun_args", nargs=argparse.REMAINDER)
    launch.set_defaults(func=_launch)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="torchbridge", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error")
    parser.add_argument("-V", "--version", action="version", version=_version_line(),
                        help="print the version (and the plugin contract's) and exit")
    # Also accepted after the subcommand; SUPPRESS keeps the subparser's default from
    # overwriting a --debug given before it.
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", parents=[common],
                         help="versions, plugins, backends, config: for bug reports")
    doc.add_argument("--json", action="store_true", help="machine-readable output")
    doc.add_argument("--record", metavar="FILE", help="write what each plugin's probe sees "
                     "on this machine (device properties, capabilities, versions; nothing "
                     "identifying beyond the device) as a recording the tests can replay")
    doc.set_defaults(func=_doctor)
    bench = sub.add_parser("bench", parents=[common],
                           help="prepare_model benchmark on the reference models")
    bench.add_argument("--models", nargs="+", choices=[*SUITES["reference"], *SUITES["hf"]])
    bench.add_argument("--suite", choices=["reference", "hf"], default="reference",
                       help="hf: Hugging Face architectures from their configs (needs "
                       "transformers)")
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--plot", metavar="PATH", help="write a chart (needs matplotlib; "
                       "the format follows the extension, PNG without one)")
    bench.set_defaults(func=_bench)
    ker = sub.add_parser("kernels", parents=[common], help="every op, its implementations, "
                         "their plugins, and why each is or is not selected here")
    ker.add_argument("--backend", help="backend name (default: the selected one)")
    ker.add_argument("--training", action="store_true", help="as for a model in training")
    ker.add_argument("--json", action="store_true")
    ker.set_defaults(func=_kernels)
    val = sub.add_parser("validate", parents=[common],
                         help="run a model on several backends and compare outputs with "
                         "the first; exit status 1 on a mismatch")
    val.add_argument("--model", default="mlp", help="mlp, convnet, encoder, decoder_lm, or "
                     "package.module:function returning (model, sample_input)")
    val.add_argument("--backends", type=_backend_list, help="comma-separated, first is the "
                     "reference (default: every available backend; at least two)")
    val.add_argument("--level", type=_level, default="O0",
                     help="prepare_model level on each backend (O0-O3 or an alias)")
    val.add_argument("--tolerance", type=_tolerance, help="max |diff| / max |reference|, "
                     "finite and positive (default: the level's)")
    val.add_argument("--batch", type=_positive_int, default=4,
                     help="batch size of a reference model's input")
    val.add_argument("--json", action="store_true")
    val.set_defaults(func=_validate)
    _add_launch(sub)
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    from torchbridge.errors import TorchBridgeError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    words = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in words  # known before parsing, so parse errors honour it too
    prog = "torchbridge"
    if words[:1] in (["-V"], ["--version"]):  # also in --help; answered before any parsing
        print(_version_line())
        return 0
    try:
        args = build_parser().parse_args(words)
        prog = f"torchbridge {args.command}"
        return int(args.func(args))
    except (UsageError, TorchBridgeError) as exc:
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
