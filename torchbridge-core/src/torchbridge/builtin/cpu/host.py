"""The CPU plugin's probe seam: what the host CPU is, its feature flags and its memory."""

from __future__ import annotations

import functools
import os
import platform

from torchbridge.cpu_features import cpu_flags, cpuinfo_field

__all__ = ["cpu_flags", "has_native_bf16", "matrix_features", "bf16_unit", "cpu_name",
           "cpu_vendor", "host_memory"]


def has_native_bf16() -> bool:
    """bf16 arithmetic in hardware (AVX512-BF16 or AMX-BF16). Without it bf16 is emulated
    and slower than float32, so autocast to bf16 would be a pessimization."""
    return bf16_unit() is not None


def matrix_features() -> dict[str, list[str]]:
    """The matrix and vector extensions the policy cares about, by family: "amx" (Intel
    Advanced Matrix Extensions: bf16, int8, fp16 tiles; usable only with amx_tile) and
    "avx512" (its subsets: f, bw, vnni, bf16, fp16, ...)."""
    flags = cpu_flags()
    amx = sorted(f.removeprefix("amx_") for f in flags
                 if f.startswith("amx_") and f != "amx_tile") if "amx_tile" in flags else []
    avx512 = sorted(f.removeprefix("avx512_") for f in flags if f.startswith("avx512_"))
    return {"amx": amx, "avx512": avx512}


def bf16_unit() -> str | None:
    """What computes bf16 matmuls natively: "amx_bf16" (tiles), "avx512_bf16" (vector dot
    products), or None (emulated)."""
    flags = cpu_flags()
    if {"amx_tile", "amx_bf16"} <= flags:
        return "amx_bf16"
    return "avx512_bf16" if "avx512_bf16" in flags else None


_VENDORS = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD", "HygonGenuine": "Hygon"}


@functools.lru_cache(maxsize=8)
def _cpuinfo_field(key: str) -> str | None:
    return cpuinfo_field(key)


def cpu_name() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "CPU"


def cpu_vendor() -> str | None:
    vendor_id = _cpuinfo_field("vendor_id")
    if vendor_id is not None:
        return _VENDORS.get(vendor_id, vendor_id)
    return _cpuinfo_field("CPU implementer")  # ARM: implementer code


def host_memory() -> tuple[int | None, int | None]:
    """(available, total) host memory in bytes; None where the OS will not say."""
    try:
        values = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, rest = line.split(":", 1)
                values[key] = int(rest.split()[0]) * 1024
        return values.get("MemAvailable"), values.get("MemTotal")
    except (OSError, ValueError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        return None, None


