"""The PyDotCompute kernel API for real on this CPU: a Triton kernel compiled and launched
under Triton's interpreter, and errors that name the kernel (numba: test_numba_kernel.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchbridge
import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, x + y, mask=mask)


@triton.jit
def broken_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets) + no_such_name)  # noqa: F821


def test_triton_kernel_compiles_and_launches(device: str) -> None:
    backend = torchbridge.get_backend(device)
    kernel = backend.compile_kernel(add_kernel)
    assert (kernel.name, kernel.kind) == ("add_kernel", "triton")
    n = 1000
    x = backend.to_device(np.arange(n, dtype=np.float32))
    y = backend.to_device(np.ones(n, dtype=np.float32))
    out = backend.allocate((n,), torch.float32)
    backend.launch_kernel(kernel, (triton.cdiv(n, 256),), {"BLOCK": 256}, x, y, out, n)
    backend.synchronize()
    assert np.array_equal(backend.to_host(out), np.arange(n, dtype=np.float32) + 1)


def test_a_failing_kernel_is_a_kernel_error_naming_it(device: str) -> None:
    backend = torchbridge.get_backend(device)
    x = backend.allocate((16,), torch.float32)
    with pytest.raises(torchbridge.KernelError, match="broken_kernel"):
        backend.launch_kernel(backend.compile_kernel(broken_kernel), (1,), {"BLOCK": 16}, x, 16)
    with pytest.raises(torchbridge.KernelLaunchError, match="block must be a dict"):
        backend.launch_kernel(backend.compile_kernel(add_kernel), (1,), 256, x, x, x, 16)
