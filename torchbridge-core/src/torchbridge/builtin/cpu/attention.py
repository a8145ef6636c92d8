"""The CPU backend's implementation of `torchbridge::scaled_dot_product_attention` for
bfloat16: q k^T and p v as bfloat16 matmuls (oneDNN's GEMMs), the scale, mask and softmax in
float32 between them. Plain torch ops, so torch.compile traces it and inductor fuses
everything between the two matmuls into one loop. It is what transformers' own eager
attention computes under bfloat16 autocast (matmuls in bf16, softmax in float32).

Why: torch's flash attention kernel for CPU runs slower in bfloat16 than in float32 on a
CPU without AMX, so autocast made attention the one part of an O3 model slower than eager.
Measured on the 2-core AMD EPYC (family 25 model 17, avx512_bf16, no AMX), torch 2.13, O3
with torch's kernel and with this one, in one process, round-robin against eager (the
models of torchbridge.hf_models; `python benchmarks/cpu_attention.py`, 2026-11-24 06:48):
Llama 14.29 -> 13.11 ms, GPT-2 16.58 -> 15.71 ms, BERT 13.88 -> 12.78 ms, ViT 6.85 -> 6.08
ms. But compiling it took 1-3 s more (BERT's and ViT's first call went past 1.5x plain
compile's), and it was not measured on a CPU with AMX, whose bf16 flash kernel is fast:
so it is offered only with config hardware.cpu.bf16_matmul_attention = true. Like every
kernel implementation it is then chosen after its correctness gate, and timed against
the module's own code only with prepare_model(measure=True).

The scores are materialized (batch x heads x queries x keys in float32): a call whose score
matrix would exceed MAX_SCORE_BYTES is declined and runs the reference (flash attention's
tiles never hold it whole). Inference only: no backward is declared.
"""

from __future__ import annotations

import math

import torch

from torchbridge.kernels.implementations import KernelImplementation

# Score matrices up to this size are materialized; larger calls run the reference.
MAX_SCORE_BYTES = 64 * 1024 * 1024


def bf16_matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                          scale: float | None = None, enable_gqa: bool = False
                          ) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with F.scaled_dot_product_attention's semantics
    (a boolean mask keeps where True, a float mask is added, causal from the top left, a
    row with every key masked gives zeros, GQA repeats each key head over its queries)."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    factor = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * factor
    masked = is_causal or attn_mask is not None
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(attn_mask.logical_not(), float("-inf")) \
            if attn_mask.dtype == torch.bool else scores + attn_mask.float()
    weights = scores.softmax(dim=-1)
    if masked:  # softmax of a row of -inf is nan; the reference gives zeros there
        weights = weights.masked_fill(scores.amax(dim=-1, keepdim=True) == float("-inf"), 0.0)
    return torch.matmul(weights.to(v.dtype), v)


def _declines(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              attn_mask: torch.Tensor | None, is_causal: bool, scale: float | None,
              enable_gqa: bool) -> str | None:
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "q, k and v differ in dtype"
    heads = max(q.shape[-3], k.shape[-3]) if q.dim() >= 3 else 1
    batch = math.prod(q.shape[:-3]) if q.dim() > 3 else 1
    score_bytes = batch * heads * q.shape[-2] * k.shape[-2] * 4
    if score_bytes > MAX_SCORE_BYTES:
        return (f"its float32 score matrix would take {score_bytes / 2**20:.0f} MiB (more "
                f"than {MAX_SCORE_BYTES // 2**20} MiB): flash attention never holds it whole")
    if q.device.type != "cpu":
        return f"a {q.device.type} tensor: this implementation is the CPU backend's"
    return None


BF16_MATMUL_ATTENTION = KernelImplementation(
    "scaled_dot_product_attention", "cpu_bf16_matmul_attention", bf16_matmul_attention,
    backends=("cpu",), dtypes=(torch.bfloat16,), traceable=True, declines=_declines,
    description="bf16 matmuls with the scale, mask and softmax in float32 between them, "
                "fused by torch.compile (faster than the bf16 flash kernel without AMX)")
