"""The `torchbridge` command: doctor, bench, kernels, validate, launch.

Library modules log; this one prints. Every argument is checked before any work starts. An
ordinary mistake (a bad argument, an unknown backend, a bad TORCHBRIDGE_* variable or
config file, a model that cannot be imported) is one line on stderr naming the problem, with
the nearest valid name where there is one, and exit status 2; `--debug` adds the traceback.

The module imports no torch at its top level: `--help`, `--version` and a mistake in the
arguments answer at once; each command imports what it needs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from torchbridge.suggestions import did_you_mean

# Exit statuses (also in `torchbridge --help`).
EXIT_MISMATCH = 1     # validate found outputs that differ; a launched worker failed
EXIT_USAGE = 2        # a mistake in the arguments, config or environment
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports it
# The reader closed our output (`| head`): 128 + SIGPIPE, what a shell reports for any
# other command that a closed pipe stops (cat, grep). Not 0: the output was cut short, and
# a script that runs under `set -o pipefail` should see that as it would for those.
EXIT_CLOSED_PIPE = 141

DESCRIPTION = """\
TorchBridge finds the best accelerator on this machine (NVIDIA CUDA, AMD ROCm, Intel XPU,
Google TPU or the CPU), describes it, and prepares PyTorch models for it.
"""

EPILOG = """\
examples:
  torchbridge doctor                          what TorchBridge sees here (for bug reports)
  torchbridge bench --models mlp --level O2   eager vs torch.compile vs prepare_model O2
  torchbridge kernels                         which kernel runs each op, and why
  torchbridge validate --backends cpu,cuda    same model on two backends, outputs compared
  torchbridge launch --nproc-per-node auto train.py     one process per device

Run `torchbridge COMMAND --help` for a command's options.

exit status: 0 done; 1 validate found a mismatch, or a launched worker failed; 2 a mistake
in the arguments, config file or TORCHBRIDGE_* variables (one line on stderr; --debug adds
the traceback); 130 interrupted (Ctrl-C); 141 the output was closed early (as by `| head`).
"""


class UsageError(Exception):
    """An ordinary mistake on the command line: reported in one line, exit status 2."""


def _choices_in(message: str) -> tuple[str, list[str]] | None:
    """(the word, the choices) of argparse's "invalid choice: 'x' (choose from ...)"."""
    found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if found is None:
        return None
    choices = [c.strip().strip("'\"") for c in found.group(2).split(",")]
    return found.group(1), choices


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the usage block and exits; one line naming the problem is
        # easier to read, and `--help` is there for the rest.
        invalid = _choices_in(message)
        if invalid is not None and message.lower().startswith("argument command:"):
            word, commands = invalid
            message = (f"unknown command {word!r}; the commands are {', '.join(commands)}"
                       f"{did_you_mean(word, commands)}")
        elif invalid is not None:
            message += did_you_mean(*invalid)
        elif re.search(r"arguments are required: command\b", message, re.IGNORECASE):
            message = ("no command given; the commands are doctor, bench, kernels, "
                       "validate, launch")
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


def _levels(text: str) -> list[str]:
    """--level O1,O3 (or an alias): the levels, each checked."""
    names = [part.strip() for part in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected levels such as O2 or O1,O3, got {text!r}")
    return [_level(name) for name in names]


def _backend_list(text: str) -> list[str]:
    from torchbridge.errors import DeviceError
    from torchbridge.selection import parse_backend_spec, same_device_key

    names = [part.strip() for part in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated backend names such as "
                                         f"cpu,tpu, got {text!r}")
    for name in names:
        try:
            parse_backend_spec(name)
        except DeviceError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    keys = [same_device_key(name) for name in names]
    twice = sorted({name for name, key in zip(names, keys, strict=True)
                    if keys.count(key) > 1})
    if twice:  # a backend compared with itself would pass whatever it computes
        raise argparse.ArgumentTypeError(f"{', '.join(twice)} name one device more than "
                                         f"once in {text!r}: name each backend once")
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
    config = _load_config()
    if args.backend is not None:
        from torchbridge.backend import get_backend

        get_backend(args.backend, config)  # an unknown or unavailable one: one line, now
    from torchbridge import bench

    levels = list(dict.fromkeys(args.level)) if args.level else None
    # bench draws its own progress on a terminal (torchbridge.progress) and logs each step.
    report = bench.run(models=args.models, suite=args.suite, backend=args.backend,
                       levels=levels, batch=args.batch)
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
    from torchbridge.plugins import get_plugin_host

    logging.getLogger("torchbridge").setLevel(logging.ERROR)
    backend = get_backend(args.backend)
    # With the log quiet, what is wrong with the plugin selection is said here (a
    # TORCHBRIDGE_PLUGINS name that no plugin has leaves that plugin's kernels out).
    for warning in get_plugin_host().warnings:
        print(f"warning: {warning}", file=sys.stderr)
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


def _check_model(spec: str) -> Any:
    """The model's factory for "package.module:function", else None for a reference
    model's name; a UsageError naming the models there are for anything else. Asked
    before the backends: the model is what the user typed first."""
    if ":" in spec:
        return _import_factory(spec)
    names = SUITES["reference"]
    if spec not in names:
        raise UsageError(f"unknown model {spec!r}; the models are {', '.join(names)}, or "
                         "give package.module:function returning (model, sample_input)"
                         f"{did_you_mean(spec, names)}")
    return None


def _load_model(spec: str, factory: Any, batch: int) -> tuple[object, object]:
    """A reference model (small size) by name, or what `factory` ("package.module:function",
    checked by _check_model) returns: (model, sample_input)."""
    from torch import nn

    from torchbridge.models import reference_models

    if factory is not None:
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
    ref = next(r for r in reference_models(scale=0.25) if r.name == spec)
    import torch

    torch.manual_seed(0)
    return ref.build(), ref.make_input(batch)


def _usable_backends(requested: list[str] | None, config: Any) -> list[Any]:
    """The backends to compare, created before the model is built. A named backend that
    is unavailable stays a name, so that the report shows why it failed; fewer than two
    usable ones, an unknown name or an unusable reference is a UsageError saying what
    validate needs."""
    from torchbridge.backend import get_backend
    from torchbridge.errors import BackendUnavailableError, DeviceError
    from torchbridge.selection import (
        list_backends,
        normalize_name,
        parse_backend_spec,
        unknown_backend_message,
    )

    statuses = {s.name: s for s in list_backends()}
    if requested is None:
        requested = [name for name, s in statuses.items() if s.available]
    chosen: list[Any] = []
    unusable: list[str] = []
    for spec in requested:
        name = normalize_name(parse_backend_spec(spec)[0])
        if name not in statuses:
            raise UsageError(unknown_backend_message(spec, list(statuses.values())))
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

    factory = _check_model(args.model)
    config = _load_config()
    backends = _usable_backends(args.backends, config)
    model, sample = _load_model(args.model, factory, args.batch)
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
    return 0 if report.passed else EXIT_MISMATCH


def _launch(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from torchbridge.distributed.launch import launch

    try:
        launch(args.torchrun_args)
    except ChildFailedError as exc:  # the workers' tracebacks are already on stderr
        print(exc.format_msg(), file=sys.stderr)  # type: ignore[no-untyped-call]
        return EXIT_MISMATCH
    return 0


LAUNCH_SUMMARY = ("start a training script on N processes per machine (torchrun "
                  "underneath; --nproc-per-node auto: one per device)")

LAUNCH_DESCRIPTION = """\
Start SCRIPT on N processes per machine, with torchrun (torch.distributed.run) underneath.
In the script, torchbridge.distributed.initialize() joins the process group. Every
argument is checked before a process starts: a mistake is one line and exit status 2
(--debug: traceback). Waiting for other machines ends after torchrun's rendezvous timeout
(600 s; --rdzv-conf join_timeout=SECONDS changes it) with a one-line error.
"""

LAUNCH_EPILOG = """\
torchrun's options pass through unchanged, checked before anything starts; the usual ones:
  --nnodes N|MIN:MAX          number of machines (default 1)
  --node-rank R               this machine's rank, 0 to N-1
  --standalone                one machine, a local rendezvous on a free port
  --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB
                              where the machines meet
  --max-restarts N            restart the workers up to N times after a failure
  -m, --module                run SCRIPT as a module (python -m)
For all of them: torchrun --help (or python -m torch.distributed.run --help). Where
torchrun's and TorchBridge's words differ, TorchBridge's above apply: `auto` counts the
devices of the TorchBridge backend, not CUDA devices or CPU cores as torchrun's does.

examples:
  torchbridge launch --nproc-per-node auto train.py --epochs 3
  torchbridge launch --backend cpu --nproc-per-node 4 train.py
  torchbridge launch --nnodes 2 --node-rank 0 --nproc-per-node auto \\
      --rdzv-backend c10d --rdzv-endpoint host0:29500 --rdzv-id job1 train.py
"""


def launch_help_parser() -> argparse.ArgumentParser:
    """What `torchbridge launch --help` shows: TorchBridge's options, then a pointer to
    torchrun's. For display only: launch() parses with torchrun's full parser."""
    from torchbridge.distributed.launch import TORCHRUN_NPROC_WORDS

    shown = _Parser(prog="torchbridge launch",
                    usage="torchbridge launch [OPTIONS] SCRIPT [SCRIPT ARGS...]",
                    description=LAUNCH_DESCRIPTION, epilog=LAUNCH_EPILOG,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    shown.add_argument("--nproc-per-node", metavar="N|auto",
                       help="processes per machine: a number; auto, one per device of the "
                       "TorchBridge backend (at least 1); or torchrun's "
                       f"{', '.join(TORCHRUN_NPROC_WORDS)} (default: 1)")
    shown.add_argument("--backend", metavar="NAME",
                       help="the TorchBridge backend (cuda, rocm, xpu, tpu, cpu, or a "
                       "plugin's) whose devices auto counts; the workers use it too "
                       "(TORCHBRIDGE_BACKEND). Default: the best available")
    shown.add_argument("--debug", action="store_true", help="show the traceback of an error")
    shown.add_argument("script", metavar="SCRIPT", help="the training script (or, with -m, "
                       "a module); its own arguments follow it")
    return shown


def _launch_wants_help(words: list[str]) -> bool:
    """Whether -h/--help in `torchbridge launch WORDS` is ours: before the script (after it,
    it is the script's)."""
    asked = [i for i, word in enumerate(words) if word in ("-h", "--help")]
    if not asked:
        return False
    if asked[0] == 0:
        return True
    # Which word is the script depends on which options take a value: torchrun's parser
    # knows (this imports torch, only for a --help that is not first).
    from torchbridge.distributed.launch import parser
    from torchbridge.errors import TorchBridgeError

    rest = [word for word in words if word not in ("-h", "--help")]
    try:
        script = parser().parse_args(rest).training_script
    except (TorchBridgeError, SystemExit):
        return True  # no script at all: the --help is ours
    before = words[:words.index(script)] if script in words else words
    return any(word in ("-h", "--help") for word in before)


def _add_launch(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    # Every argument goes to the launcher unparsed: torchrun's own options (rendezvous,
    # nodes, restarts) pass through unchanged; torchbridge.distributed.launch checks them
    # all before torchrun starts (a mistake is a LaunchError: one line, exit status 2).
    # `launch --help` is answered by main() with launch_help_parser().
    launch = sub.add_parser("launch", prefix_chars="+", add_help=False, help=LAUNCH_SUMMARY)
    launch.add_argument("torchrun_args", nargs=argparse.REMAINDER)
    launch.set_defaults(func=_launch)


def _command(sub: argparse._SubParsersAction,  # type: ignore[type-arg]
             name: str, common: argparse.ArgumentParser, summary: str, description: str,
             examples: str = "") -> argparse.ArgumentParser:
    """A subcommand whose --help shows a description and examples."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name, parents=[common], help=summary, description=description,
        epilog=f"examples:\n{examples}" if examples else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="torchbridge", description=DESCRIPTION, epilog=EPILOG,
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
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands")
    doc = _command(
        sub, "doctor", common, "what TorchBridge sees here: versions, plugins, backends, "
        "device, memory, config (for bug reports)",
        "Show what TorchBridge sees on this machine: versions, plugins (and their errors),\n"
        "every backend (available, or why not), the selected device and its memory (GiB),\n"
        "the kernels it would use, and the config with where each value came from.\n"
        "Paste the output into a bug report.",
        "  torchbridge doctor\n  torchbridge doctor --json > doctor.json\n"
        "  torchbridge doctor --record my-machine.json")
    doc.add_argument("--json", action="store_true", help="machine-readable output")
    doc.add_argument("--record", metavar="FILE", help="write what each plugin's probe sees "
                     "on this machine (device properties, capabilities, versions; nothing "
                     "identifying beyond the device) as a recording the tests can replay")
    doc.set_defaults(func=_doctor)
    bench = _command(
        sub, "bench", common, "time models eager, with torch.compile and prepared by "
        "TorchBridge at each level",
        "Benchmark prepare_model. Each model runs eager, with plain torch.compile, and\n"
        "prepared by TorchBridge at each level; the report gives median latency, the first\n"
        "call (compile time), peak memory, output error against eager and speedups, and\n"
        "names the machine. Takes minutes: a progress bar shows on a terminal, and each\n"
        "step is logged at INFO.",
        "  torchbridge bench --models mlp --level O2\n"
        "  torchbridge bench --level O1,O3 --batch 8 --json > bench.json\n"
        "  torchbridge bench --suite hf --models gpt2 --plot gpt2.png")
    bench.add_argument("--models", nargs="+", metavar="MODEL",
                       choices=[*SUITES["reference"], *SUITES["hf"]],
                       help="which models (default: every model of the suite). reference: "
                       f"{', '.join(SUITES['reference'])}; hf: {', '.join(SUITES['hf'])}")
    bench.add_argument("--suite", choices=["reference", "hf"], default="reference",
                       help="reference: small models shipped with TorchBridge (default); hf: "
                       "Hugging Face architectures built from their configs (needs "
                       "transformers)")
    bench.add_argument("--backend", metavar="NAME", help="backend to run on (default: the "
                       "best available, or TORCHBRIDGE_BACKEND)")
    bench.add_argument("--level", type=_levels, action="extend", metavar="LEVEL",
                       help="TorchBridge level(s) to run beside the eager and torch.compile "
                       "baselines: O0-O3 or an alias, repeated or comma-separated "
                       "(default: O1,O2,O3)")
    bench.add_argument("--batch", type=_positive_int, metavar="N",
                       help="one batch size for every model (default: each model's own "
                       "sizes)")
    bench.add_argument("--json", action="store_true", help="machine-readable output")
    bench.add_argument("--plot", metavar="PATH", help="also write a chart (needs "
                       "matplotlib; the format follows the extension, PNG without one)")
    bench.set_defaults(func=_bench)
    ker = _command(
        sub, "kernels", common, "which kernel runs each op here, and why each "
        "implementation is or is not chosen",
        "List every op TorchBridge has kernels for, each implementation and the plugin\n"
        "that provides it, and why each one is or is not chosen on this backend.",
        "  torchbridge kernels\n  torchbridge kernels --backend cuda --training")
    ker.add_argument("--backend", metavar="NAME", help="backend to ask (default: the "
                     "selected one)")
    ker.add_argument("--training", action="store_true",
                     help="as for a model in training (default: inference)")
    ker.add_argument("--json", action="store_true", help="machine-readable output")
    ker.set_defaults(func=_kernels)
    val = _command(
        sub, "validate", common, "run a model on several backends and compare the "
        "outputs; exit status 1 on a mismatch",
        "Run one model on several backends and compare each output with the first\n"
        "backend's (the reference). Exit status 0 when all agree within the tolerance, 1\n"
        "on a mismatch.",
        "  torchbridge validate --backends cpu,cuda\n"
        "  torchbridge validate --model my_models:build --backends cuda,cpu --level O2")
    val.add_argument("--model", default="mlp", help="mlp (default), convnet, encoder, "
                     "decoder_lm, or package.module:function returning (model, "
                     "sample_input)")
    val.add_argument("--backends", type=_backend_list, metavar="A,B,...",
                     help="comma-separated backend names; the first is the reference "
                     "(default: every available backend; at least two)")
    val.add_argument("--level", type=_level, default="O0",
                     help="prepare_model level on each backend: O0-O3 or an alias "
                     "(default: O0)")
    val.add_argument("--tolerance", type=_tolerance, help="largest allowed |difference| / "
                     "max |reference| for float outputs, finite and positive (default: the level's "
                     "tolerance, at least 1e-4); integer and bool outputs must be equal")
    val.add_argument("--batch", type=_positive_int, default=4, metavar="N",
                     help="batch size of a reference model's input (default: 4)")
    val.add_argument("--json", action="store_true", help="machine-readable output")
    val.set_defaults(func=_validate)
    _add_launch(sub)
    return parser


def _command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _parse(parser: argparse.ArgumentParser, words: list[str]) -> argparse.Namespace:
    """parse_args, with the nearest option named for an unrecognized one."""
    args, extra = parser.parse_known_args(words)
    if extra:
        command = _command_parsers(parser).get(args.command, parser)
        options = [o for o in command._option_string_actions if o.startswith("--")]
        hints = [did_you_mean(word.split("=")[0], options, show=str)
                 for word in extra if word.startswith("--")]
        hint = next((h for h in hints if h), "")
        command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _silence_stdout() -> None:
    """After the reader closed our output: point stdout at /dev/null, so that the
    interpreter's last flush does not raise (and print) BrokenPipeError again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is no file (a test's capture)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    from torchbridge.errors import TorchBridgeError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    words = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in words  # known before parsing, so parse errors honour it too
    prog = "torchbridge"
    try:
        if words[:1] in (["-V"], ["--version"]):  # also in --help; answered before parsing
            print(_version_line())
        elif words[:1] == ["launch"] and _launch_wants_help(words[1:]):
            launch_help_parser().parse_args(["--help"])  # prints; SystemExit(0) as argparse
        else:
            args = _parse(build_parser(), words)
            prog = f"torchbridge {args.command}"
            status = int(args.func(args))
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
            return status
        sys.stdout.flush()
        return 0
    except (UsageError, TorchBridgeError) as exc:
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_CLOSED_PIPE
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
