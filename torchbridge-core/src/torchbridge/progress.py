"""Progress of long work (prepare_model's passes, benchmarks): a bar on a terminal, nothing
elsewhere. The steps themselves are logged at INFO by the code doing them; this module only
draws. tqdm is optional: without it, or when standard error is not a terminal (a log file,
CI), or with TORCHBRIDGE_PROGRESS=0, no bar is drawn."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any


class Progress:
    """Steps of one piece of work. `step(label)` before each step; `close()` at the end."""

    def __init__(self, total: int, description: str) -> None:
        self._bar: Any = None
        if not _wanted():
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc=description, unit="step", leave=False,
                         file=sys.stderr, dynamic_ncols=True)

    @property
    def drawing(self) -> bool:
        return self._bar is not None

    def step(self, label: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _wanted() -> bool:
    if os.environ.get("TORCHBRIDGE_PROGRESS", "").strip().lower() in ("0", "false", "no",
                                                                       "off"):
        return False
    stream = sys.stderr
    return bool(getattr(stream, "isatty", None) and stream.isatty())


@contextlib.contextmanager
def progress(total: int, description: str) -> Iterator[Progress]:
    bar = Progress(total, description)
    try:
        yield bar
    finally:
        bar.close()
