"""Hugging Face transformers architectures built from their configs (random weights, no
downloads), for `torchbridge bench --suite hf` and the tests. transformers is optional:
it is imported only when a model is built.

Sizes: `scale=1.0` is the benchmark's (small: hidden 256, 2 layers, sequence 128);
the tests use a smaller scale.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

BATCHES: dict[str, tuple[int, ...]] = {
    "llama": (4,), "gpt2": (4,), "bert": (8,), "vit": (8,), "resnet": (8,)}
SEQ = 128


@dataclass(frozen=True)
class HFReference:
    name: str
    build: Callable[[], nn.Module]
    make_input: Callable[[int], Any]  # batch -> sample_input (a tensor or a dict of kwargs)
    is_decoder: bool = False


def _dims(scale: float, hidden: int, layers: int) -> tuple[int, int]:
    return max(32, int(hidden * scale) // 32 * 32), max(1, round(layers * scale))


def _tokens(vocab: int, seq: int) -> Callable[[int], Any]:
    def make(batch: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return make


def _images(channels: int, size: int) -> Callable[[int], Any]:
    def make(batch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1)
        return torch.randn(batch, channels, size, size, generator=g)
    return make


def hf_reference_models(scale: float = 1.0) -> list[HFReference]:
    """Llama-style decoder, GPT-2, BERT, ViT, ResNet. Raises ImportError naming the package
    when transformers is missing."""
    try:
        import transformers
    except ImportError:
        raise ImportError("the hf suite needs transformers: pip install transformers") \
            from None
    tf: Any = transformers  # configs take model-specific keyword arguments

    vocab = max(256, int(8192 * scale))
    seq = max(16, int(SEQ * scale))
    dim, layers = _dims(scale, 256, 2)
    image = 64 if scale >= 1 else 32

    def seeded(make: Callable[[], Any]) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            torch.manual_seed(0)
            model: nn.Module = make().eval()
            return model
        return build

    def llama() -> Any:
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=vocab, hidden_size=dim, intermediate_size=dim * 8 // 3 // 32 * 32,
            num_hidden_layers=layers, num_attention_heads=max(1, dim // 64),
            num_key_value_heads=max(1, dim // 128), max_position_embeddings=2 * seq + 64,
            tie_word_embeddings=True))

    def gpt2() -> Any:
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=vocab, n_embd=dim, n_layer=layers, n_head=max(1, dim // 64),
            n_positions=2 * seq + 64))

    def bert() -> Any:
        return tf.BertForSequenceClassification(tf.BertConfig(
            vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers,
            num_attention_heads=max(1, dim // 64), intermediate_size=4 * dim,
            max_position_embeddings=seq + 64, num_labels=4))

    def vit() -> Any:
        return tf.ViTForImageClassification(tf.ViTConfig(
            image_size=image, patch_size=8, hidden_size=dim,
            num_hidden_layers=layers, num_attention_heads=max(1, dim // 128),
            intermediate_size=2 * dim, num_labels=10))

    def resnet() -> Any:
        widths = [max(8, int(w * scale)) for w in (32, 64, 128, 256)]
        return tf.ResNetForImageClassification(tf.ResNetConfig(
            embedding_size=widths[0], hidden_sizes=widths, depths=[1, 1, 1, 1],
            layer_type="basic", num_labels=10))

    return [
        HFReference("llama", seeded(llama), _tokens(vocab, seq), is_decoder=True),
        HFReference("gpt2", seeded(gpt2), _tokens(vocab, seq), is_decoder=True),
        HFReference("bert", seeded(bert), _tokens(vocab, seq)),
        HFReference("vit", seeded(vit), _images(3, image)),
        HFReference("resnet", seeded(resnet), _images(3, image)),
    ]
