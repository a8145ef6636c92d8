"""config optimization.compile_cache_dir: a second process preparing the same model reuses
what the first compiled (inductor's FX graph cache in that folder). Checked by inductor's own
cache-hit counters, not by timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchbridge
from torchbridge.config import TorchBridgeConfig

PREPARE = r"""
import json, sys, torch, torchbridge
from torchbridge.config import TorchBridgeConfig
from torch._dynamo.utils import counters
class TwoBuffers(torch.nn.Module):  # non-persistent buffers, as transformers' BERT has
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.shift = torch.nn.Buffer(torch.linspace(0, 1, 16), persistent=False)
        self.scale = torch.nn.Buffer(torch.linspace(1, 2, 16), persistent=False)

    def forward(self, x):
        return torch.nn.functional.gelu(self.lin(x + self.shift)) * self.scale

torch.manual_seed(0)
model = TwoBuffers().eval() if sys.argv[4] == "two_buffers" else torch.nn.Sequential(
    torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()
x = torch.randn(2, 16)
config = TorchBridgeConfig(optimization={"compile_cache_dir": sys.argv[1]})
quantize = sys.argv[3] if sys.argv[3] != "-" else None
result = torchbridge.get_backend("cpu", config).optimize(model, sys.argv[2], sample_input=x,
                                                         quantize=quantize)
print(json.dumps({"applied": result.optimizations_applied,
                  "quantization": result.quantization_outcome() if quantize else None,
                  "inductor": dict(counters["inductor"])}))
"""


def _prepare_in_a_new_process(cache: Path, level: str, quantize: str | None = None,
                              model: str = "mlp", hash_seed: str | None = None
                              ) -> dict[str, object]:
    env = dict(os.environ)
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = hash_seed
    done = subprocess.run([sys.executable, "-c", PREPARE, str(cache), level, quantize or "-",
                           model], capture_output=True, text=True, timeout=600,  # hangs only
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(("level", "quantize"), [("O2", None), ("O3", None), ("O3", "int8")])
def test_a_second_process_reuses_the_compiled_artifacts(tmp_path: Path, level: str,
                                                        quantize: str | None) -> None:
    """int8 too: its graphs hold int8 weights that inductor can pickle (torchao's
    weight-pack pattern, whose prepacked weights it cannot, is not registered)."""
    if quantize is not None:
        pytest.importorskip("torchao")
        from torchbridge.optimize.quantize_gate import unsupported

        backend = torchbridge.get_backend("cpu")
        why = unsupported(quantize, backend.get_device_info(), "cpu")
        if why is not None:
            pytest.skip(why)
    cache = tmp_path / "compiled"
    # (Whether the compiled forward is kept is timed in those processes; it is compiled
    # either way, on the sample input, inside prepare_model.)
    first = _prepare_in_a_new_process(cache, level, quantize)
    if quantize is not None:  # quantized and compiled (then kept, or undone by timing)
        outcome: dict[str, str] = first["quantization"]  # type: ignore[assignment]
        assert outcome["status"] == "applied" or \
            outcome["detail"].startswith("undone after timing"), outcome
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1  # type: ignore[union-attr]
    assert any(cache.iterdir())
    second = _prepare_in_a_new_process(cache, level, quantize)
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1, second  # type: ignore[union-attr]
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second  # type: ignore[union-attr]


def test_the_cache_folder_is_reported_and_a_bad_one_named(tmp_path: Path) -> None:
    model, x = torch.nn.Linear(8, 8).eval(), torch.randn(2, 8)
    config = TorchBridgeConfig(optimization={"compile_cache_dir": str(tmp_path / "c")})
    result = torchbridge.get_backend("cpu", config).optimize(model, "O2", sample_input=x)
    assert any(str(tmp_path / "c") in n and "compile_cache_dir" in n for n in result.notes)
    assert any(c.name == "environment TORCHINDUCTOR_CACHE_DIR" for c in result.process_settings)
    result.restore_process_settings()

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    config = TorchBridgeConfig(optimization={"compile_cache_dir": str(blocker)})
    failed = {p.name: p.detail for p in torchbridge.get_backend("cpu", config).optimize(
        model, "O2", sample_input=x).failed}
    assert "compile_cache_dir" in failed["compile"] and str(blocker) in failed["compile"]


def _set_order(names: list[str], hash_seed: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", f"print(list(set({names!r})))"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONHASHSEED=hash_seed), check=True)
    order: list[str] = json.loads(done.stdout.replace("'", '"'))
    return order


def test_a_second_process_hits_the_cache_whatever_its_string_hashing(tmp_path: Path) -> None:
    """Under freezing, a model's non-persistent buffers become frozen constants named in a
    set of the graph module that inductor's cache key pickles; a set of strings iterates in
    an order that follows each process's string hashes. Two processes whose hash seeds
    order that set differently must still share the compiled graph."""
    frozen = ["_frozen_param2", "_frozen_param3"]  # the two buffers' names on torch 2.13
    seeds = {tuple(_set_order(frozen, str(seed))): str(seed) for seed in range(40)}
    assert len(seeds) == 2, "no two hash seeds order the names differently"
    first_seed, second_seed = seeds.values()
    cache = tmp_path / "compiled"
    first = _prepare_in_a_new_process(cache, "O3", model="two_buffers", hash_seed=first_seed)
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1  # type: ignore[union-attr]
    second = _prepare_in_a_new_process(cache, "O3", model="two_buffers",
                                       hash_seed=second_seed)
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1, second  # type: ignore[union-attr]
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second  # type: ignore[union-attr]
