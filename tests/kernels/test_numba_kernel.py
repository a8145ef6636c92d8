"""A numba.cuda kernel through the PyDotCompute API: on numba's CUDA simulator here
(NUMBA_ENABLE_CUDASIM=1, set by `nox -s tests_kernels` before numba is imported), on the
GPU where there is one."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torchbridge

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1" and not torch.cuda.is_available():
    pytest.skip("numba.cuda needs a GPU or NUMBA_ENABLE_CUDASIM=1 (nox -s tests_kernels)",
                allow_module_level=True)
cuda = pytest.importorskip("numba.cuda")


def scale(x, out, factor):  # a plain function: compile_kernel makes it a cuda kernel
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i] = x[i] * factor


def test_numba_kernel_compiles_and_launches(device: str) -> None:
    backend = torchbridge.get_backend(device)
    kernel = backend.compile_kernel(scale)
    assert (kernel.name, kernel.kind) == ("scale", "numba")
    x = backend.to_device(np.arange(100, dtype=np.float32))
    out = backend.allocate((100,), torch.float32)
    backend.launch_kernel(kernel, 4, 32, x, out, 3.0)
    backend.synchronize()
    assert np.array_equal(backend.to_host(out), np.arange(100, dtype=np.float32) * 3)
