"""What every Triton kernel here shares: which calls it can take, how big a block is, how it
is launched on the tensor's device, and how the ahead-of-time check describes a compile."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import triton

from torchbridge.errors import KernelError

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# One program holds a whole row in registers; past this many elements a row spills so far
# that the kernel stops paying (Liger-Kernel caps its fused row kernels at the same figure).
MAX_BLOCK = 65536
# Devices Triton compiles for (ROCm tensors are "cuda" tensors; "xpu" needs Intel's Triton).
GPU_DEVICE_TYPES = ("cuda", "xpu")


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter. Triton reads the variable when a
    kernel is decorated, so it must be set before this package is imported."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def device_problem(*tensors: torch.Tensor) -> str | None:
    """Why Triton cannot run on these tensors' device, or None."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        return f"tensors on different devices: {sorted(map(str, devices))}"
    device = tensors[0].device
    if device.type == "cpu":
        return None if interpreting() else \
            "CPU tensors run only under Triton's interpreter (TRITON_INTERPRET=1)"
    if device.type not in GPU_DEVICE_TYPES:
        return f"Triton has no backend for {device.type} tensors"
    return None


def dtype_problem(**tensors: torch.Tensor) -> str | None:
    for name, tensor in tensors.items():
        if tensor.dtype not in SUPPORTED_DTYPES:
            return (f"{name} is {tensor.dtype}; the kernel takes "
                    f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    return None


def row_block(n_cols: int) -> int:
    """The block that holds one row: the next power of two (masks cover the rest)."""
    return int(triton.next_power_of_2(n_cols))


def block_problem(n_cols: int) -> str | None:
    if n_cols < 1:
        return "the last dimension is empty"
    if row_block(n_cols) > MAX_BLOCK:
        return (f"hidden size {n_cols} needs a block of {row_block(n_cols)} elements; "
                f"one program holds at most {MAX_BLOCK}")
    return None


def num_warps(block: int) -> int:
    """More warps for wider rows so each thread holds a handful of elements."""
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a (rows, last dim) view with unit column stride, copying only when no such view
    exists."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()


@contextlib.contextmanager
def on_device(tensor: torch.Tensor) -> Iterator[None]:
    """Triton launches on the current device; make that the tensor's (cuda:1 is not cuda:0)."""
    if tensor.device.type == "cuda":
        with torch.cuda.device(tensor.device):
            yield
    elif tensor.device.type == "xpu":
        with torch.xpu.device(tensor.device):
            yield
    else:
        yield


# (Triton dtype, value of the kernel's constexpr flag) per ahead-of-time compile: both flag
# values in bfloat16 (the dtype compilers trip on), the main one in float32. float16 takes
# bfloat16's code path; leaving it out keeps the check to seconds.
AOT_VARIANTS = (("bf16", True), ("bf16", False), ("fp32", True))
AOT_DTYPES = ("bf16", "fp32")


@dataclass(frozen=True)
class AotSpec:
    """One ahead-of-time compile of a jit kernel: `signature` maps every argument to its
    Triton type ("*fp32", "i32", "fp32", or "constexpr"), `constexprs` gives those values."""

    kernel: Any
    signature: Mapping[str, str]
    constexprs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        specialised = ", ".join(f"{k}={v}" for k, v in self.constexprs.items())
        pointers = sorted({t for t in self.signature.values() if t.startswith("*")})
        return f"{self.kernel.__name__}[{'/'.join(pointers)}; {specialised}]"


def check(problem: str | None) -> None:
    """Raise for a call the kernel declines (callers that want the reference instead ask the
    op's problem function first)."""
    if problem is not None:
        raise KernelError(f"the Triton kernel cannot take this call: {problem}")
