"""prepare_model on more Hugging Face architectures than the benchmark's five, built from
tiny configs (no downloads): decoders with grouped-query attention, sliding windows and
their own norms, encoders, an encoder-decoder, vision models with their own blocks. Each
at O1 and O3, with and without a sample input (compile left out, as in test_hf_models.py:
output types and dtypes are decided by the passes before it): the prepared model returns
what the model returns, in its dtypes and within the level's tolerance, with the same
state_dict keys, and the caller's model is left as it was."""

from __future__ import annotations

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


def tokens(batch: int = 2, seq: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # a padded row
    return {"input_ids": ids, "attention_mask": mask}


def images() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


ZOO: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    "mistral": lambda: (tf.MistralForCausalLM(tf.MistralConfig(
        **DECODER, num_key_value_heads=2, sliding_window=8)), tokens()),
    "qwen2": lambda: (tf.Qwen2ForCausalLM(tf.Qwen2Config(
        **DECODER, num_key_value_heads=2)), tokens()),
    "gemma": lambda: (tf.GemmaForCausalLM(tf.GemmaConfig(
        **DECODER, num_key_value_heads=1, head_dim=16)), tokens()),
    "distilbert": lambda: (tf.DistilBertForSequenceClassification(tf.DistilBertConfig(
        vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128)), tokens()),
    "roberta": lambda: (tf.RobertaForMaskedLM(tf.RobertaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64)), tokens()),
    "t5": lambda: (tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
        decoder_start_token_id=0)),
        {**tokens(), "decoder_input_ids": torch.zeros(2, 5, dtype=torch.long)}),
    "convnext": lambda: (tf.ConvNextForImageClassification(tf.ConvNextConfig(
        hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], num_labels=10)), images()),
    "swin": lambda: (tf.SwinForImageClassification(tf.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
        window_size=4, num_labels=10)), images()),
}


def call(model: nn.Module, sample: Any) -> Any:
    with torch.no_grad():
        return model(**sample) if isinstance(sample, dict) else model(sample)


@pytest.mark.parametrize("with_sample", [True, False], ids=["sample", "no-sample"])
@pytest.mark.parametrize("level", ["O1", "O3"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_unseen_architecture_is_a_drop_in(name: str, level: str, with_sample: bool) -> None:
    torch.manual_seed(0)
    model, sample = ZOO[name]()
    model.eval()
    expected = call(model, sample)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": ["compile"]}))

    prepared = backend.prepare_model(model, level,
                                     sample_input=sample if with_sample else None)

    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert type(prepared) is type(model)
    assert list(prepared.state_dict()) == list(model.state_dict())
    out = call(prepared, sample)
    assert type(out) is type(expected) and list(out.keys()) == list(expected.keys())
    assert out.logits.dtype == expected.logits.dtype == torch.float32
    rel = (out.logits - expected.logits).abs().max() / expected.logits.abs().max()
    assert rel <= LEVEL_TOLERANCE[level], f"{name} at {level}: relative error {rel:.2e}"
    result = torchbridge.optimization_result(prepared)
    assert result is not None and not result.failed, result.summary()
