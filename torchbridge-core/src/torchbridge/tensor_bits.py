"""Whether two tensors hold the same bits: what "unchanged" means wherever the core asks
whether something wrote into a tensor (the pass runner's snapshots, the kernels' check that
an implementation left its inputs alone).

Bitwise, through same-width integer views for floating tensors: NaN equals itself (torch's
== does not), -0.0 differs from 0.0 (torch's == does not see it). Wrapper subclasses
(torchao's quantized weights) are compared by their inner tensors.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.device.type == "meta":
        return True  # no values to compare
    if is_traceable_wrapper_subclass(a) or is_traceable_wrapper_subclass(b):
        return _same_subclass_bits(a, b)
    same = _same_bytes(a, b)
    if same is not None:
        return same
    try:
        view = _INT_VIEW.get(a.element_size()) if a.is_floating_point() else None
        if view is not None:
            return torch.equal(a.view(view), b.view(view))
        return torch.equal(a, b)
    except Exception:  # a layout torch cannot compare (sparse, quantized): by identity
        return a is b


def _same_subclass_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Wrapper subclasses (torchao's quantized weights): the same class, metadata and inner
    tensors bit for bit; torch.equal has no kernel for most of them, and comparing by
    identity would take every quantized weight for a changed one."""
    if type(a) is not type(b):
        return False
    names_a, meta_a = a.__tensor_flatten__()  # type: ignore[attr-defined]
    names_b, meta_b = b.__tensor_flatten__()  # type: ignore[attr-defined]
    try:
        same_meta = bool(meta_a == meta_b)
    except Exception:
        same_meta = meta_a is meta_b
    return same_meta and list(names_a) == list(names_b) and all(
        same_bits(getattr(a, n), getattr(b, n)) for n in names_a)


# The pass runner compares every weight of the model after each pass (optimize/snapshot.py):
# for a model of 64 MiB of weights, torch.equal took 21 ms a comparison where the C
# library's memcmp took 7.7 ms (2-core Intel Xeon, ad hoc), and a prepare_model at O3 makes
# about ten of them.
def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """Whether two plain dense CPU tensors of the same shape and dtype, both contiguous,
    hold the same bytes (memcmp); None when that does not apply (another device or
    layout, strides, a quantized, conjugate or negative view, a tensor without storage
    such as a fake one) or memcmp is not at hand."""
    memcmp = _memcmp()
    if memcmp is None or a.device.type != "cpu":
        return None
    try:
        if not all(t.layout == torch.strided and t.is_contiguous() and not t.is_quantized
                   and not t.is_conj() and not t.is_neg() for t in (a, b)):
            return None
        size = a.numel() * a.element_size()
        if size == 0:
            return True
        pa, pb = a.data_ptr(), b.data_ptr()
    except Exception:  # no storage to point at (a fake tensor, a functional wrapper)
        return None
    if not pa or not pb:
        return None
    return pa == pb or memcmp(pa, pb, size) == 0


@functools.cache
def _memcmp() -> Callable[[int, int, int], int] | None:
    """The C library's memcmp (it releases the GIL while it runs); None where ctypes
    cannot find it."""
    try:
        library = ctypes.cdll.msvcrt if sys.platform == "win32" else ctypes.CDLL(None)
        memcmp = library.memcmp
    except (OSError, AttributeError, TypeError):
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    result: Callable[[int, int, int], int] = memcmp
    return result
