"""Where each quantization mode runs, and the accuracy gate a quantized model must keep.

No torchao here: the support table reads the device's description, and the gate compares
outputs with torch alone (so both are tested without torchao installed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchbridge import trees
from torchbridge.optimize.measure import largest_finite, largest_magnitude

if TYPE_CHECKING:
    from torchbridge.types import DeviceInfo

# AMD architectures torchao 0.18 runs float8 on: float8/inference.py asserts is_MI300()
# (gfx940-942) or is_MI350() (gfx950) for per-tensor and per-row scaling.
_AMD_FLOAT8 = ("gfx940", "gfx941", "gfx942", "gfx950")


def _capability(info: DeviceInfo) -> tuple[int, int] | None:
    try:
        major, minor = str(info.compute_capability).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _cpu(mode: str, info: DeviceInfo) -> str | None:
    if mode in ("int4_weight_only", "float8"):
        # Checked by running torchao 0.18 on this CPU: every Int4WeightOnlyConfig packing
        # format refuses the CPU (plain needs the CUDA-only mslk package, tile_packed_to_4d
        # CUDA, plain_int32 XPU or NPU), and float8 asserts "CUDA compute capability
        # >= 8.9 or MI300+ or XPU". No CPU has float8 matrix units either.
        return f"torchao 0.18 has no CPU kernel for {mode} (it runs on GPUs only)"
    if mode == "int8" and info.extra.get("native_int8") is not True:
        # int8 x int8 matmuls (oneDNN's u8s8 GEMM) use VNNI's vpdpbusd (AVX512-VNNI,
        # AVX-VNNI) or AMX-INT8 tiles; without them they are emulated with 16-bit
        # multiplies, slower than float32, and torchao advises reduce_range for accuracy.
        # int8_weight_only needs neither: its weights are widened to the activations'
        # dtype inside the matmul (torch._weight_int8pack_mm), which any CPU runs.
        return f"{info.name} has no int8 dot-product instructions (VNNI: avx512_vnni or " \
               "avx_vnni, or AMX-INT8): int8 matmuls would be emulated"
    return None


def _nvidia(mode: str, info: DeviceInfo) -> str | None:
    cc = _capability(info)
    if cc is None:
        return f"compute capability {info.compute_capability!r} is unknown"
    # int8: torch._int_mm (cuBLASLt int8 tensor cores); int4: torch's tinygemm kernel
    # (_weight_int4pack_mm, bf16 activations): both sm_80 (Ampere) and newer. float8:
    # torch._scaled_mm needs the FP8 tensor cores of sm_89 (Ada) and sm_90+.
    need = (8, 9) if mode == "float8" else (8, 0)
    if cc < need:
        return f"{mode} needs compute capability {need[0]}.{need[1]} or newer; " \
               f"{info.name} is {cc[0]}.{cc[1]}"
    return None


def _amd(mode: str, info: DeviceInfo) -> str | None:
    arch = str(info.extra.get("gcn_arch_name") or info.compute_capability or "")
    if mode == "float8" and not arch.startswith(_AMD_FLOAT8):
        return f"torchao 0.18 runs float8 on MI300 (gfx940-942) and MI350 (gfx950) only; " \
               f"{info.name} is {arch or 'an unknown architecture'}"
    # int8 goes through torch._int_mm (hipBLASLt on ROCm); int4 through tinygemm's ROCm
    # port, which torchao packs with int4_tile_packed_ntile=16 (its docstring: "16 for
    # ROCm platform").
    return None


def _intel(mode: str, info: DeviceInfo) -> str | None:
    # torchao 0.18 has XPU paths for all four: int8 through torch._int_mm (oneDNN),
    # int4 through its plain_int32 packing (_weight_int4pack_mm_with_scales_and_zeros),
    # float8 through torch._scaled_mm (its float8 check accepts any XPU; fast
    # accumulation off). Without XMX matrix engines none of them is accelerated.
    if info.extra.get("xmx") is False:
        return f"{info.name} has no XMX matrix engines: {mode} matmuls would be emulated"
    return None


def _not_listed(mode: str, info: DeviceInfo) -> str | None:
    """Why the GPU's own description rules `mode` out: the NVIDIA and AMD plugins list the
    float8 and bfloat16 dtypes of the architectures in their tables, and nothing for one
    they do not know. The plugin's fp8_linear pass and autocast read the same list, so
    that one report does not call FP8 absent and supported at once."""
    dtypes = set(info.supported_dtypes)
    if mode == "float8" and not any(d.startswith("float8") for d in dtypes):
        return f"{info.name} ({info.architecture}) lists no float8 dtype in its device " \
               f"description ({', '.join(info.supported_dtypes) or 'none'})"
    if mode == "int4_weight_only" and "bfloat16" not in dtypes:
        # torch's int4 kernel (_weight_int4pack_mm) takes bfloat16 activations.
        return f"int4_weight_only computes with bfloat16 activations, which " \
               f"{info.name} ({info.architecture}) does not list in its device description"
    return None


def unsupported(mode: str, info: DeviceInfo, device_type: str) -> str | None:
    """Why `mode` does not run on this device (None: it does), from its description."""
    if device_type == "cpu":
        return _cpu(mode, info)
    if device_type == "cuda" and info.vendor == "AMD":
        return _amd(mode, info) or _not_listed(mode, info)
    if device_type == "cuda":
        return _nvidia(mode, info) or _not_listed(mode, info)
    if device_type == "xpu":
        return _intel(mode, info)
    return f"torchao has no {mode} kernels for {device_type} devices"


# -- the accuracy gate ---------------------------------------------------------------------

def _floating(output: Any) -> list[torch.Tensor]:
    return [t.detach().float().cpu() for t in trees.tensors(output) if t.is_floating_point()]


# The gate checks the outputs after every pass that follows quantization and once more at
# the end: a pair of 4 x 128 x 16384 float32 tensors took 0.24 s a check with masks of
# finite values built every time, 0.09 s with them built only where a value is not finite
# (ad hoc, 2-core EPYC).
def _finite(t: torch.Tensor) -> bool:
    return math.isfinite(largest_magnitude(t))


def _cosine(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Cosine of two same-shape tensors, flattened, in float64. Positions where both hold
    the same non-finite value (NaN in both, the same infinity) are left out, as the drift
    check leaves them; a non-finite value in one only makes the cosine NaN (a failure)."""
    finite_both = _finite(ref) and _finite(out)
    a, b = ref.flatten().double(), out.flatten().double()
    if not finite_both:
        finite = torch.isfinite(a) & torch.isfinite(b)
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        if not bool((finite | same).all()):
            return math.nan
        a, b = a[finite], b[finite]
    norms = float(a.norm() * b.norm())
    if norms == 0.0:
        return 1.0 if bool(torch.equal(a, b)) else 0.0
    return max(-1.0, min(1.0, float(a @ b) / norms))


def accuracy(reference: Any, output: Any) -> tuple[float, float | None]:
    """(cosine similarity, argmax agreement) of `output` against `reference`: the lowest
    cosine of their floating tensors, pair by pair (so that a small output ruined beside
    a large one still counts; NaN when one holds a NaN or infinity the other does not);
    the agreement, the share of rows (over the last dimension, in every floating tensor
    whose last dimension is > 1) whose argmax is the same, None when no tensor has such
    rows. Raises ValueError when the outputs do not pair up."""
    ref, out = _floating(reference), _floating(output)
    if len(ref) != len(out) or any(r.shape != o.shape for r, o in zip(ref, out, strict=True)):
        raise ValueError("the quantized model's floating outputs do not match the "
                         "reference's in number or shape")
    if not ref:
        raise ValueError("the model returns no floating tensor to compare")
    # An output of zeros (a zero-initialised head, a loss of 0) has no direction to
    # compare: quantization noise alone would give it cosine 0, or -1 for a scalar. It
    # counts as kept when the quantized one stays next to nothing beside the other
    # outputs. Only zeros (or subnormals): an output small beside another is still an
    # output of its own (a regression value at 1e-3 beside logits at 1e4), and was once
    # left out that way while int8 ruined it (cosine 0.47).
    scale = max((largest_finite(t) for t in ref if t.numel()), default=0.0)

    def negligible(r: torch.Tensor, o: torch.Tensor) -> bool:
        return bool(r.numel() == 0 or (largest_magnitude(r) < torch.finfo(r.dtype).tiny
                                       and torch.isfinite(o).all()
                                       and largest_magnitude(o) <= 1e-3 * scale))

    cosines = [_cosine(r, o) for r, o in zip(ref, out, strict=True) if not negligible(r, o)]
    cosine = math.nan if any(math.isnan(c) for c in cosines) else min(cosines, default=1.0)
    rows = same = 0
    for r, o in zip(ref, out, strict=True):
        if r.dim() == 0 or r.shape[-1] <= 1:
            continue
        matches = r.argmax(dim=-1) == o.argmax(dim=-1)
        rows += matches.numel()
        same += int(matches.sum())
    return cosine, (same / rows if rows else None)


@dataclass
class QuantizationReport:
    """What the quantize pass did: the mode, how, and the gate's figures on the sample
    input (the last check of the run: the prepared model against O0)."""

    mode: str
    method: str  # e.g. "torchao Int8DynamicActivationInt8WeightConfig on 14 Linear layers"
    min_cosine: float
    min_argmax_agreement: float
    cosine: float | None = None
    argmax_agreement: float | None = None

    def figures(self) -> str:
        if self.cosine is None:
            return "not checked"
        agreement = "no argmax rows" if self.argmax_agreement is None else \
            f"argmax agreement {self.argmax_agreement:.1%} (>= " \
            f"{self.min_argmax_agreement:.0%})"
        return f"cosine {self.cosine:.4f} (>= {self.min_cosine:g}), {agreement}"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class AccuracyGate:
    """The quantize pass's output_check: the prepared model's output against O0's keeps
    config optimization.quantize_min_cosine and quantize_min_argmax_agreement, else the
    reason with the figures. Its pass binds the run's report before the first check."""

    def __init__(self) -> None:
        self.report: QuantizationReport | None = None

    def __call__(self, reference: Any, output: Any) -> str | None:
        report = self.report
        assert report is not None, "the quantize pass binds its report before any check"
        try:
            cosine, agreement = accuracy(reference, output)
        except ValueError as exc:
            return f"quantization {report.mode} rolled back: {exc}"
        report.cosine, report.argmax_agreement = cosine, agreement
        cosine_ok = math.isfinite(cosine) and cosine >= report.min_cosine
        agreement_ok = agreement is None or agreement >= report.min_argmax_agreement
        if cosine_ok and agreement_ok:
            return None
        # Both figures, failed or not; the cosine with enough digits to show the gap to a
        # threshold it rounds to (0.99996 is not "1.0000 < 1").
        figures = [f"cosine {cosine:.6g}" + ("" if cosine_ok else
                                             f" < {report.min_cosine:g}")]
        if agreement is not None:
            figures.append(f"argmax agreement {agreement:.1%}" + (
                "" if agreement_ok else f" < {report.min_argmax_agreement:.0%}"))
        return f"quantization {report.mode} rolled back: {', '.join(figures)}"
