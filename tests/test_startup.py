"""Startup stays cheap: importing torchbridge and get_backend() never import torch._dynamo
or inductor (about 1.5 s on a 2-core machine), which only preparing a model needs; the
command line's --help, --version and argument mistakes, `import torchbridge` and the plugin
contract (torchbridge.hookspecs) import no torch at all. Checked in fresh interpreters: this
test process has long imported all of them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
import torchbridge
torchbridge.get_backend()
torchbridge.get_backend("cpu").get_device_info()
print(json.dumps(sorted(m for m in sys.modules
                        if m.startswith(("torch._dynamo", "torch._inductor")))))
"""


def test_get_backend_imports_neither_dynamo_nor_inductor() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=300).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []


# -- the command line and the package import without torch ----------------------------------

NO_TORCH_PROBE = """
import json, sys
words = json.loads(sys.argv[1])
if words and words[0] == "import":
    import importlib
    for name in words[1:]:
        importlib.import_module(name)
    import torchbridge
    torchbridge.hookimpl, torchbridge.ConfigurationError, torchbridge.OptimizationLevel
    torchbridge.CONTRACT_VERSION
else:
    from torchbridge.cli import main
    try:
        main(words)
    except SystemExit:
        pass
sys.stdout.flush()
print("\\nTORCH-IMPORTED" if "torch" in sys.modules else "\\nNO-TORCH")
"""

NO_TORCH = [["--help"], ["--version"], ["-V"], ["doctor", "--help"], ["bench", "--help"],
            ["kernels", "--help"], ["validate", "--help"], ["launch", "--help"],
            ["launch", "-h"], ["doctr"], ["bench", "--level", "O4"], ["doctor", "--jsn"],
            ["import", "torchbridge"], ["import", "torchbridge.hookspecs"],
            ["import", "torchbridge.cli", "torchbridge.errors", "torchbridge.levels"]]


@pytest.mark.parametrize("words", NO_TORCH, ids=[" ".join(w) for w in NO_TORCH])
def test_help_version_and_mistakes_do_not_import_torch(words: list[str]) -> None:
    """`torchbridge --help` took 1.6 s importing torch to print text; plugins import
    torchbridge.hookspecs at load. Neither needs torch."""
    done = subprocess.run([sys.executable, "-c", NO_TORCH_PROBE, json.dumps(words)],
                          capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().splitlines()[-1] == "NO-TORCH", done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_every_exported_name_still_imports() -> None:
    """The lazy package root answers every name it exported when it imported eagerly."""
    import torch
    import torchbridge
    from torchbridge.errors import DeviceError, OutOfMemoryError

    for name in torchbridge.__all__:
        assert getattr(torchbridge, name) is not None, name
    namespace: dict[str, object] = {}
    exec(f"from torchbridge import {', '.join(torchbridge.__all__)}", namespace)
    assert torchbridge.OutOfMemoryError is OutOfMemoryError
    assert issubclass(OutOfMemoryError, torch.OutOfMemoryError)
    assert issubclass(OutOfMemoryError, DeviceError)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        torchbridge.no_such_name  # noqa: B018
    with pytest.raises(AttributeError):
        torchbridge.errors.NoSuchError  # type: ignore[attr-defined]  # noqa: B018


def test_out_of_memory_error_is_caught_as_either_and_pickles() -> None:
    import pickle

    import torch
    import torchbridge
    from torchbridge_nvidia.errors import OutOfMemoryError as NvidiaOOM

    for raised in (torchbridge.OutOfMemoryError("requested 2.0 GiB"), NvidiaOOM("x")):
        with pytest.raises(torch.OutOfMemoryError):
            raise raised
        with pytest.raises(torchbridge.OutOfMemoryError):
            raise raised
    copy = pickle.loads(pickle.dumps(torchbridge.OutOfMemoryError("requested 2.0 GiB")))
    assert type(copy) is torchbridge.OutOfMemoryError and str(copy) == "requested 2.0 GiB"
    assert torchbridge.OutOfMemoryError.__qualname__ == "OutOfMemoryError"
