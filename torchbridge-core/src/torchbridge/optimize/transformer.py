"""Run nn.TransformerEncoderLayer on its composite path, so autocast and compile reach it.

In eval mode PyTorch sends these layers to a fused C++ "fast path"
(`torch._transformer_encoder_layer_fwd`, `torch._native_multi_head_attention`). Its guard
looks at CUDA autocast only, so under CPU autocast it still runs, in float32, ignoring
autocast; torch.compile cannot see inside it either. Measured here: the reference encoder
ran at the same speed at O2 as eager, with zero bf16 error. The composite path below is the
same math in ordinary ops (projections, scaled_dot_product_attention, feed-forward).

nn.TransformerEncoder has a fast path of its own, behind the same CUDA-only autocast
check: given a padding mask in eval mode it packs the batch into a nested tensor, which only
the fused layer op takes, and returns zeros at the padded positions. Under CPU autocast that
op fails, float32 weights (O2) or bfloat16 ones (O3): its attention returns bfloat16, the
residual is added into that, and its nested layer norm gets bfloat16 with float32 norm
weights ("expected scalar type Float but found BFloat16"). Compiled, dynamo does not let the
encoder pack, and the padded positions hold values instead of zeros. composite_encoder_forward never
packs: it runs the layers on the padded batch with the padding mask the nested tensor stood
for, and zeroes what the nested tensor would not have held.
"""

from __future__ import annotations

import typing
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchbridge.optimize.passes import PassContext


def _fast_path_device(tensor: torch.Tensor) -> bool:
    # the devices PyTorch's fast-path guards name (the private backend's name can change)
    return tensor.device.type in ("cpu", "cuda", "xpu",
                                  torch.utils.backend_registration._privateuse1_backend_name)


def _grad_blocks_fast_path(tensors: tuple[torch.Tensor | None, ...]) -> bool:
    # PyTorch's guard: no fast path where autograd would have to record the call
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class CompositeEncoderLayer(nn.TransformerEncoderLayer):
    """An nn.TransformerEncoderLayer that never takes the fused fast path. Same parameters
    and state dict; instances are converted in place by changing their class."""

    def forward(self, src: torch.Tensor, src_mask: torch.Tensor | None = None,
                src_key_padding_mask: torch.Tensor | None = None,
                is_causal: bool = False) -> torch.Tensor:
        if src.is_nested:
            return self._nested_forward(src, src_mask, src_key_padding_mask, is_causal)
        # As PyTorch's forward does: a boolean mask (True = may NOT attend, the opposite of
        # SDPA's boolean mask) becomes an additive float mask, -inf where masked.
        src_key_padding_mask = F._canonical_mask(
            mask=src_key_padding_mask, mask_name="src_key_padding_mask",
            other_type=F._none_or_dtype(src_mask), other_name="src_mask",
            target_type=src.dtype)
        src_mask = F._canonical_mask(mask=src_mask, mask_name="src_mask", other_type=None,
                                     other_name="", target_type=src.dtype, check_other=False)
        if is_causal and src_mask is None and self._fast_path_in_eager(src):
            # PyTorch's fused paths (the layer's and MultiheadAttention's) take no is_causal:
            # without a mask eager attends everywhere; its composite path raises instead.
            is_causal = False
        x = src
        if self.norm_first:
            x = x + self._attend(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._attend(x, src_mask, src_key_padding_mask, is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x

    def _nested_forward(self, src: torch.Tensor, src_mask: torch.Tensor | None,
                        src_key_padding_mask: torch.Tensor | None,
                        is_causal: bool) -> torch.Tensor:
        """A nested tensor (the packed batch of an encoder left unconverted, one of a class
        of the user's own) runs padded, the positions past each sequence's length masked,
        and goes back nested: PyTorch's fused op, the only path that takes one, fails under
        CPU autocast. What that op does not take either (a mask beside the nested tensor,
        batch second, the jagged layout) goes to PyTorch's forward, for its error or its
        result."""
        if src_mask is not None or src_key_padding_mask is not None or src.dim() != 3 \
                or not self.self_attn.batch_first or src.layout != torch.strided:
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)
        lengths = src._nested_tensor_size()[:, 0].to(src.device)
        padded = src.to_padded_tensor(0.0)
        keep = torch.arange(padded.shape[1], device=src.device) < lengths.unsqueeze(1)
        # is_causal dropped: PyTorch's fused op, which takes nested tensors, ignores it
        out = self.forward(padded, src_key_padding_mask=~keep)
        return torch._nested_tensor_from_mask(out, keep, mask_check=False)

    def _fast_path_in_eager(self, x: torch.Tensor) -> bool:
        """Whether PyTorch would run this call's attention on a fused fast path (the
        layer's fused op, or MultiheadAttention's, which runs wherever the layer's would),
        in the model as given: without autocast, weights in the dtype they had."""
        attn = self.self_attn
        return (torch.backends.mha.get_fastpath_enabled() and x.dim() == 3
                and not attn.training and attn.batch_first and attn.num_heads % 2 == 0
                and attn._qkv_same_embed_dim and attn.in_proj_bias is not None
                and attn.bias_k is None and attn.bias_v is None and not attn.add_zero_attn
                and _fast_path_device(x)
                and not torch.overrides.has_torch_function((x,))
                and not _grad_blocks_fast_path((x, attn.in_proj_weight, attn.in_proj_bias,
                                                attn.out_proj.weight, attn.out_proj.bias)))

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


def composite_encoder_forward(encoder: nn.TransformerEncoder, pytorch_forward: Any,
                              src: torch.Tensor, mask: torch.Tensor | None = None,
                              src_key_padding_mask: torch.Tensor | None = None,
                              is_causal: bool | None = None) -> torch.Tensor:
    """The forward of an nn.TransformerEncoder (of CompositeEncoderLayers) that never packs
    its input into a nested tensor. Where PyTorch's (`pytorch_forward`) would (eval mode, a
    padding mask, no other mask, no autograd), the layers run on the padded batch with the
    padding mask the nested tensor stands for, and the padded positions come back zero, as
    PyTorch returns them; the result is PyTorch's. Installed on the instance
    (install_composite_encoder): the encoder keeps its class, a model given as one too."""
    if not _packs_in_eager(encoder, src, mask, src_key_padding_mask):
        # PyTorch's own forward then does not pack either (its guard checks all of these
        # and more), so its layers get what PyTorch's get.
        return pytorch_forward(src, mask, src_key_padding_mask, is_causal)  # type: ignore[no-any-return]
    assert src_key_padding_mask is not None
    padding = F._canonical_mask(
        mask=src_key_padding_mask, mask_name="src_key_padding_mask", other_type=None,
        other_name="mask", target_type=src.dtype)
    assert padding is not None
    # PyTorch packs the first n positions of each sequence, n its count of unmasked ones
    # (mask.logical_not(): a float mask's nonzero entries are padding), after checking
    # (mask_check, by default) that they are the unmasked ones; where they are not it runs
    # the padded batch with the mask as given. Decided in tensors, so that a compiled
    # forward has no data-dependent branch.
    valid = padding == 0
    packed = torch.arange(valid.shape[1], device=valid.device) < valid.sum(dim=1, keepdim=True)
    packed_mask = torch.zeros_like(padding).masked_fill(~packed, float("-inf"))
    if getattr(encoder, "mask_check", True):
        left_aligned = (packed == valid).all()
        layer_mask = torch.where(left_aligned, packed_mask, padding)
        zeroed = ~packed & left_aligned
    else:
        layer_mask, zeroed = packed_mask, ~packed
    output = src
    for layer in encoder.layers:
        # no is_causal: the layers PyTorch runs here, fused, ignore it
        output = layer(output, src_key_padding_mask=layer_mask)
    # nested.to_padded_tensor(0.0): what a sequence does not hold comes back zero
    output = output.masked_fill(zeroed.unsqueeze(-1), 0.0)
    if encoder.norm is not None:
        output = encoder.norm(output)
    return output


def _packs_in_eager(encoder: nn.TransformerEncoder, src: torch.Tensor,
                    mask: torch.Tensor | None, padding: torch.Tensor | None) -> bool:
    """Whether PyTorch's forward would pack this call's input into a nested tensor in the
    model as given (without autocast, uncompiled), but for the left alignment of the
    padding mask, which composite_encoder_forward decides in tensors."""
    first = encoder.layers[0]
    return (torch.backends.mha.get_fastpath_enabled()
            and bool(getattr(encoder, "use_nested_tensor", False)) and not first.training
            and src.dim() == 3 and padding is not None and mask is None
            and not src.is_nested and first.self_attn.batch_first
            and _fast_path_device(src)
            and not torch.overrides.has_torch_function((src,))
            and not _grad_blocks_fast_path((
                src, first.self_attn.in_proj_weight, first.self_attn.in_proj_bias,
                first.self_attn.out_proj.weight, first.self_attn.out_proj.bias,
                first.norm1.weight, first.norm1.bias, first.norm2.weight,
                first.norm2.bias, first.linear1.weight, first.linear1.bias,
                first.linear2.weight, first.linear2.bias)))


def install_composite_encoder(encoder: nn.Module) -> None:
    """composite_encoder_forward as `encoder`'s forward, on the instance (a deep copy gets
    its own)."""
    from torchbridge.optimize.forward import install_forward

    def make(inner: Any) -> Any:
        def forward(src: torch.Tensor, mask: torch.Tensor | None = None,
                    src_key_padding_mask: torch.Tensor | None = None,
                    is_causal: bool | None = None) -> torch.Tensor:
            return composite_encoder_forward(typing.cast(nn.TransformerEncoder, encoder),
                                             inner, src, mask, src_key_padding_mask,
                                             is_causal)
        return forward

    install_forward(encoder, make, redo=install_composite_encoder)


def encoder_layers(model: nn.Module) -> list[nn.TransformerEncoderLayer]:
    return [m for m in model.modules() if type(m) is nn.TransformerEncoderLayer]


def composite_check(model: nn.Module, ctx: PassContext) -> str | None:
    return None if encoder_layers(model) else "no nn.TransformerEncoderLayer in the model"


def use_composite_path(model: nn.Module, ctx: PassContext) -> nn.Module:
    for layer in encoder_layers(model):
        layer.__class__ = CompositeEncoderLayer
    # Encoders whose layers are all converted (an encoder's layers are copies of the one it
    # was given): one with layers of a class of the user's own keeps PyTorch's forward.
    # Its forward is installed on the instance: a model given as an encoder stays one.
    for module in model.modules():
        if type(module) is nn.TransformerEncoder and all(
                type(layer) is CompositeEncoderLayer for layer in module.layers):
            install_composite_encoder(module)
    return model
