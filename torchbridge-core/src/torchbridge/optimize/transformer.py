"""Run nn.TransformerEncoderLayer on its composite path, so autocast and compile reach it.

In eval mode PyTorch sends these layers to a fused C++ "fast path"
(`torch._transformer_encoder_layer_fwd`, `torch._native_multi_head_attention`). Its guard
looks at CUDA autocast only, so under CPU autocast it still runs, in float32, ignoring
autocast; torch.compile cannot see inside it either. Measured here: the reference encoder
ran at the same speed at O2 as eager, with zero bf16 error. The composite path below is the
same math in ordinary ops (projections, scaled_dot_product_attention, feed-forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchbridge.optimize.passes import PassContext


class CompositeEncoderLayer(nn.TransformerEncoderLayer):
    """An nn.TransformerEncoderLayer that never takes the fused fast path. Same parameters
    and state dict; instances are converted in place by changing their class."""

    def forward(self, src: torch.Tensor, src_mask: torch.Tensor | None = None,
                src_key_padding_mask: torch.Tensor | None = None,
                is_causal: bool = False) -> torch.Tensor:
        if src.is_nested:
            # nn.TransformerEncoder packs src and its padding mask into a nested tensor in
            # eval mode; only the fused path takes one.
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)
        # As PyTorch's forward does: a boolean mask (True = may NOT attend, the opposite of
        # SDPA's boolean mask) becomes an additive float mask, -inf where masked.
        src_key_padding_mask = F._canonical_mask(
            mask=src_key_padding_mask, mask_name="src_key_padding_mask",
            other_type=F._none_or_dtype(src_mask), other_name="src_mask",
            target_type=src.dtype)
        src_mask = F._canonical_mask(mask=src_mask, mask_name="src_mask", other_type=None,
                                     other_name="", target_type=src.dtype, check_other=False)
        x = src
        if self.norm_first:
            x = x + self._attend(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._attend(x, src_mask, src_key_padding_mask, is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x

    def _attend(self, x: torch.Tensor, mask: torch.Tensor | None,
                key_padding_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        attn = self.self_attn
        heads = attn.num_heads
        batch, length = x.shape[:2] if attn.batch_first else (x.shape[1], x.shape[0])
        # The mask shapes nn.MultiheadAttention takes for batched self-attention: (L, L),
        # or (batch * heads, L, L), batch-major.
        mask_fits = mask is None or mask.shape in ((length, length),
                                                   (batch * heads, length, length))
        if x.dim() != 3 or key_padding_mask is not None or attn.in_proj_weight is None \
                or attn.bias_k is not None or attn.add_zero_attn or not mask_fits \
                or (is_causal and mask is None):
            # Rare layouts (unbatched input, padding masks, separate q/k/v weights, bias_k,
            # zero attention, other mask shapes, is_causal without its mask): the layer's
            # own path, so the same result or the same error as PyTorch, just not faster.
            return self._sa_block(x, mask, key_padding_mask, is_causal=is_causal)
        if not attn.batch_first:
            x = x.transpose(0, 1)
        dim = x.shape[-1]
        q, k, v = F.linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (t.reshape(batch, length, heads, dim // heads).transpose(1, 2)
                   for t in (q, k, v))
        if is_causal:
            mask = None  # PyTorch's contract: is_causal=True says the mask is the causal one
        elif mask is not None and mask.dim() == 3:
            mask = mask.reshape(batch, heads, length, length)
        # A float32 mask with bf16 q/k/v under autocast is cast by autocast's SDPA, as in
        # PyTorch's own path; passed as is so both compute the same.
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=attn.dropout if attn.training else 0.0,
            is_causal=is_causal)
        out = attn.out_proj(out.transpose(1, 2).reshape(batch, length, dim))
        if not attn.batch_first:
            out = out.transpose(0, 1)
        result: torch.Tensor = self.dropout1(out)
        return result


def encoder_layers(model: nn.Module) -> list[nn.TransformerEncoderLayer]:
    return [m for m in model.modules() if type(m) is nn.TransformerEncoderLayer]


def composite_check(model: nn.Module, ctx: PassContext) -> str | None:
    return None if encoder_layers(model) else "no nn.TransformerEncoderLayer in the model"


def use_composite_path(model: nn.Module, ctx: PassContext) -> nn.Module:
    for layer in encoder_layers(model):
        layer.__class__ = CompositeEncoderLayer
    return model
