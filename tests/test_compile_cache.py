"""config optimization.compile_cache_dir: a second process preparing the same model reuses
what the first compiled (inductor's FX graph cache in that folder). Checked by inductor's own
cache-hit counters, not by timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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
prepack = {"-": None, "on": True, "off": False}[sys.argv[5]]
config = TorchBridgeConfig(optimization={"compile_cache_dir": sys.argv[1]},
                           hardware={"cpu": {"weight_prepack": prepack}})
quantize = sys.argv[3] if sys.argv[3] != "-" else None
result = torchbridge.get_backend("cpu", config).optimize(model, sys.argv[2], sample_input=x,
                                                         quantize=quantize)
print(json.dumps({"applied": result.optimizations_applied, "notes": result.notes,
                  "quantization": result.quantization_outcome() if quantize else None,
                  "inductor": dict(counters["inductor"])}))
"""


def _prepare_in_a_new_process(cache: Path, level: str, quantize: str | None = None,
                              model: str = "mlp", hash_seed: str | None = None,
                              prepack: str = "-") -> dict[str, Any]:
    env = dict(os.environ)
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = hash_seed
    done = subprocess.run([sys.executable, "-c", PREPARE, str(cache), level, quantize or "-",
                           model, prepack], capture_output=True, text=True,
                          timeout=600, env=env)  # the timeout catches hangs only
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(("level", "quantize", "prepack"), [
    ("O2", None, "-"), ("O3", None, "off"), ("O3", "int8", "-")])
def test_a_second_process_reuses_the_compiled_artifacts(tmp_path: Path, level: str,
                                                        quantize: str | None,
                                                        prepack: str) -> None:
    """O3 with weight prepacking off (config hardware.cpu.weight_prepack); int8 too, whose
    graphs hold int8 weights that inductor can pickle: with every Linear quantized no
    float layer is left to prepack (and torchao's weight-pack pattern, whose prepacked
    weights inductor cannot pickle, is not registered)."""
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
    first = _prepare_in_a_new_process(cache, level, quantize, prepack=prepack)
    if quantize is not None:  # quantized and compiled (then kept, or undone by timing)
        outcome: dict[str, str] = first["quantization"]
        assert outcome["status"] == "applied" or \
            outcome["detail"].startswith("undone after timing"), outcome
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1
    assert any(cache.iterdir())
    second = _prepare_in_a_new_process(cache, level, quantize, prepack=prepack)
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1, second
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second


def _kernels(cache: Path) -> set[Path]:
    return set(cache.rglob("*.so"))


def test_prepacked_weights_the_second_process_compiles_the_graph_not_its_kernels(
        tmp_path: Path) -> None:
    """O3 by default prepacks a float model's weights for oneDNN: the graph then holds
    oneDNN tensors, which inductor's FX graph cache cannot pickle, so a second process
    compiles the graph again (bypassed, and the report said so), but builds no C++ kernel:
    each comes from the cache folder."""
    cache = tmp_path / "compiled"
    first = _prepare_in_a_new_process(cache, "O3")
    assert first["inductor"].get("mkldnn_linear_weight_pack_matcher_count", 0) >= 1, first
    assert first["inductor"].get("fxgraph_cache_bypass", 0) >= 1, first
    assert any("prepacked for oneDNN" in n and "another process compiles it again" in n
               for n in first["notes"]), first["notes"]
    kernels = _kernels(cache)
    assert kernels
    second = _prepare_in_a_new_process(cache, "O3")
    assert second["inductor"].get("fxgraph_cache_bypass", 0) >= 1, second
    assert _kernels(cache) == kernels


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
    first = _prepare_in_a_new_process(cache, "O3", model="two_buffers", hash_seed=first_seed,
                                      prepack="off")
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1
    second = _prepare_in_a_new_process(cache, "O3", model="two_buffers",
                                       hash_seed=second_seed, prepack="off")
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1, second
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0, second
