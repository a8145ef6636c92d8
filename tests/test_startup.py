"""Startup stays cheap: importing torchbridge and get_backend() never import torch._dynamo
or inductor (about 1.5 s on a 2-core machine), which only preparing a model needs. Checked
in a fresh interpreter: this test process has long imported both."""

from __future__ import annotations

import json
import subprocess
import sys

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
