"""Inductor freezing's oneDNN weight prepacking at O3 on a CPU (builtin/cpu/prepack.py):
on while float convolutions or linear layers remain, off when config says so or every
such layer is quantized, and done whatever an earlier compile in the process registered.
Checked by inductor's own pattern counters, not by timing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from torch import nn
from torchbridge.builtin.cpu import prepack


def _convnet() -> nn.Module:  # the same as in AFTER_ANOTHER_COMPILE below
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 4)).eval()


def test_float_layers_are_prepacked_and_config_decides_first() -> None:
    assert prepack.decide(_convnet(), None)[0] is True
    assert prepack.float_layers(_convnet()) == 3
    assert prepack.decide(nn.Sequential(nn.ReLU()), None)[0] is False
    wanted, why = prepack.decide(_convnet(), False)
    assert wanted is False and "hardware.cpu.weight_prepack" in why


def test_the_old_constant_still_reads_with_a_deprecation_warning() -> None:
    # A plugin written against 0.3.0 may read it: its old value, and told what replaces it.
    from torchbridge.builtin.cpu import passes

    with pytest.warns(DeprecationWarning, match="prepack.decide"):
        assert passes.PREPACK_WEIGHTS is False
    with pytest.raises(AttributeError, match="NO_SUCH_SETTING"):
        passes.NO_SUCH_SETTING  # noqa: B018


def test_quantized_linear_layers_are_not_float_layers() -> None:
    pytest.importorskip("torchao")
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    assert prepack.float_layers(model) == 0
    wanted, why = prepack.decide(model, None)
    assert wanted is False and "no float convolution or linear layer" in why


def test_the_note_says_whether_the_prepacked_graph_is_cached(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.config as inductor_config
    from torchbridge.optimize import inductor_backend

    monkeypatch.setattr(prepack, "ensure_registered", lambda: None)
    note = prepack.arrange(True, "2 float convolution/linear layers")
    if inductor_backend.prepacked_graphs_cacheable():
        assert "FX graph cache keeps the graph" in note and "by their values" in note
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    assert "FX graph cache is off" in prepack.arrange(True, "2 float layers")
    monkeypatch.setattr(inductor_config, "fx_graph_cache", True)
    monkeypatch.setattr(inductor_backend, "_patches", lambda: [])  # another torch's layout
    assert "another process compiles it again" in prepack.arrange(True, "2 float layers")


# A frozen graph compiled with prepacking off first (inductor then registers no weight-pack
# pattern for the rest of the process), then the conv net at O3, then an MLP at O3 with
# prepacking off in config.
AFTER_ANOTHER_COMPILE = r"""
import json, torch, torchbridge
from torch import nn
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torchbridge.config import TorchBridgeConfig

def _convnet():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 4)).eval()

torch.manual_seed(0)
with inductor_config.patch({"freezing": True, "cpp.weight_prepack": False}), \
        torch.no_grad():
    torch.compile(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval())(torch.randn(1, 3, 8, 8))
before = counters["inductor"]["mkldnn_conv_weight_pack_matcher_count"]
conv = torchbridge.get_backend("cpu").optimize(_convnet(), "O3",
                                               sample_input=torch.randn(2, 3, 16, 16))
packed = counters["inductor"]["mkldnn_conv_weight_pack_matcher_count"] - before
off = TorchBridgeConfig(hardware={"cpu": {"weight_prepack": False}})
mlp = torchbridge.get_backend("cpu", off).optimize(
    nn.Sequential(nn.Linear(16, 16), nn.ReLU()).eval(), "O3", sample_input=torch.randn(2, 16))
print(json.dumps({"before": before, "packed": packed, "conv_notes": conv.notes,
                  "conv_applied": conv.optimizations_applied, "mlp_notes": mlp.notes}))
"""


def test_prepacking_happens_after_a_compile_that_registered_no_pattern() -> None:
    """Inductor registers its weight-pack patterns once a process, at the first frozen
    compile, only if prepacking is on then: after one with it off, the conv net's O3 must
    still prepack (the pass registers them), and a later model with prepacking off is
    told that the registered patterns may pack its weights all the same."""
    done = subprocess.run([sys.executable, "-c", AFTER_ANOTHER_COMPILE], capture_output=True,
                          text=True, timeout=600)  # hangs only
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["before"] == 0  # the first compile packed nothing
    assert out["packed"] == 2, out
    assert any("prepacked for oneDNN where inductor can (3 float convolution/linear layers)" in n
               for n in out["conv_notes"]), out["conv_notes"]
    assert any("not prepacked" in n and "hardware.cpu.weight_prepack is False" in n
               and "may be prepacked all the same" in n for n in out["mlp_notes"]), \
        out["mlp_notes"]
