"""glibc's malloc and the page faults of a model's large per-call buffers.

torch's CPU allocator is malloc. glibc serves a request above its mmap threshold (128 KiB
at first, raised to the largest such buffer freed, at most 32 MiB) with a fresh mmap, and
gives the top of its heap back to the OS when more than its trim threshold (twice the mmap
threshold) lies free there. A model whose call allocates and frees tens of MiB (logits,
an int8 matmul's int32 result) then gets fresh pages every call, and the kernel zeroes
each on its first touch. Measured on a 2-core AMD EPYC (family 26, model 2), torch 2.13:
a Llama of torchbridge.hf_models at O3 with quantize="int8" (logits 512 x 8192 float32
and the lm_head's int32 result, 16 MiB each) took 8160 page faults and 14.7 ms per call
when called repeatedly, 0 faults and 6.1 ms once malloc kept its freed memory; a mix of
other models' calls between its calls hid it or not, from one process to the next
(5.8 to 9.2 ms in the HF suite).

The heap_reuse pass counts the fresh pages a call of the prepared model on the sample input
takes and, where they are many, sets glibc's thresholds so that freed buffers are reused:
process-wide, for every allocation, as the report says.
`Backend.empty_cache()` gives the kept memory back to the OS (malloc_trim).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from torchbridge.optimize.passes import PassContext, PassSkipped
from torchbridge.optimize.settings import ProcessSetting

logger = logging.getLogger(__name__)

_MIB = 1 << 20
PAGE = mmap.PAGESIZE
# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
# The largest mmap threshold glibc takes on a 64-bit system (HEAP_MAX_SIZE / 2).
MMAP_THRESHOLD_MAX = 32 * _MIB
# A call that takes fewer fresh pages than this is not worth keeping memory for: a page
# fault with its zeroing costs about a microsecond (8160 faults, 8.6 ms above), so 4 MiB
# (1024 pages) is about a millisecond at worst.
MIN_FRESH_BYTES = 4 * _MIB
# The trim threshold keeps at least this much, and twice what one call takes: freed
# memory beyond it goes back to the OS as before.
MIN_TRIM_BYTES = 64 * _MIB
CALLS_WARMUP, CALLS_COUNTED = 2, 3

# What this process's malloc was set to through this module (glibc has no call to read a
# threshold back): parameter name -> value.
_set: dict[str, int] = {}
_DEFAULT = "glibc's default"


def _address(fn: Any) -> int | None:
    return ctypes.cast(fn, ctypes.c_void_p).value


def glibc() -> Any:
    """glibc as a ctypes library when it is this process's malloc; None elsewhere (not
    Linux, musl, or a malloc preloaded in its place: jemalloc, tcmalloc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        process = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc's own symbol: not musl)
        if _address(process.malloc) != _address(libc.malloc):
            return None
    except (OSError, AttributeError):
        return None
    return libc


def minor_faults() -> int:
    """Page faults this process took that needed no disk (fresh or reclaimed pages)."""
    import resource  # Unix only; reached only where glibc() found glibc

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _setting(name: str) -> ProcessSetting:
    def stays(value: Any) -> None:
        # Asked to put it back (prepare_model undoing its passes, or
        # restore_process_settings): glibc cannot return to its dynamic default, and its
        # starting values (128 KiB, fixed) would make every larger buffer a fresh mmap. It
        # stays as set, which the pass's note in the report says.
        if value != _set.get(name, _DEFAULT):
            logger.info("glibc malloc %s stays %s: glibc has no call that puts its "
                        "dynamic default back", name, _set.get(name))

    return ProcessSetting(
        f"glibc malloc {name}", lambda: _set.get(name, _DEFAULT), stays, scope="process",
        why_process="glibc's malloc applies it to every allocation of the process; it has no "
        "call that puts its dynamic default back, so it stays set")


MMAP_THRESHOLD = _setting("M_MMAP_THRESHOLD")
TRIM_THRESHOLD = _setting("M_TRIM_THRESHOLD")
MMAP_MAX = _setting("M_MMAP_MAX")
SETTINGS = (MMAP_THRESHOLD, TRIM_THRESHOLD, MMAP_MAX)


def _mallopt(libc: Any, name: str, param: int, value: int) -> None:
    if not libc.mallopt(param, value):
        raise PassSkipped(f"glibc's mallopt refused {name} = {value}")
    _set[name] = value


def faults_per_call(model: nn.Module, call: Callable[[nn.Module], Any],
                    count: Callable[[], int], *, warmup: int = CALLS_WARMUP,
                    calls: int = CALLS_COUNTED, before: Callable[[], None] | None = None
                    ) -> int:
    """Page faults per call of `model` on the sample input, after `warmup` calls and
    `before()` (the model and the RNG are left as they were)."""
    from torchbridge.optimize.measure import preserved_state

    with preserved_state(model):
        model.eval()
        for _ in range(warmup):
            call(model)
        if before is not None:
            before()
        start = count()
        for _ in range(calls):
            call(model)
        return (count() - start) // calls


def reuse_heap(model: nn.Module, ctx: PassContext, *, libc: Any = None,
               count: Callable[[], int] | None = None) -> nn.Module:
    """The heap_reuse pass: glibc's thresholds set so that the model's per-call buffers are
    reused, when a call on the sample input takes many fresh pages. `libc` and `count` are
    seams for tests (glibc's mallopt and malloc_trim, the fault counter).

    Whether repeated calls fault depends on the heap's history (what earlier allocations
    left at its top), which prepare_model cannot foresee: the same model faulted 8160
    times a call after an eager model's call, 0 times without. So what is measured is
    the worst case, a call's pages with nothing free to reuse (after malloc_trim), and,
    once set, the faults of repeated calls, which must then be few."""
    from torchbridge.optimize.measure import sample_call

    libc = libc if libc is not None else glibc()
    count = count or minor_faults
    if libc is None:
        raise PassSkipped("this process's malloc is not glibc's")
    call = sample_call(ctx.backend, ctx.sample_input)
    fresh = faults_per_call(model, call, count, calls=1, before=lambda: libc.malloc_trim(0))
    if fresh * PAGE < MIN_FRESH_BYTES:
        raise PassSkipped(f"a call on the sample input takes {fresh * PAGE / _MIB:.1f} MiB "
                          "of fresh pages: too little to keep")
    was = faults_per_call(model, call, count)
    trim = max(MIN_TRIM_BYTES, 2 * fresh * PAGE)
    _mallopt(libc, "M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, trim)
    _mallopt(libc, "M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
    now = faults_per_call(model, call, count)
    how = f"buffers up to {MMAP_THRESHOLD_MAX // _MIB} MiB from its heap, keeping up to " \
          f"{trim // _MIB} MiB free"
    if now * PAGE >= MIN_FRESH_BYTES:  # buffers over the largest mmap threshold
        _mallopt(libc, "M_MMAP_MAX", M_MMAP_MAX, 0)
        now = faults_per_call(model, call, count)
        how = f"every buffer from its heap (no mmap), keeping up to {trim // _MIB} MiB free"
    ctx.notes.append(
        f"heap_reuse: a call on the sample input takes {fresh * PAGE / _MIB:.1f} MiB of "
        f"fresh pages ({fresh} page faults) when the heap has none free; glibc's malloc now "
        f"serves {how}, for the whole process; page faults per repeated call {was} -> "
        f"{now} (it stays set, also if prepare_model undoes this pass; "
        "backend.empty_cache() gives the kept memory back)")
    logger.info("heap_reuse: %d fresh pages a call; page faults per call %d -> %d", fresh,
                was, now)
    return model


def trim() -> bool:
    """Give the memory glibc's heap keeps free back to the OS (malloc_trim); False where
    the process's malloc is not glibc's."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
