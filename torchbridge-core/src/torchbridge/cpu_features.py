"""The host CPU's feature flags and /proc/cpuinfo fields, for the CPU plugin's probe
(builtin/cpu/host.py) and for the benchmarks, which name the machine whatever the backend."""

from __future__ import annotations

import functools

import torch


def canonical_flag(flag: str) -> str:
    """One name per feature: /proc/cpuinfo writes "avx512f", "avx512bw", torch's
    get_capabilities "avx512_f", "avx512_bw"; both become the latter."""
    flag = flag.lower()
    if flag.startswith("avx512") and not flag.startswith("avx512_"):
        return "avx512_" + flag[len("avx512"):]
    return flag


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (lower case, torch's names), from torch when it can tell, else
    /proc/cpuinfo."""
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)  # not in every torch
    if get_capabilities is not None:
        return frozenset(canonical_flag(k) for k, v in get_capabilities().items() if v is True)
    flags = cpuinfo_field("flags")
    return frozenset(canonical_flag(flag) for flag in (flags or "").split())


def cpuinfo_field(key: str) -> str | None:
    """The value of the first /proc/cpuinfo line starting with `key`; None without one."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
