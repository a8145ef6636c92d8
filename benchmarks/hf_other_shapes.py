"""The Hugging Face suite's claims at shapes it does not use: Llama, BERT, ViT and a
ResNet-18 built from their configs at other widths, depths, heads, vocabularies, sequence
lengths, image sizes and batch sizes than torchbridge.hf_models gives them, measured the
way `torchbridge bench --suite hf` measures (each variant prepared with empty inductor
caches for its first call, then all timed round-robin in one process, medians).

    python benchmarks/hf_other_shapes.py [--models llama bert vit resnet]

Prints the machine line (CPU model and flags), then one table row per model and variant:
latency, against eager and plain torch.compile, the first call against plain compile's,
the largest relative error against eager float32, and for int8 the accuracy gate.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import unittest.mock
from collections.abc import Callable
from typing import Any

import torch
import torchbridge
from torchbridge import bench
from torchbridge.bench import _measure  # one model's variants, as bench.run measures them
from torchbridge.types import dtype_name


def _tokens(vocab: int, batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _images(batch: int, size: int) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def models() -> dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], Any], str]]:
    """name: (build, sample input, what differs from the suite's model)."""
    import transformers as tf

    t: Any = tf
    return {
        "llama": (lambda: t.LlamaForCausalLM(t.LlamaConfig(
            vocab_size=16000, hidden_size=384, intermediate_size=1024, num_hidden_layers=3,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
            tie_word_embeddings=False)), lambda: _tokens(16000, 2, 96),
            "hidden 384, 3 layers, 6 heads / 2 KV heads, vocabulary 16000 untied, batch 2 x 96"),
        "bert": (lambda: t.BertForSequenceClassification(t.BertConfig(
            vocab_size=12000, hidden_size=384, num_hidden_layers=3, num_attention_heads=6,
            intermediate_size=1536, max_position_embeddings=256, num_labels=3)),
            lambda: _tokens(12000, 16, 64),
            "hidden 384, 3 layers, 6 heads, FFN 1536, batch 16 x 64"),
        "vit": (lambda: t.ViTForImageClassification(t.ViTConfig(
            image_size=96, patch_size=16, hidden_size=384, num_hidden_layers=3,
            num_attention_heads=6, intermediate_size=1536, num_labels=100)),
            lambda: _images(4, 96), "96x96 images, patch 16, hidden 384, 3 layers, batch 4"),
        "resnet": (lambda: t.ResNetForImageClassification(t.ResNetConfig(
            embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
            layer_type="basic", num_labels=100)), lambda: _images(4, 64),
            "ResNet-18 widths and depths, 64x64 images, batch 4"),
    }


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main() -> None:
    import torch._inductor.config as inductor_config

    table = models()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(table), default=list(table))
    args = parser.parse_args()
    backend = torchbridge.get_backend()
    print(bench.machine(backend))
    peaks = {dtype_name(d): bench.matmul_peak(d) for d in (torch.float32, torch.bfloat16)}
    print("| model | variant | latency ms | vs eager | vs compile | first call s | "
          "vs compile's first call | rel error | quantize gate |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    caches = tempfile.TemporaryDirectory(prefix="torchbridge-shapes-")
    # As bench.run: no variant's first call reuses what another compiled.
    cold = inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False)
    with caches, cold, unittest.mock.patch.dict(os.environ):
        bench._warm_inductor()
        for name in args.models:
            build, make, _ = table[name]
            torch.manual_seed(0)
            model = build().eval()
            variants = ("eager", "compile", "O3", "O3 no sample", "O3 int8")
            rows, gone = _measure(backend, name, 0, model, make(), peaks, lambda _: None,
                                  variants, cache_root=caches.name)
            bench.compare(rows)
            for r in rows:
                gate = "-" if r.quantize_cosine is None else \
                    f"{r.quantize_status}: cosine {r.quantize_cosine:.4f}, argmax " \
                    f"{r.quantize_argmax_agreement:.1%}"
                print(f"| {name} | {r.variant} | {r.latency_ms:.2f} | "
                      f"{r.speedup_vs_eager:.2f}x | {r.speedup_vs_compile:.2f}x | "
                      f"{r.first_call_s:.1f} | {_times(r.first_call_vs_compile)} | "
                      f"{r.rel_error:.1e} | {gate} |", flush=True)
            for s in gone:
                print(f"| {name} | {s['variant']} | {s['status']}: {s['reason']} |", flush=True)
    print()
    for name in args.models:
        print(f"- {name}: {table[name][2]}")


if __name__ == "__main__":
    main()
