"""The CPU backend names the AMX and AVX-512 features it reads from the CPU's flags, and its
precision policy follows them: flag lines of real CPUs, as /proc/cpuinfo writes them."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import torch
import torchbridge
from torchbridge import cpu_features
from torchbridge.builtin.cpu import host

# The ISA part of /proc/cpuinfo's flags line (Linux cpufeature names) of each CPU.
CPUINFO = {
    # 4th gen Xeon (Sapphire Rapids): AMX tiles with bf16 and int8, AVX512-BF16/FP16.
    "Sapphire Rapids": "fma avx2 avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl "
                       "avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg "
                       "avx512_vpopcntdq amx_bf16 avx512_fp16 amx_tile amx_int8 avx_vnni",
    # 6th gen Xeon P-cores (Granite Rapids): adds AMX-FP16.
    "Granite Rapids": "fma avx2 avx512f avx512bw avx512vl avx512_bf16 avx512_vnni "
                      "avx512_fp16 amx_bf16 amx_tile amx_int8 amx_fp16 avx_vnni",
    # 3rd gen Xeon (Ice Lake): AVX-512 with VNNI, no bf16.
    "Ice Lake": "fma avx2 avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512vbmi "
                "avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq",
    # AMD Zen 4 (EPYC 9004): AVX512-BF16, no AMX.
    "Zen 4": "fma avx2 avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 "
             "avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq",
    # Alder Lake client: AVX-VNNI, no AVX-512.
    "Alder Lake": "fma avx2 avx_vnni",
    # AMD Zen 3: AVX2 only.
    "Zen 3": "fma avx2",
}
EXPECTED = {  # bf16 unit, amx, native int8
    "Sapphire Rapids": ("amx_bf16", ["bf16", "int8"], True),
    "Granite Rapids": ("amx_bf16", ["bf16", "fp16", "int8"], True),
    "Ice Lake": (None, [], True),
    "Zen 4": ("avx512_bf16", [], True),
    "Alder Lake": (None, [], True),
    "Zen 3": (None, [], False),
}


@pytest.fixture
def cpuinfo(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """/proc/cpuinfo with the flags line in `lines["flags"]`, read as on a torch without
    torch.cpu.get_capabilities."""
    lines = {"flags": ""}
    real_open = open

    def fake_open(path: str, *args: object, **kwargs: object) -> object:
        if path == "/proc/cpuinfo":
            return io.StringIO(f"model name\t: test CPU\nflags\t\t: {lines['flags']}\n")
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    monkeypatch.setattr(cpu_features, "open", fake_open, raising=False)
    host.cpu_flags.cache_clear()
    yield lines
    host.cpu_flags.cache_clear()


@pytest.mark.parametrize("cpu", list(CPUINFO))
def test_cpu_info_names_amx_and_avx512_and_the_policy_follows(
        cpuinfo: dict[str, str], cpu: str) -> None:
    cpuinfo["flags"] = CPUINFO[cpu]
    info = torchbridge.get_backend("cpu").get_device_info()
    unit, amx, int8 = EXPECTED[cpu]
    assert info.extra["bf16_unit"] == unit
    assert info.extra["amx"] == amx
    assert info.extra["native_int8"] is int8
    assert ("f" in info.extra["avx512"]) is ("avx512f" in CPUINFO[cpu])
    assert ("vnni" in info.extra["avx512"]) is ("avx512_vnni" in CPUINFO[cpu])
    assert info.extra["native_fp16"] is ("avx512_fp16" in CPUINFO[cpu])
    assert info.preferred_low_precision_dtype == ("bfloat16" if unit else None)
    assert (info.notes is None) is (unit is not None)


def test_cpuinfo_and_torch_spell_avx512_flags_the_same(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {
        "avx512_f": True, "avx512_bw": True, "avx512_bf16": False, "amx_tile": True,
        "amx_bf16": True, "num_sockets": 1}, raising=False)
    host.cpu_flags.cache_clear()
    try:
        assert host.cpu_flags() == {"avx512_f", "avx512_bw", "amx_tile", "amx_bf16"}
        assert host.matrix_features() == {"amx": ["bf16"], "avx512": ["bw", "f"]}
        assert host.bf16_unit() == "amx_bf16"
    finally:
        host.cpu_flags.cache_clear()
    assert cpu_features.canonical_flag("avx512vl") == "avx512_vl"
    assert cpu_features.canonical_flag("avx512_vbmi2") == "avx512_vbmi2"


def test_o2_autocast_only_with_native_bf16(cpuinfo: dict[str, str]) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16)).eval()
    config = torchbridge.TorchBridgeConfig(optimization={"disabled_passes": ["compile"]})
    for cpu, status in (("Zen 4", "applied"), ("Ice Lake", "skipped")):
        cpuinfo["flags"] = CPUINFO[cpu]
        host.cpu_flags.cache_clear()
        result = torchbridge.get_backend("cpu", config).optimize(model, "O2")
        assert {p.name: p.status for p in result.passes}["autocast"] == status
