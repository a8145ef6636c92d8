"""generate() with a fixed-size KV cache (`cache_implementation="static"`, the cache
compiled decoding uses) on a model prepared at O3: under autocast a rotary decoder's keys
come out float32 and its values bfloat16, and transformers' StaticCache, which allocates
both in the first keys' dtype and writes with index_copy_, failed on the values
(optimize/kv_cache.py). The prepared model now decodes with it as with the default
dynamic cache, and as close to the model as given as the level's tolerance says."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchbridge
from torch import nn
from torchbridge.levels import LEVEL_TOLERANCE

transformers = pytest.importorskip("transformers")
tf: Any = transformers

VOCAB = 256
DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
PROMPT = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))

# Rotary decoders (keys promoted to float32 under autocast; Mistral's layers with a
# sliding window get StaticSlidingWindowLayers), one with learned positions, and an
# encoder-decoder, whose cache holds two caches.
MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER, num_key_value_heads=2)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(
        **DECODER, num_key_value_heads=2, sliding_window=8)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(
        **DECODER, num_key_value_heads=1, head_dim=16)),
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
        decoder_start_token_id=0)),
}


def generate(model: nn.Module, cache: str) -> Any:
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=0, cache_implementation=cache,
                              output_logits=True, return_dict_in_generate=True)


def relative(a: Any, b: Any) -> float:
    a, b = torch.stack(a.logits), torch.stack(b.logits)
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_o3_decodes_with_a_static_cache_as_with_the_dynamic_one(name: str) -> None:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    sample: dict[str, torch.Tensor] = {"input_ids": PROMPT}
    if name == "t5":
        sample["decoder_input_ids"] = torch.zeros(1, 3, dtype=torch.long)
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": ["compile"]}))
    prepared = backend.prepare_model(model, "O3", sample_input=sample)
    applied = {p.name for p in torchbridge.optimization_result(prepared).passes
               if p.status == "applied"}
    assert {"autocast", "low_precision_weights"} <= applied

    static, dynamic, eager = (generate(prepared, "static"), generate(prepared, "dynamic"),
                              generate(model, "static"))

    assert static.sequences.shape == dynamic.sequences.shape
    assert len(static.logits) == 12
    # The attention reads the same values, cast to bfloat16, over a longer (masked) cache:
    # its bfloat16 sums differ by rounding (0.1-0.7% of the largest logit here).
    assert relative(static, dynamic) < LEVEL_TOLERANCE["O3"] / 3
    assert relative(static, eager) <= LEVEL_TOLERANCE["O3"]


def prepared_llama() -> tuple[nn.Module, nn.Module]:
    """The Llama as built, and prepared at O3 without compile."""
    torch.manual_seed(0)
    model = MODELS["llama"]().eval()
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": ["compile"]}))
    return model, backend.prepare_model(model, "O3", sample_input={"input_ids": PROMPT})


def test_a_layer_stores_in_its_dtype_once_allocated() -> None:
    """A cache the caller allocated in bfloat16 gets the float32 keys in bfloat16, as a
    copy into it would give them, not an error."""
    model, prepared = prepared_llama()
    cache = tf.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        first = prepared(PROMPT, past_key_values=cache, use_cache=True).logits
        keys = cache.layers[0].keys
        assert keys.dtype == cache.layers[0].values.dtype == torch.float32
        cache.reset()
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.bfloat16(), layer.values.bfloat16()
        again = prepared(PROMPT, past_key_values=cache, use_cache=True).logits
    assert cache.layers[0].keys.dtype == torch.bfloat16
    assert float((again - first).abs().max() / first.abs().max()) < LEVEL_TOLERANCE["O3"]


def test_a_copied_or_pickled_cache_is_a_cache_of_its_own() -> None:
    """The wrapped update was copied with the layer, bound to the original layer: a copy
    of a cache (transformers' prefix-cache reuse) wrote into the original's tensors."""
    model, prepared = prepared_llama()
    cache = tf.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        prepared(PROMPT, past_key_values=cache, use_cache=True)
        kept = [layer.keys.clone() for layer in cache.layers]
        for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
            prepared(torch.tensor([[5]]), past_key_values=twin, use_cache=True,
                     cache_position=torch.tensor([10]))
            assert float(twin.layers[0].keys[0, :, 10].abs().sum()) > 0
            assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, kept,
                                                                       strict=True))
