"""`FlashAttention3`: multi-head attention that runs on the fastest kernel able to honour
its inputs: flash-attn 3 (Hopper), flash-attn 2 (Ampere, 8.0, and newer), else torch's
scaled_dot_product_attention (which itself picks flash / memory-efficient / math kernels and
runs everywhere). "auto" passes over a flash-attn the GPU cannot run and says why; a version
asked for by name that cannot run is a FlashAttentionError naming the reason.

The flash-attn kernels take no arbitrary mask: when a mask is given they are never chosen.
`last_path` and `last_reason` say what the most recent call ran and why.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchbridge_nvidia.architecture import (
    FLASH_ATTN_2_MIN_CAPABILITY,
    FLASH_ATTN_3_MIN_CAPABILITY,
)
from torchbridge_nvidia.errors import FlashAttentionError, KernelLaunchError

logger = logging.getLogger(__name__)
PATHS = ("flash_attn_3", "flash_attn_2", "sdpa")


def _flash_attn_3() -> Any | None:
    try:
        import flash_attn_interface
    except ImportError:
        return None
    return flash_attn_interface


def _flash_attn_2() -> Any | None:
    try:
        import flash_attn
    except ImportError:
        return None
    return flash_attn


def _flash_kernels(module: Any | None) -> Any:
    if module is None:  # select_path chose it, so it imported a moment ago
        raise FlashAttentionError("flash-attn disappeared between path selection and call")
    return module


def _cannot_run(version: str, device: torch.device, dropout: float) -> str | None:
    """Why flash-attn `version` ("3" or "2") cannot run on this CUDA device (None: it can).
    The capability gates are the kernel registry's (kernels.py): flash-attn itself refuses
    an older GPU only at the call."""
    if version == "3":
        if _flash_attn_3() is None:
            return "flash-attn 3 (flash_attn_interface) is not installed"
        major, minor = torch.cuda.get_device_capability(device)
        if major != FLASH_ATTN_3_MIN_CAPABILITY[0]:
            return f"flash-attn 3 is built for Hopper (compute capability 9.0) only; the " \
                   f"device has {major}.{minor}"
        return "flash-attn 3 has no dropout" if dropout else None
    if _flash_attn_2() is None:
        return "flash-attn 2 (flash_attn) is not installed"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FLASH_ATTN_2_MIN_CAPABILITY:
        need = ".".join(map(str, FLASH_ATTN_2_MIN_CAPABILITY))
        return f"flash-attn 2 needs compute capability {need} (Ampere) or newer; the device " \
               f"has {major}.{minor}"
    return None


class FlashAttention3(nn.Module):
    """Batch-first multi-head self/cross attention with the parameters of
    nn.MultiheadAttention (`in_proj_weight`, `in_proj_bias`, `out_proj`), so weights move
    between the two.

    forward(query, key=None, value=None, attn_mask=None, key_padding_mask=None):
    `attn_mask` is (L, S) or (B*H or B, ..., L, S), bool (True = may attend) or float
    (added to the scores); `key_padding_mask` is (B, S) bool, True = padding (as in
    nn.MultiheadAttention). `version` forces a path: "auto", "3", "2" or "sdpa"; None
    reads config.hardware.nvidia.flash_attention_version.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0,
                 causal: bool = False, bias: bool = True, version: str | None = None,
                 device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if version is None:
            from torchbridge.config import TorchBridgeConfig

            section: Any = TorchBridgeConfig.load().hardware
            version = section.nvidia.flash_attention_version
        version = str(version)
        if version not in ("auto", "3", "2", "sdpa"):
            raise ValueError(f"version must be auto, 3, 2 or sdpa, got {version!r}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.dropout, self.causal, self.version = dropout, causal, version
        factory = {"device": device, "dtype": dtype}
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim, **factory)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        nn.init.xavier_uniform_(self.in_proj_weight)
        self.last_path: str | None = None
        self.last_reason: str | None = None

    def select_path(self, q: torch.Tensor, has_mask: bool) -> tuple[str, str]:
        """(path, reason) for a query tensor of shape (B, L, H, D)."""
        dropout = self.dropout if self.training else 0.0
        blockers = []
        if has_mask:
            blockers.append("a mask is given and flash-attn takes none")
        if q.device.type != "cuda":
            blockers.append(f"tensors are on {q.device.type}, not a CUDA GPU")
        if q.dtype not in (torch.float16, torch.bfloat16):
            blockers.append(f"dtype is {q.dtype}; flash-attn needs float16 or bfloat16")
        if self.head_dim > 256 or self.head_dim % 8:
            blockers.append(f"head_dim {self.head_dim} is not a multiple of 8 up to 256")
        candidates = {"3": "flash_attn_3", "2": "flash_attn_2"}
        wanted = ["3", "2"] if self.version == "auto" else \
            [self.version] if self.version in candidates else []
        if not blockers:
            for version in wanted:
                why = _cannot_run(version, q.device, dropout)
                if why is None:
                    return candidates[version], ("flash-attn 3 on Hopper" if version == "3"
                                                 else "flash-attn 2")
                blockers.append(why)  # auto goes on to the next, and says why not this
        if self.version in candidates:
            raise FlashAttentionError(f"version={self.version!r} was requested but cannot "
                                      f"run: {'; '.join(blockers)}")
        return "sdpa", "; ".join(blockers) or "version='sdpa' was requested"

    def _sdpa_mask(self, attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None,
                   batch: int, q_len: int, k_len: int, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor | None:
        """One additive float mask (B or 1, H or 1, L, S) combining causal, attn and padding
        masks; None when there is none (then SDPA may use its fastest kernels)."""
        masks = []
        if attn_mask is not None:
            if attn_mask.dim() == 3:  # (B*H, L, S) as nn.MultiheadAttention takes it
                attn_mask = attn_mask.view(batch, self.num_heads, q_len, k_len)
            masks.append(attn_mask)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (batch, k_len):
                raise ValueError(f"key_padding_mask must be (batch, key_len) = "
                                 f"({batch}, {k_len}), got {tuple(key_padding_mask.shape)}")
            masks.append(~key_padding_mask.bool().view(batch, 1, 1, k_len))
        if not masks:
            return None  # causal alone goes to SDPA as is_causal
        if self.causal:
            masks.append(torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril())
        combined = torch.zeros((), dtype=dtype, device=device)
        for m in masks:
            additive = torch.zeros(m.shape, dtype=dtype, device=device).masked_fill(
                ~m, float("-inf")) if m.dtype == torch.bool else m.to(dtype)
            combined = combined + additive
        return combined

    def _run_flash(self, path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   dropout: float) -> torch.Tensor:
        """The flash-attn kernel of `path`. Its CUDA failures ("no kernel image is available
        for execution on the device", a GPU flash-attn was not built for) come back as
        RuntimeError; they are raised as KernelLaunchError naming the kernel."""
        try:
            if path == "flash_attn_3":
                out = _flash_kernels(_flash_attn_3()).flash_attn_func(q, k, v,
                                                                      causal=self.causal)
                out = out[0] if isinstance(out, tuple) else out
            else:
                out = _flash_kernels(_flash_attn_2()).flash_attn_func(
                    q, k, v, dropout_p=dropout, causal=self.causal)
        except torch.OutOfMemoryError:
            raise  # a RuntimeError too, but memory, not the kernel: callers catch it as such
        except RuntimeError as exc:
            raise KernelLaunchError(f"{path} failed on {q.device} ({q.dtype}, head_dim "
                                    f"{self.head_dim}): {exc}; version='sdpa' runs torch's "
                                    "attention instead") from exc
        result: torch.Tensor = out
        return result

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        key = query if key is None else key
        value = key if value is None else value
        batch, q_len, _ = query.shape
        k_len = key.shape[1]
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        heads = (self.num_heads, self.head_dim)
        q = F.linear(query, w_q, b_q).view(batch, q_len, *heads)
        k = F.linear(key, w_k, b_k).view(batch, k_len, *heads)
        v = F.linear(value, w_v, b_v).view(batch, k_len, *heads)
        has_mask = attn_mask is not None or key_padding_mask is not None
        path, reason = self.select_path(q, has_mask)
        if path != self.last_path:
            logger.debug("FlashAttention3 runs %s: %s", path, reason)
        self.last_path, self.last_reason = path, reason
        dropout = self.dropout if self.training else 0.0
        out: torch.Tensor
        if path in ("flash_attn_3", "flash_attn_2"):
            out = self._run_flash(path, q, k, v, dropout)
        else:
            mask = self._sdpa_mask(attn_mask, key_padding_mask, batch, q_len, k_len,
                                   q.device, q.dtype)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                dropout_p=dropout, is_causal=self.causal and mask is None).transpose(1, 2)
        result: torch.Tensor = self.out_proj(out.reshape(batch, q_len, self.embed_dim))
        return result
