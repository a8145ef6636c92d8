"""The Triton kernel tests run on CPU tensors under Triton's interpreter (the `tests_kernels`
nox session sets TRITON_INTERPRET=1 before anything imports triton), or compiled for real on
a CUDA machine without the interpreter, where they are marked `cuda` so `nox -s tests_gpu`
picks them. Anywhere else they skip. The ahead-of-time compile test needs triton only."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
NEEDS_TRITON_ONLY = {"test_aot_compile.py", "test_kernel_cache.py"}


def kernel_device() -> str | None:
    """Where the kernel tests run here, or None when they cannot."""
    if not HAS_TRITON:
        return None
    if INTERPRETING:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    device = kernel_device()
    here = os.path.dirname(__file__)
    for item in items:
        if not str(item.path).startswith(here) or item.path.name in NEEDS_TRITON_ONLY:
            continue
        if device is None:
            item.add_marker(pytest.mark.skip(
                reason="needs triton and TRITON_INTERPRET=1 set before triton is imported "
                       "(`nox -s tests_kernels`), or a CUDA GPU"))
        elif device == "cuda":
            item.add_marker(pytest.mark.cuda)


@pytest.fixture
def device() -> str:
    found = kernel_device()
    assert found is not None  # the collection hook skipped the test otherwise
    return found
