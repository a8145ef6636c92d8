"""Module patterns: the kinds of module the kernel substitution pass recognises, by
structure, and how each one's forward calls an op. The core's: rms_norm (nn.RMSNorm and
Hugging Face-style RMSNorm), SwiGLU MLPs, nn.MultiheadAttention. Plugins add theirs
through the `torchbridge_module_patterns` hook.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def module_device(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def hidden_input(module: nn.Module, facts: dict[str, Any], dtype: torch.dtype
                 ) -> tuple[Any, ...]:
    """(batch 2, sequence 8, facts["hidden"]) in `dtype`: a layer's input, synthetic."""
    return (torch.randn(2, 8, facts["hidden"], dtype=dtype, device=module_device(module)),)


# The gate's second shape: more rows than a 64- or 128-row tile, an odd (prime) count, so
# that a kernel wrong past its first tile or on a ragged edge shows it; one batch keeps the
# cost of the probe at about one short sequence.
LARGER_ROWS = 131


def larger_hidden_input(module: nn.Module, facts: dict[str, Any], dtype: torch.dtype
                        ) -> tuple[Any, ...]:
    """(batch 1, sequence LARGER_ROWS, facts["hidden"]) in `dtype`: the gate's second,
    larger and odd-sized synthetic input."""
    return (torch.randn(1, LARGER_ROWS, facts["hidden"], dtype=dtype,
                        device=module_device(module)),)


def grown_input(args: tuple[Any, ...], rows: int = LARGER_ROWS) -> tuple[Any, ...]:
    """A synthetic input like `args` with at least `rows` rows and an odd leading size:
    every tensor whose leading size is the first tensor's grows along it (fresh random
    values for floating tensors, repeats for the others); other arguments stay. For
    patterns without `larger_input`; the gate skips the probe if the pattern cannot run
    it."""
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2), None)
    if first is None:
        return args
    lead = first.shape[0]
    per_lead = max(1, first.numel() // max(1, first.shape[-1]) // max(1, lead))
    size = max(lead + 1, -(-rows // per_lead))
    size += 1 - size % 2  # odd

    def grow(a: Any) -> Any:
        if not isinstance(a, torch.Tensor) or a.dim() < 1 or a.shape[0] != lead:
            return a
        shape = (size, *a.shape[1:])
        if a.is_floating_point():
            return torch.randn(shape, dtype=a.dtype, device=a.device)
        repeats = -(-size // lead)
        return a.repeat(repeats, *([1] * (a.dim() - 1)))[:size].clone()

    return tuple(grow(a) for a in args)


@dataclass(frozen=True)
class ModulePattern:
    """A kind of module the substitution pass can make call op `op`.

    match(module) -> facts | None: the facts the forward needs (e.g. the epsilon), None
        when the module is not of this kind. Structure only; the numbers are checked after.
    forward(module, kernel, facts, *args, **kwargs): the module's forward calling
        `kernel(...)` with the op's arguments.
    example_input(module, facts, dtype) -> args: a small synthetic input of the module's
        width, for models prepared without a sample input.
    larger_input(module, facts, dtype) -> args: a second synthetic input, with more rows
        than a kernel's first tile and odd sizes (see larger_hidden_input); without a
        sample input the gate checks implementations on both. None: example_input's
        tensors grown along their leading dimension (grown_input).
    misfit(module, facts, *args, **kwargs) -> reason | None: why a call (the captured
        one) would not reach the op (the forward then runs the module's own code); such a
        module is kept.
    replay(module, facts, args, kwargs) -> (args, kwargs): the captured call as the checks
        replay it, several times (e.g. without a KV cache object each replay would grow).
    compared(output) -> the part of the module's output the op computes, which the checks
        compare (e.g. an attention output without the weights nobody asked for).
    """

    name: str
    op: str
    match: Callable[[nn.Module], dict[str, Any] | None]
    forward: Callable[..., Any]
    example_input: Callable[[nn.Module, dict[str, Any], torch.dtype], tuple[Any, ...]]
    description: str = ""
    misfit: Callable[..., str | None] | None = None
    replay: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]] | None = None
    compared: Callable[[Any], Any] | None = None
    larger_input: Callable[[nn.Module, dict[str, Any], torch.dtype], tuple[Any, ...]] | None \
        = None


# --- rms_norm --------------------------------------------------------------------------

_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")


def _rms_norm_match(module: nn.Module) -> dict[str, Any] | None:
    if next(module.children(), None) is not None or list(module.buffers(recurse=False)):
        return None
    params = dict(module.named_parameters(recurse=False))
    if set(params) - {"weight"}:
        return None
    weight = params.get("weight")
    eps_name = next((n for n in _EPS_NAMES if n in vars(module)), None)
    if eps_name is None:
        return None
    eps = getattr(module, eps_name)
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float))):
        return None
    if weight is not None:
        if weight.dim() != 1:
            return None
        hidden = weight.shape[0]
    else:
        shape = getattr(module, "normalized_shape", None)
        if not isinstance(shape, (tuple, list)) or len(shape) != 1:
            return None
        hidden = int(shape[0])
    return {"eps": eps, "hidden": hidden, "promotes": _promotes(module, weight, hidden)}


def _promotes(module: nn.Module, weight: torch.Tensor | None, hidden: int) -> bool:
    """Whether the module returns promote(input, weight) dtype (Hugging Face multiplies by
    the weight after casting back) rather than the input's dtype, from one tiny run."""
    if weight is None or not weight.is_floating_point():
        return False
    other = torch.bfloat16 if weight.dtype == torch.float32 else torch.float32
    try:
        with torch.no_grad():
            out = module(torch.ones(1, hidden, dtype=other, device=weight.device))
    except Exception:
        return False
    return isinstance(out, torch.Tensor) and out.dtype != other


def _rms_norm_forward(module: nn.Module, kernel: Callable[..., Any], facts: dict[str, Any],
                      x: torch.Tensor) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    eps = facts["eps"] if facts["eps"] is not None else torch.finfo(x.dtype).eps
    out: torch.Tensor = kernel(x, weight, float(eps))
    if facts["promotes"] and weight is not None and weight.dtype != x.dtype:
        out = out.to(torch.promote_types(x.dtype, weight.dtype))
    return out


RMS_NORM = ModulePattern("rms_norm", "rms_norm", _rms_norm_match, _rms_norm_forward,
                         hidden_input, "nn.RMSNorm and Hugging Face-style RMSNorm "
                         "(a weight and an epsilon)", larger_input=larger_hidden_input)


# --- SwiGLU MLP --------------------------------------------------------------------------

_SWIGLU_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"),
                 ("gate", "up", "down"))
_ACTIVATION_NAMES = ("act_fn", "act", "activation", "activation_fn")


def _swiglu_match(module: nn.Module) -> dict[str, Any] | None:
    children = dict(module.named_children())
    for gate, up, down in _SWIGLU_NAMES:
        linears = [children.get(n) for n in (gate, up, down)]
        if not all(isinstance(m, nn.Linear) for m in linears):
            continue
        g, u, d = linears
        assert isinstance(g, nn.Linear) and isinstance(u, nn.Linear) and isinstance(d, nn.Linear)
        if g.in_features != u.in_features or g.out_features != u.out_features or \
                d.in_features != g.out_features:
            continue
        activation = next((getattr(module, n) for n in _ACTIVATION_NAMES
                           if callable(getattr(module, n, None))), None)
        others = set(children) - {gate, up, down} - set(_ACTIVATION_NAMES)
        if activation is None or others or list(module.parameters(recurse=False)):
            continue
        return {"gate": gate, "up": up, "down": down, "hidden": g.in_features}
    return None


def _swiglu_forward(module: nn.Module, kernel: Callable[..., Any], facts: dict[str, Any],
                    x: torch.Tensor) -> torch.Tensor:
    gate = getattr(module, facts["gate"])(x)
    up = getattr(module, facts["up"])(x)
    out: torch.Tensor = getattr(module, facts["down"])(kernel(gate, up))
    return out


SWIGLU = ModulePattern("swiglu_mlp", "silu_mul", _swiglu_match, _swiglu_forward,
                       hidden_input, "MLPs computing down(silu(gate(x)) * up(x)) "
                       "(gate_proj/up_proj/down_proj, w1/w3/w2)",
                       larger_input=larger_hidden_input)

# --- attention: nn.MultiheadAttention -----------------------------------------------------

def _mha_match(module: nn.Module) -> dict[str, Any] | None:
    if not isinstance(module, nn.MultiheadAttention) or not module._qkv_same_embed_dim or \
            module.bias_k is not None or module.add_zero_attn:
        return None
    return {"hidden": module.embed_dim}


def _as_sdpa_mask(attn_mask: torch.Tensor | None, batch: int, heads: int, q_len: int,
                  k_len: int) -> torch.Tensor | None:
    """MultiheadAttention's mask ((L, S) or (B*H, L, S); bool True = may NOT attend, float
    added) as SDPA's (bool True = may attend, float added), broadcast to (B, H, L, S)."""
    if attn_mask is None:
        return None
    if attn_mask.dim() == 3:
        attn_mask = attn_mask.view(batch, heads, q_len, k_len)
    return ~attn_mask if attn_mask.dtype == torch.bool else attn_mask


def _mha_misfit(module: nn.Module, facts: dict[str, Any], query: torch.Tensor,
                key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> str | None:
    if need_weights:
        return "called with need_weights=True: the op returns no attention weights"
    if key_padding_mask is not None:
        return "called with a key_padding_mask"
    if module.training and float(getattr(module, "dropout", 0.0) or 0.0):
        return "attention dropout in training: the op has none"
    if is_causal and attn_mask is None:
        return "is_causal without a mask (MultiheadAttention refuses that)"
    if query.dim() != 3:
        return "unbatched input"
    return None


def _mha_forward(module: nn.Module, kernel: Callable[..., Any], facts: dict[str, Any],
                 query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                 attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                 is_causal: bool = False) -> Any:
    """The op where its contract fits (see _mha_misfit); otherwise MultiheadAttention's own."""
    assert isinstance(module, nn.MultiheadAttention)
    if _mha_misfit(module, facts, query, key, value, key_padding_mask, need_weights,
                   attn_mask, average_attn_weights, is_causal) is not None:
        return nn.MultiheadAttention.forward(module, query, key, value, key_padding_mask,
                                             need_weights, attn_mask, average_attn_weights,
                                             is_causal)
    if not module.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    batch, q_len, embed = query.shape
    k_len, heads = key.shape[1], module.num_heads
    w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    b_q = b_k = b_v = None
    if module.in_proj_bias is not None:
        b_q, b_k, b_v = module.in_proj_bias.chunk(3)

    def split(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, length: int
              ) -> torch.Tensor:
        return F.linear(x, w, b).view(batch, length, heads, embed // heads).transpose(1, 2)

    out = kernel(split(query, w_q, b_q, q_len), split(key, w_k, b_k, k_len),
                 split(value, w_v, b_v, k_len),
                 _as_sdpa_mask(attn_mask, batch, heads, q_len, k_len), False, None, False)
    out = module.out_proj(out.transpose(1, 2).reshape(batch, q_len, embed))
    return (out if module.batch_first else out.transpose(0, 1)), None


def _mha_input(module: nn.Module, facts: dict[str, Any], dtype: torch.dtype,
               make: Callable[..., tuple[Any, ...]] = hidden_input) -> tuple[Any, ...]:
    (x,) = make(module, facts, dtype)
    if not getattr(module, "batch_first", False):
        x = x.transpose(0, 1)
    return (x, x, x, None, False)  # need_weights=False: what a transformer layer passes


def _mha_larger_input(module: nn.Module, facts: dict[str, Any], dtype: torch.dtype
                      ) -> tuple[Any, ...]:
    return _mha_input(module, facts, dtype, larger_hidden_input)


MULTIHEAD_ATTENTION = ModulePattern(
    "multihead_attention", "scaled_dot_product_attention", _mha_match, _mha_forward,
    _mha_input, "nn.MultiheadAttention called without asking for attention weights (as "
    "nn.TransformerEncoderLayer and DecoderLayer call it)", _mha_misfit,
    larger_input=_mha_larger_input)

BUILTIN_PATTERNS = (RMS_NORM, SWIGLU, MULTIHEAD_ATTENTION)
