"""config optimization.compile_cache_dir: a second process preparing the same model reuses
what the first compiled (inductor's FX graph cache in that folder). Checked by inductor's own
cache-hit counters, not by timing."""

from __future__ import annotations

import copy
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
import torchbridge.optimize.fastest
from torchbridge.config import TorchBridgeConfig
from torch._dynamo.utils import counters
from torchbridge.optimize.forward import compile_state
# The prepared model always times fastest, as in tests/conftest.py: the output checked
# below is then the compiled graph's.
torchbridge.optimize.fastest.default_timer = lambda synchronize: (
    lambda label, fn: (fn(), {"prepared": 1.0, "uncompiled": 2.0}.get(label, 3.0))[1])
class TwoBuffers(torch.nn.Module):  # non-persistent buffers, as transformers' BERT has
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.shift = torch.nn.Buffer(torch.linspace(0, 1, 16), persistent=False)
        self.scale = torch.nn.Buffer(torch.linspace(1, 2, 16), persistent=False)

    def forward(self, x):
        return torch.nn.functional.gelu(self.lin(x + self.shift)) * self.scale

torch.manual_seed(int(sys.argv[6]))
# "wide_out": no constant as small as inductor inlines (1-d, at most 8 values), whose
# values would be in the cache key.
model = TwoBuffers().eval() if sys.argv[4] == "two_buffers" else torch.nn.Sequential(
    torch.nn.Linear(16, 32), torch.nn.GELU(),
    torch.nn.Linear(32, 16 if sys.argv[4] == "wide_out" else 4)).eval()
x = torch.randn(2, 16)
prepack = {"-": None, "on": True, "off": False}[sys.argv[5]]
config = TorchBridgeConfig(optimization={"compile_cache_dir": sys.argv[1]},
                           hardware={"cpu": {"weight_prepack": prepack}})
quantize = sys.argv[3] if sys.argv[3] != "-" else None
result = torchbridge.get_backend("cpu", config).optimize(model, sys.argv[2], sample_input=x,
                                                         quantize=quantize)
state = compile_state(result.model)
with torch.no_grad():
    error = (result.model(x).float() - model(x)).abs().max().item()
print(json.dumps({"applied": result.optimizations_applied, "notes": result.notes,
                  "compiled": state is not None and state.error is None and not state.bypass,
                  "error": error,
                  "quantization": result.quantization_outcome() if quantize else None,
                  "inductor": dict(counters["inductor"])}))
"""


def _prepare_in_a_new_process(cache: Path, level: str, quantize: str | None = None,
                              model: str = "mlp", hash_seed: str | None = None,
                              prepack: str = "-", seed: int = 0) -> dict[str, Any]:
    env = dict(os.environ)
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = hash_seed
    done = subprocess.run([sys.executable, "-c", PREPARE, str(cache), level, quantize or "-",
                           model, prepack, str(seed)], capture_output=True, text=True,
                          timeout=600, env=env)  # the timeout catches hangs only
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(("level", "quantize", "prepack"), [
    ("O2", None, "-"), ("O3", None, "-"), ("O3", None, "off"), ("O3", "int8", "-")])
def test_a_second_process_reuses_the_compiled_artifacts(tmp_path: Path, level: str,
                                                        quantize: str | None,
                                                        prepack: str) -> None:
    """O2; O3 with its weights prepacked for oneDNN (the default while float layers
    remain) and without (config hardware.cpu.weight_prepack); int8 too, whose graphs hold
    int8 weights."""
    if quantize is not None:
        pytest.importorskip("torchao")
        from torchbridge.optimize.quantize_gate import unsupported

        backend = torchbridge.get_backend("cpu")
        why = unsupported(quantize, backend.get_device_info(), "cpu")
        if why is not None:
            pytest.skip(why)
    if level == "O3" and prepack == "-" and quantize is None:
        from torchbridge.optimize.inductor_backend import prepacked_graphs_cacheable

        if not prepacked_graphs_cacheable():
            pytest.skip("this torch's FX graph cache is laid out otherwise: graphs with "
                        "prepacked weights are compiled again")
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
    assert second["inductor"].get("fxgraph_cache_bypass", 0) == 0, second


def _kernels(cache: Path) -> set[Path]:
    return set(cache.rglob("*.so"))


def test_prepacked_weights_a_second_process_reuses_the_graph_of_the_same_weights_only(
        tmp_path: Path) -> None:
    """O3 prepacks a float model's weights for oneDNN, for which inductor bypasses its FX
    graph cache; the compile pass's backend keys them, as every frozen weight, by their
    values. A second process with the same weights takes the compiled graph from the cache
    and builds no C++ kernel; one with other weights of the same shapes compiles its own
    graph. Both compute with their own weights."""
    from torchbridge.optimize.inductor_backend import prepacked_graphs_cacheable

    if not prepacked_graphs_cacheable():
        pytest.skip("this torch's FX graph cache is laid out otherwise")
    cache = tmp_path / "compiled"
    first = _prepare_in_a_new_process(cache, "O3", model="wide_out", seed=0)
    assert first["inductor"].get("mkldnn_linear_weight_pack_matcher_count", 0) >= 1, first
    assert first["inductor"].get("fxgraph_cache_miss", 0) >= 1, first
    assert first["inductor"].get("fxgraph_cache_bypass", 0) == 0, first
    assert any("prepacked for oneDNN" in n and "keyed by their values" in n
               for n in first["notes"]), first["notes"]
    kernels = _kernels(cache)
    assert kernels
    same = _prepare_in_a_new_process(cache, "O3", model="wide_out", seed=0)
    assert same["compiled"], same["applied"]
    assert same["inductor"].get("fxgraph_cache_hit", 0) >= 1, same
    assert same["inductor"].get("fxgraph_cache_miss", 0) == 0, same
    assert same["error"] < 5e-2, same  # bf16 against its own float32 eager model
    assert _kernels(cache) == kernels
    other = _prepare_in_a_new_process(cache, "O3", model="wide_out", seed=1)
    assert other["compiled"], other["applied"]
    assert other["inductor"].get("fxgraph_cache_hit", 0) == 0, other
    assert other["inductor"].get("fxgraph_cache_miss", 0) >= 1, other
    assert other["error"] < 5e-2, other


class _Scaled(torch.nn.Module):
    """An MLP times exp(a 0-d parameter), as CLIP's logit_scale: inductor writes a 0-d
    frozen constant's value into the generated code."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                       torch.nn.Linear(64, 16))
        self.logit_scale = torch.nn.Parameter(torch.tensor(scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mlp(x)) * self.logit_scale.exp()


@pytest.mark.parametrize("prepack", [None, False])
def test_a_model_with_other_weights_is_not_served_another_models_graph(
        tmp_path: Path, prepack: bool | None) -> None:
    """Models of the same shapes prepared at O3 one after the other in one process, one
    cache folder: a model with other weights, even a 0-d scale 2% apart (a drift
    prepare_model's checks let pass), gets a graph compiled for its own weights; the same
    weights again take it from the cache. With weights prepacked (the default) and not:
    inductor's own key (metadata only for frozen weights) served the first model's scale
    to the second either way."""
    from torch._dynamo.utils import counters
    from torchbridge.optimize.forward import compile_state

    config = TorchBridgeConfig(optimization={"compile_cache_dir": str(tmp_path / "c")},
                               hardware={"cpu": {"weight_prepack": prepack}})
    x = torch.randn(4, 32)
    torch.manual_seed(0)
    first = _Scaled(0.0).eval()
    models = {"first": first, "other weights": _Scaled(0.0).eval(),
              "other scale": copy.deepcopy(first), "same again": copy.deepcopy(first)}
    with torch.no_grad():
        models["other scale"].logit_scale.fill_(0.02)
    hits = {}
    for name, model in models.items():
        before = counters["inductor"]["fxgraph_cache_hit"]
        result = torchbridge.get_backend("cpu", config).optimize(model, "O3", sample_input=x)
        state = compile_state(result.model)
        assert state is not None and state.error is None, result.summary()
        hits[name] = counters["inductor"]["fxgraph_cache_hit"] - before
        with torch.no_grad():
            got, want = result.model(x).float(), model(x)
        result.restore_process_settings()
        # bf16 error is under 1% of the output; the 0-d scale moves it by 2%
        assert (got - want).abs().max() < 0.01 * want.abs().max(), name
    assert hits == {"first": 0, "other weights": 0, "other scale": 0, "same again": 1}


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


def test_inductor_is_patched_only_while_the_backend_compiles() -> None:
    """The cache keying of prepacked weights applies inside the compile pass's backend
    only: torch's own functions are back after it, nested or failing."""
    from torch._inductor import codecache
    from torchbridge.optimize import inductor_backend

    pickler = codecache.FxGraphCachePickler
    original = pickler.__dict__["_reduce_tensor"]
    with pytest.raises(RuntimeError, match="inside"):
        with inductor_backend._frozen_weights_keyed_by_value():
            assert pickler.__dict__["_reduce_tensor"] is not original
            with inductor_backend._frozen_weights_keyed_by_value():
                pass
            assert pickler.__dict__["_reduce_tensor"] is not original  # still the outer's
            raise RuntimeError("inside")
    assert pickler.__dict__["_reduce_tensor"] is original
    validator = getattr(codecache, "CacheabilityValidator", None)
    if validator is not None:
        with pytest.raises(codecache.BypassFxGraphCache):  # torch's own check is back
            validator.check_tensor(torch.randn(2, 2).to_mkldnn())


def test_a_frozen_weight_is_keyed_by_its_values_in_any_layout() -> None:
    from torchbridge.optimize.inductor_backend import _digest

    w = torch.randn(16, 8)
    assert _digest(w) == _digest(w.clone())
    assert _digest(w) == _digest(w.to_mkldnn())  # prepacked: the same values
    assert _digest(w.t()) == _digest(w.t().contiguous())
    assert _digest(w) != _digest(w + 1e-6 * w.abs().max())
    assert _digest(torch.tensor(0.0)) != _digest(torch.tensor(0.02))
    z = torch.randn(4, dtype=torch.complex64)
    assert _digest(z.conj()) == _digest(z.conj().resolve_conj())
    assert _digest(z.conj()) != _digest(z)


def test_each_frozen_weight_is_digested_once_a_compile(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor pickles a graph's constants twice as it keys the graph (for the key, and for
    the key's debug lines): each frozen weight's values are read once a compile (the
    reference MLP's 50 MB of weights were hashed twice, 0.16 s more of its first call).
    The next compile, here a second prepare_model taking the graph from the cache, reads
    them again: it keys the graph anew."""
    from torch._dynamo.utils import counters
    from torchbridge.optimize import inductor_backend
    from torchbridge.optimize.forward import compile_state

    if not inductor_backend.prepacked_graphs_cacheable():
        pytest.skip("this torch's FX graph cache is laid out otherwise")
    digested: list[torch.Tensor] = []  # held: ids of tensors alive stay distinct
    real = inductor_backend._digest
    monkeypatch.setattr(inductor_backend, "_digest",
                        lambda t: (digested.append(t), real(t))[1])
    config = TorchBridgeConfig(optimization={"compile_cache_dir": str(tmp_path / "c")})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 16)).eval()
    x = torch.randn(2, 16)
    hits = []
    for _ in range(2):
        digested.clear()
        before = counters["inductor"]["fxgraph_cache_hit"]
        result = torchbridge.get_backend("cpu", config).optimize(model, "O3", sample_input=x)
        result.restore_process_settings()
        state = compile_state(result.model)
        assert state is not None and state.error is None, result.summary()
        hits.append(counters["inductor"]["fxgraph_cache_hit"] - before)
        assert len(digested) >= 2, "the weights were not keyed by their values"
        assert len({id(t) for t in digested}) == len(digested), \
            [tuple(t.shape) for t in digested]
    assert hits == [0, 1]
    assert getattr(inductor_backend._compiling, "digests", None) is None


def test_frozen_constants_the_graph_does_not_read_are_keyed_by_metadata_only() -> None:
    """Weight prepacking leaves the float weights it replaced in the graph module, read by
    no node: their values cannot reach the compiled code, and are not hashed. A graph that
    might read tensors otherwise than through get_attr nodes naming tensors (a submodule
    it calls, a subgraph) has every frozen constant hashed."""
    from torchbridge.optimize.inductor_backend import unread_constants

    def graph_module(extra: str | None = None) -> torch.fx.GraphModule:
        root = torch.nn.Module()
        root.register_buffer("read", torch.randn(4))
        root.inner = torch.nn.Module()
        root.inner.register_buffer("nested", torch.randn(4))
        root.sub = torch.nn.Linear(4, 4)
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        y = graph.call_function(torch.add, (x, graph.get_attr("read")))
        y = graph.call_function(torch.add, (y, graph.get_attr("inner.nested")))
        if extra == "call_module":
            y = graph.call_module("sub", (y,))
        elif extra == "subgraph":
            graph.get_attr("sub")
        graph.output(y)
        gm = torch.fx.GraphModule(root, graph)
        # what freezing leaves: buffers the graph reads, and ones it no longer does
        gm.register_buffer("replaced", torch.randn(4))
        gm.register_buffer("not_frozen", torch.randn(4))
        for t in (gm.read, gm.replaced, gm.inner.nested):
            t._is_frozen_param = True  # type: ignore[attr-defined]
        return gm

    gm = graph_module()
    assert set(unread_constants(gm).values()) == {gm.replaced}
    assert unread_constants(graph_module("call_module")) == {}
    assert unread_constants(graph_module("subgraph")) == {}
