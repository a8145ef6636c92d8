"""glibc's malloc and the page faults of a model's large per-call buffers.

torch's CPU allocator is malloc. glibc serves a request above its mmap threshold (128 KiB
at first, raised to the largest such buffer freed, below 32 MiB) with a fresh mmap, and
gives the top of its heap back to the OS when more than its trim threshold (twice the mmap
threshold) lies free there. A model whose call allocates and frees tens of MiB (logits,
an int8 matmul's int32 result) then gets fresh pages every call, and the kernel zeroes
each on its first touch. Measured on a 2-core AMD EPYC (family 26, model 2), torch 2.13
(benchmarks/heap_faults.py; docs/benchmarks.md, "Page faults"): a Llama of
torchbridge.hf_models at O3 with quantize="int8" (logits 512 x 8192 float32 and the
lm_head's int32 result, 16 MiB each) took 4096 page faults and 13.25 ms a call timed
round-robin with the HF suite's other variants, 10 faults and 6.15 ms once malloc kept its
freed memory (called repeatedly, 1019 faults and 6.21 ms against 0 and 5.96).

The heap_reuse pass counts the fresh pages a call of the prepared model on the sample input
takes and, where they are many, sets glibc's thresholds so that freed buffers are reused:
process-wide, for every allocation, as the report says.
`Backend.empty_cache()` gives the kept memory back to the OS (malloc_trim).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from torchbridge.optimize.passes import PassContext, PassSkipped
from torchbridge.optimize.settings import ProcessSetting

logger = logging.getLogger(__name__)

_MIB = 1 << 20
PAGE = mmap.PAGESIZE
# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
# The largest mmap threshold glibc takes (HEAP_MAX_SIZE / 2: 32 MiB on 64-bit systems),
# and its default M_MMAP_MAX; mallopt takes a C int.
MMAP_THRESHOLD_MAX = 4 * _MIB * ctypes.sizeof(ctypes.c_long)
MMAP_MAX_DEFAULT = 65536
_INT_MAX = 2**31 - 1
# A call that takes fewer fresh pages than this is not worth keeping memory for: a page
# fault with its zeroing costs about a microsecond (8160 faults, 8.6 ms above), so 4 MiB
# (1024 pages) is about a millisecond at worst.
MIN_FRESH_BYTES = 4 * _MIB
# The trim threshold keeps at least this much free at the top of the heap, and twice what
# one call takes; more than that goes back to the OS. (With mmap off, large buffers too
# come from the heap and go back only from its top.)
MIN_TRIM_BYTES = 64 * _MIB
# Each count: a call that lets the heap settle (grow to what a call takes, under the
# thresholds as they are now), then the calls counted. The pass counts three or four times,
# so these are most of its cost: it was 2 and 3 (14-19 calls of the model with the check
# after the pass), 1.6-1.9 s of a 13 s first call of a Llama whose call takes 64 ms; 1 and
# 2 take 9-12.
CALLS_WARMUP, CALLS_COUNTED = 1, 2
# Environment variables that tune glibc's malloc: a process started with one keeps its
# own settings.
_TUNING = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_",
           "MALLOC_TOP_PAD_")
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# What this process's malloc was set to through this module (glibc has no call to read a
# threshold back): parameter name -> value.
_set: dict[str, int] = {}
_DEFAULT = "glibc's default"


def _address(fn: Any) -> int | None:
    return ctypes.cast(fn, ctypes.c_void_p).value


@functools.cache
def glibc() -> Any:
    """glibc as a ctypes library when it is this process's malloc; None elsewhere (not
    Linux, musl, or a malloc preloaded in its place: jemalloc, tcmalloc). Looked up once:
    the pass's check, the pass and empty_cache ask, and a process keeps its malloc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        process = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc's own symbol: not musl)
        if _address(process.malloc) != _address(libc.malloc):
            return None
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def why_not() -> str | None:
    """Why the pass cannot count or set this process's malloc; None when it can."""
    if glibc() is None:
        return "this process's malloc is not glibc's"
    tuned = [name for name in _TUNING if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        tuned.append("GLIBC_TUNABLES")
    if tuned:
        return f"glibc's malloc is tuned by the environment ({', '.join(tuned)})"
    try:
        if "[always]" in _THP.read_text():
            return "transparent huge pages are 'always': a page fault may map 2 MiB, so " \
                   "faults do not count the pages a call takes"
    except OSError:
        pass
    return None


def minor_faults() -> int:
    """Page faults this process took that needed no disk (fresh or reclaimed pages)."""
    import resource  # Unix only; reached only where glibc() found glibc

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _setting(name: str, default: int | None) -> ProcessSetting:
    def put_back(value: Any) -> None:
        # Asked to put it back (prepare_model undoing its passes, or
        # restore_process_settings): M_MMAP_MAX has a fixed default; the thresholds'
        # default is dynamic, which glibc has no call to return to, and its starting
        # value (128 KiB, fixed) would make every larger buffer a fresh mmap. A threshold
        # stays as set (the pass's note says so, and restore_process_settings, reading it
        # back, reports it).
        if value != _DEFAULT or name not in _set:
            return
        if default is None:
            logger.info("glibc malloc %s stays %s: glibc has no call that puts its "
                        "dynamic default back", name, _set[name])
            return
        libc = glibc()
        if libc is not None and libc.mallopt(_PARAMS[name], default):
            del _set[name]

    why = "glibc's malloc applies it to every allocation of the process" + (
        "" if default is not None else "; it has no call that puts its dynamic default "
        "back, so it stays set")
    # kept_after_timing: O0, timed against the prepared model in the same process, ran
    # under these settings too (a model whose calls took 40 MiB, kept as O0, faulted 10241
    # pages a call once M_MMAP_MAX went back; timed, none).
    return ProcessSetting(f"glibc malloc {name}", lambda: _set.get(name, _DEFAULT), put_back,
                          scope="process", why_process=why, kept_after_timing=True)


_PARAMS = {"M_TRIM_THRESHOLD": M_TRIM_THRESHOLD, "M_MMAP_THRESHOLD": M_MMAP_THRESHOLD,
           "M_MMAP_MAX": M_MMAP_MAX}
MMAP_THRESHOLD = _setting("M_MMAP_THRESHOLD", None)
TRIM_THRESHOLD = _setting("M_TRIM_THRESHOLD", None)
MMAP_MAX = _setting("M_MMAP_MAX", MMAP_MAX_DEFAULT)
SETTINGS = (MMAP_THRESHOLD, TRIM_THRESHOLD, MMAP_MAX)


def faults_per_call(model: nn.Module, call: Callable[[nn.Module], Any],
                    count: Callable[[], int], *, warmup: int = CALLS_WARMUP,
                    calls: int = CALLS_COUNTED, before: Callable[[], None] | None = None
                    ) -> list[int]:
    """Page faults of each of `calls` calls of `model` on the sample input, counted alone,
    after `warmup` calls and `before()` (the model and the RNG are left as they were:
    run_sample)."""
    from torchbridge.optimize.run import run_sample

    def counted(m: nn.Module) -> list[int]:
        for _ in range(warmup):
            call(m)
        if before is not None:
            before()
        each = []
        for _ in range(calls):
            start = count()
            call(m)
            each.append(count() - start)
        return each

    faults: list[int] = run_sample(model, counted)
    return faults


def _span(faults: list[int]) -> str:
    """The faults of the calls counted: one figure where they agree, else the range."""
    low, high = min(faults), max(faults)
    return str(low) if low == high else f"{low}-{high}"


def _described() -> str:
    return ", ".join(f"{name} = {value}" for name, value in sorted(_set.items()))


def _mallopt(libc: Any, name: str, value: int, refused: list[str]) -> None:
    if libc.mallopt(_PARAMS[name], value):
        _set[name] = value
    else:
        refused.append(f"{name} = {value}")


def reuse_heap(model: nn.Module, ctx: PassContext, *, libc: Any = None,
               count: Callable[[], int] | None = None) -> nn.Module:
    """The heap_reuse pass: glibc's thresholds set so that the model's per-call buffers are
    reused, when a call on the sample input takes many fresh pages. `libc` and `count` are
    seams for tests (glibc's mallopt and malloc_trim, the fault counter).

    Whether repeated calls fault depends on the heap's history (what earlier allocations
    left at its top), which prepare_model cannot foresee: the same model faulted 8160
    times a call after an eager model's call, 0 times without. So what is measured is
    the worst case, a call's pages with nothing free to reuse (after malloc_trim), and,
    once set, the faults of repeated calls, which must then be few. Thresholds an earlier
    run set are only ever raised: that run's model keeps what it needs."""
    from torchbridge.optimize.measure import sample_call

    libc = libc if libc is not None else glibc()
    count = count or minor_faults
    if libc is None:
        raise PassSkipped("this process's malloc is not glibc's")
    call = sample_call(ctx.backend, ctx.sample_input)
    fresh = faults_per_call(model, call, count, calls=1,
                            before=lambda: libc.malloc_trim(0))[0]
    if fresh * PAGE < MIN_FRESH_BYTES:
        raise PassSkipped(f"a call on the sample input takes {fresh * PAGE / _MIB:.1f} MiB "
                          "of fresh pages: too little to keep")
    was = faults_per_call(model, call, count)
    trim = min(_INT_MAX, max(MIN_TRIM_BYTES, 2 * fresh * PAGE,
                             _set.get("M_TRIM_THRESHOLD", 0)))
    wanted = {"M_TRIM_THRESHOLD": trim, "M_MMAP_THRESHOLD": MMAP_THRESHOLD_MAX}
    refused: list[str] = []
    before_run = dict(_set)
    for name, value in wanted.items():
        if _set.get(name) != value:
            _mallopt(libc, name, value, refused)
    now = faults_per_call(model, call, count)
    # mmap off where every call counted still takes fresh pages, not where one does: once
    # the heap keeps its memory, a call can still take fresh pages once, where a small
    # allocation split a freed buffer's chunk, after which the calls reuse both (torch
    # 2.9.1, a call taking 40 MiB, mmap off: in 2 processes of 12, one of the two calls
    # counted took the 40 MiB afresh, every later call none).
    if min(now) * PAGE >= MIN_FRESH_BYTES and _set.get("M_MMAP_MAX") != 0:
        # Buffers of 32 MiB or more: glibc maps them whatever its threshold.
        _mallopt(libc, "M_MMAP_MAX", 0, refused)
        now = faults_per_call(model, call, count)
    if _set == before_run:
        refusal = f"glibc refused {', '.join(refused)}" if refused else ""
        raise PassSkipped(refusal if not before_run else
                          f"glibc's malloc is set already (by an earlier prepare_model in "
                          f"this process: {_described()}); page faults per repeated call "
                          f"{_span(now)}" + (f"; {refusal}" if refusal else ""))
    how = f"buffers under {MMAP_THRESHOLD_MAX // _MIB} MiB" if _set.get("M_MMAP_MAX") != 0 \
        else "every buffer (mmap off)"
    kept = _set.get("M_TRIM_THRESHOLD", trim)
    ctx.notes.append(
        f"heap_reuse: a call on the sample input takes {fresh * PAGE / _MIB:.1f} MiB of "
        f"fresh pages ({fresh} page faults) when the heap has none free; glibc's malloc "
        f"serves {how} from its heap, keeping up to {kept // _MIB} MiB free, for the "
        f"whole process; page faults per repeated call {_span(was)} -> {_span(now)}"
        + (f"; glibc refused {', '.join(refused)}" if refused else "")
        + " (the thresholds stay set, also if prepare_model undoes this pass; "
        "backend.empty_cache() gives the kept memory back)")
    logger.info("heap_reuse: %d fresh pages a call; page faults per call %s -> %s", fresh,
                _span(was), _span(now))
    return model


def trim() -> bool:
    """Give the memory glibc's heap keeps free back to the OS (malloc_trim); False where
    the process's malloc is not glibc's."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
