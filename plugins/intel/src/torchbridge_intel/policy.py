"""The precision policy of an Intel GPU, from the capabilities torch reports, not its name.

- bf16 where the device converts bf16 in hardware and has XMX (DPAS) to multiply it;
- fp16 where has_fp16 (the EUs run it at twice the fp32 rate, XMX or not);
- TF32 where torch says it is supported (torch.xpu.is_tf32_supported) and the XMX
  multiplies TF32. torch answers True wherever the device has DPAS (torch/xpu/__init__.py
  reads has_subgroup_matrix_multiply_accumulate), an Arc A-series (Alchemist) included,
  whose XMX has no TF32 (SYCL's joint_matrix combinations for dg2_g10/g11/g12 list none);
  the device's own flag has_subgroup_matrix_multiply_accumulate_tensor_float32 decides,
  and where a torch does not report it, the family's entry (families.TF32_XMX);
- float64 only where has_fp64: without it every fp64 kernel fails with SYCL's
  "Required aspect fp64 is not supported on the device" (intel/torch-xpu-ops#1742, an Arc
  A770), so prepare_model refuses a float64 model first.

A capability torch does not report (None) is not assumed: no bf16 or fp16 without the
flags, and float64 is refused only when has_fp64 is reported False.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchbridge_intel.probe import XPUProperties

FP64_RUNTIME_ERROR = "Required aspect fp64 is not supported on the device"


@dataclass(frozen=True)
class PrecisionPolicy:
    bf16: bool          # preferred low precision: bf16 conversions and XMX
    bf16_conversions: bool
    xmx: bool
    fp16: bool
    fp64: bool | None   # None: torch does not say
    tf32: bool

    @property
    def supported_dtypes(self) -> list[str]:
        dtypes = ["float32"]
        if self.fp64:
            dtypes.append("float64")
        if self.fp16:
            dtypes.append("float16")
        if self.bf16_conversions:
            dtypes.append("bfloat16")
        return dtypes

    @property
    def preferred_low_precision_dtype(self) -> str | None:
        """bf16 where XMX computes it (float32's range: no loss scaling), else fp16."""
        if self.bf16:
            return "bfloat16"
        return "float16" if self.fp16 else None


def tf32_xmx(props: XPUProperties, family_tf32: bool | None = None) -> bool:
    """Whether the XMX multiplies TF32: the device's flag where torch reports it, else the
    family's table entry; unknown to both, not ruled out (torch's verdict stands)."""
    flag = props.has_subgroup_matrix_multiply_accumulate_tensor_float32
    if flag is not None:
        return flag
    return family_tf32 is not False


def precision_policy(props: XPUProperties, tf32: bool | None,
                     family_tf32: bool | None = None) -> PrecisionPolicy:
    """`tf32`: torch's verdict (probe.tf32_supported); `family_tf32`: families.TF32_XMX for
    the identified family, None when unknown."""
    conversions = props.has_bfloat16_conversions is True
    xmx = props.has_subgroup_matrix_multiply_accumulate is True
    return PrecisionPolicy(bf16=conversions and xmx, bf16_conversions=conversions, xmx=xmx,
                           fp16=props.has_fp16 is True, fp64=props.has_fp64,
                           tf32=tf32 is True and tf32_xmx(props, family_tf32))


def fp64_refusal(device_name: str) -> str:
    """Why a float64 model cannot run on a device without fp64, and what to do."""
    return (f"{device_name} has no float64 support (has_fp64 is False): every float64 kernel "
            f"would fail with '{FP64_RUNTIME_ERROR}'. Convert the model and its inputs with "
            ".float() (or .to(torch.float32)) first")
