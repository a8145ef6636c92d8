"""`torchbridge launch`: torchrun (torch.distributed.run) with the process count taken from
the selected backend. Every torchrun option passes through unchanged, so a multi-node job
is started exactly as torchrun documents it."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence

logger = logging.getLogger(__name__)

DESCRIPTION = """\
Start SCRIPT on --nproc-per-node processes per node with torchrun (torch.distributed.run).
--nproc-per-node auto starts one process per device of the selected backend (at least 1;
--backend NAME or TORCHBRIDGE_BACKEND picks it; the children see the same choice). In the
script, torchbridge.distributed.initialize() joins the group. Every other option is
torchrun's and passes through unchanged, e.g. on each of two machines:
  torchbridge launch --nnodes 2 --node-rank R --nproc-per-node auto \\
      --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --rdzv-id job1 train.py
"""


def parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    launch_parser = get_args_parser()
    launch_parser.prog = "torchbridge launch"
    launch_parser.description = DESCRIPTION
    launch_parser.formatter_class = argparse.RawDescriptionHelpFormatter
    launch_parser.add_argument("--backend", default=None,
                               help="TorchBridge backend whose device count 'auto' means, "
                               "exported to the workers as TORCHBRIDGE_BACKEND")
    return launch_parser


def resolve_nproc(nproc_per_node: str, backend: str | None) -> str:
    """`auto`: the backend's device count (at least 1). torchrun's own "auto" would count
    CUDA, then XPU, then CPU cores, whatever backend the script runs on."""
    if nproc_per_node != "auto":
        return nproc_per_node
    from torchbridge.backend import get_backend

    selected = get_backend(backend)
    count = max(1, selected.device_count)
    logger.info("--nproc-per-node auto: %d (%s)", count, selected.name)
    return str(count)


def launch(argv: Sequence[str]) -> None:
    """Parse torchrun's arguments (plus --backend) and run them; raises torch's
    ChildFailedError when a worker fails."""
    from torch.distributed.run import run

    args = parser().parse_args(list(argv))
    if args.backend:
        os.environ["TORCHBRIDGE_BACKEND"] = args.backend
    args.nproc_per_node = resolve_nproc(args.nproc_per_node, args.backend)
    run(args)  # type: ignore[no-untyped-call]
