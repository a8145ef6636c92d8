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
from collections.abc import Callable
from typing import Any

import torch
import torchbridge
from torchbridge import bench
from torchbridge.bench import _measure  # one model's variants, as bench.run measures them
from torchbridge.hf_models import _images, _tokens  # the suite's input makers
from torchbridge.types import dtype_name


def models() -> dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], Any], str]]:
    """name: (build, sample input, what differs from the suite's model)."""
    import transformers as tf

    t: Any = tf
    return {
        "llama": (lambda: t.LlamaForCausalLM(t.LlamaConfig(
            vocab_size=16000, hidden_size=384, intermediate_size=1024, num_hidden_layers=3,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
            tie_word_embeddings=False)), lambda: _tokens(16000, 96)(2),
            "hidden 384, 3 layers, 6 heads / 2 KV heads, vocabulary 16000 untied, batch 2 x 96"),
        "bert": (lambda: t.BertForSequenceClassification(t.BertConfig(
            vocab_size=12000, hidden_size=384, num_hidden_layers=3, num_attention_heads=6,
            intermediate_size=1536, max_position_embeddings=256, num_labels=3)),
            lambda: _tokens(12000, 64)(16),
            "hidden 384, 3 layers, 6 heads, FFN 1536, batch 16 x 64"),
        "vit": (lambda: t.ViTForImageClassification(t.ViTConfig(
            image_size=96, patch_size=16, hidden_size=384, num_hidden_layers=3,
            num_attention_heads=6, intermediate_size=1536, num_labels=100)),
            lambda: _images(3, 96)(4), "96x96 images, patch 16, hidden 384, 3 layers, batch 4"),
        "resnet": (lambda: t.ResNetForImageClassification(t.ResNetConfig(
            embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
            layer_type="basic", num_labels=100)), lambda: _images(3, 64)(4),
            "ResNet-18 widths and depths, 64x64 images, batch 4"),
    }


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main() -> None:
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
    with bench.cold_compiles() as cache_root:  # as bench.run measures
        for name in args.models:
            build, make, _ = table[name]
            torch.manual_seed(0)
            model = build().eval()
            variants = ("eager", "compile", "O3", "O3 no sample", "O3 int8")
            rows, gone = _measure(backend, name, 0, model, make(), peaks, lambda _: None,
                                  variants, cache_root=cache_root)
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
