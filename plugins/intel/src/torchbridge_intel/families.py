"""Which Intel GPU family a device belongs to, from what torch reports about it.

Three sources, best first, each a published table rather than a guess:
1. `architecture` (torch built with SYCL >= 2025.0): the SYCL architecture id carries the
   GPU's IP version (GMD ID). Table: intel/llvm
   sycl/include/sycl/ext/oneapi/experimental/device_architecture.def, where an Intel GPU's id
   is 0x00 0000 <GMDID> 00 and the GMD ID packs major << 22 | minor << 14 | revision.
2. `device_id` (the PCI id): the Linux kernel's include/drm/intel/pciids.h lists them per
   platform.
3. The marketing name, for torch builds that report neither ("Data Center GPU Max",
   "Arc(TM) A770", "Arc(TM) B580", "Arc(TM) 140V").

A device none of them knows is UNKNOWN: described by its capabilities, never by the nearest
family. The precision policy reads capabilities (policy.py); the family fills in only what
a torch build does not report (TF32_XMX below).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from torchbridge_intel.probe import XPUProperties


class IntelFamily(str, enum.Enum):
    PONTE_VECCHIO = "ponte_vecchio"      # Data Center GPU Max, Xe-HPC
    ALCHEMIST = "alchemist"              # Arc A-series, Arc Pro A, Data Center GPU Flex; Xe-HPG
    BATTLEMAGE = "battlemage"            # Arc B-series discrete, Arc Pro B; Xe2-HPG
    METEOR_ARROW_LAKE = "meteor_arrow_lake"  # Core Ultra 1/2 (H/U/S) Arc graphics; Xe-LPG(+)
    LUNAR_LAKE = "lunar_lake"            # Core Ultra 200V Arc 130V/140V; Xe2-LPG
    PANTHER_LAKE = "panther_lake"        # Core Ultra 3 Arc graphics; Xe3
    XE_LP = "xe_lp"                      # Tiger/Rocket/Alder/Raptor Lake Iris Xe and UHD, DG1
    UNKNOWN = "unknown"


DESCRIPTION = {
    IntelFamily.PONTE_VECCHIO: "Data Center GPU Max (Ponte Vecchio, Xe-HPC)",
    IntelFamily.ALCHEMIST: "Arc A-series / Data Center GPU Flex (Alchemist, Xe-HPG)",
    IntelFamily.BATTLEMAGE: "Arc B-series (Battlemage, Xe2-HPG)",
    IntelFamily.METEOR_ARROW_LAKE: "Meteor Lake / Arrow Lake Arc graphics (Xe-LPG)",
    IntelFamily.LUNAR_LAKE: "Lunar Lake Arc graphics (Xe2-LPG)",
    IntelFamily.PANTHER_LAKE: "Panther Lake Arc graphics (Xe3)",
    IntelFamily.XE_LP: "Iris Xe / UHD graphics and DG1 (Xe-LP)",
    IntelFamily.UNKNOWN: "an Intel GPU this plugin's tables do not know",
}

# (major, minor) of the IP version -> family. Source of every entry: intel/llvm
# sycl/include/sycl/ext/oneapi/experimental/device_architecture.def, whose aliases are
# intel_gpu_<major>_<minor>_<revision>; the platform names are its comments.
_BY_IP = {
    (12, 0): IntelFamily.XE_LP,    # intel_gpu_tgllp (Tiger Lake)
    (12, 1): IntelFamily.XE_LP,    # intel_gpu_rkl (Rocket Lake)
    (12, 2): IntelFamily.XE_LP,    # intel_gpu_adl_s / rpl_s (Alder Lake S, Raptor Lake)
    (12, 3): IntelFamily.XE_LP,    # intel_gpu_adl_p (Alder Lake P)
    (12, 4): IntelFamily.XE_LP,    # intel_gpu_adl_n (Alder Lake N)
    (12, 10): IntelFamily.XE_LP,   # intel_gpu_dg1
    (12, 55): IntelFamily.ALCHEMIST,  # intel_gpu_acm_g10 / dg2_g10 (Alchemist G10)
    (12, 56): IntelFamily.ALCHEMIST,  # intel_gpu_acm_g11 / dg2_g11 (Alchemist G11)
    (12, 57): IntelFamily.ALCHEMIST,  # intel_gpu_acm_g12 / dg2_g12 (Alchemist G12)
    (12, 60): IntelFamily.PONTE_VECCHIO,  # intel_gpu_pvc (Ponte Vecchio)
    (12, 61): IntelFamily.PONTE_VECCHIO,  # intel_gpu_pvc_vg (Ponte Vecchio VG)
    (12, 70): IntelFamily.METEOR_ARROW_LAKE,  # intel_gpu_mtl_u / mtl_s / arl_u / arl_s
    (12, 71): IntelFamily.METEOR_ARROW_LAKE,  # intel_gpu_mtl_h (Meteor Lake H)
    (12, 74): IntelFamily.METEOR_ARROW_LAKE,  # intel_gpu_arl_h (Arrow Lake H)
    (20, 1): IntelFamily.BATTLEMAGE,  # intel_gpu_bmg_g21 (Battlemage G21)
    (20, 2): IntelFamily.BATTLEMAGE,  # intel_gpu_bmg_g31 (Battlemage G31)
    (20, 4): IntelFamily.LUNAR_LAKE,  # intel_gpu_lnl_m (Lunar Lake)
    (30, 0): IntelFamily.PANTHER_LAKE,  # intel_gpu_ptl_h (Panther Lake H)
    (30, 1): IntelFamily.PANTHER_LAKE,  # intel_gpu_ptl_u (Panther Lake U)
}

# Whether the family's XMX (DPAS) multiplies TF32, for torch builds that do not report
# has_subgroup_matrix_multiply_accumulate_tensor_float32. Source: the joint_matrix
# combinations SYCL reports per architecture (intel/llvm sycl/source/detail/device_info.hpp,
# documented in sycl_ext_oneapi_matrix.asciidoc, "Intel XMX Supported Combinations"): the
# tf32 combination is in the list of pvc, bmg_g21/g31, lnl_m and ptl_h/ptl_u, and not in
# the list of dg2_g10/g11/g12 (Alchemist) and arl_h. Families without XMX have no TF32.
TF32_XMX = {
    IntelFamily.PONTE_VECCHIO: True,
    IntelFamily.BATTLEMAGE: True,
    IntelFamily.LUNAR_LAKE: True,
    IntelFamily.PANTHER_LAKE: True,
    IntelFamily.ALCHEMIST: False,
    IntelFamily.METEOR_ARROW_LAKE: False,  # Meteor Lake: no XMX; Arrow Lake H: XMX, no TF32
    IntelFamily.XE_LP: False,              # no XMX (device_architecture.def, Xe-LP)
}


def _ids(family: IntelFamily, *ids: int) -> dict[int, IntelFamily]:
    return dict.fromkeys(ids, family)


# PCI device ids. Source of every entry: the Linux kernel's include/drm/intel/pciids.h, the
# macro named per line.
_BY_DEVICE_ID = {
    **_ids(IntelFamily.PONTE_VECCHIO,  # INTEL_PVC_IDS
           0x0B69, 0x0B6E, 0x0BD4, 0x0BD5, 0x0BD6, 0x0BD7, 0x0BD8, 0x0BD9, 0x0BDA, 0x0BDB,
           0x0BE0, 0x0BE1, 0x0BE5),
    **_ids(IntelFamily.ALCHEMIST,  # INTEL_DG2_G10/G11/G12_IDS and INTEL_ATS_M_IDS (Flex)
           0x5690, 0x5691, 0x5692, 0x56A0, 0x56A1, 0x56A2, 0x56BE, 0x56BF, 0x5693, 0x5694,
           0x5695, 0x56A5, 0x56A6, 0x56B0, 0x56B1, 0x56BA, 0x56BB, 0x56BC, 0x56BD, 0x5696,
           0x5697, 0x56A3, 0x56A4, 0x56B2, 0x56B3, 0x56C0, 0x56C1, 0x56C2),
    **_ids(IntelFamily.BATTLEMAGE,  # INTEL_BMG_IDS
           0xE202, 0xE20B, 0xE20C, 0xE20D, 0xE210, 0xE211, 0xE212, 0xE215, 0xE216),
    **_ids(IntelFamily.METEOR_ARROW_LAKE,  # INTEL_MTL_IDS and INTEL_ARL_IDS
           0x7D40, 0x7D45, 0x7D55, 0x7D60, 0x7DD5, 0x7D51, 0x7DD1, 0x7D41, 0x7D67, 0xB640),
    **_ids(IntelFamily.LUNAR_LAKE, 0x6420, 0x64A0, 0x64B0),  # INTEL_LNL_IDS
    **_ids(IntelFamily.PANTHER_LAKE,  # INTEL_PTL_IDS
           0xB080, 0xB081, 0xB082, 0xB090, 0xB091, 0xB092, 0xB0A0, 0xB0A1, 0xB0A2),
}

# Last resort, for torch builds that report neither architecture nor device id. Only names
# that cannot belong to another family: "Arc(TM) Graphics" alone is also Lunar Lake's name
# on some drivers, and Panther Lake's iGPUs are branded "Arc B390/B370", so a bare "Arc B"
# is Battlemage only on a discrete GPU.
# Source of each: Intel's product specifications (ark.intel.com) for the product lines.
_BY_NAME = [
    (re.compile(r"Data Center GPU Max"), IntelFamily.PONTE_VECCHIO, None),  # Max Series
    # Flex Series and Arc A-series (Alchemist): Intel Arc A-series product specifications.
    (re.compile(r"Data Center GPU Flex|Arc\(TM\) (Pro )?A\d{2,3}"), IntelFamily.ALCHEMIST,
     None),
    # Arc B-series discrete (Battlemage): Intel Arc B-series product specifications.
    (re.compile(r"Arc\(TM\) (Pro )?B\d{2,3}"), IntelFamily.BATTLEMAGE, False),
    # Core Ultra 200V (Lunar Lake) graphics: Intel Arc 130V / 140V product specifications.
    (re.compile(r"Arc\(TM\) 1[34]0V"), IntelFamily.LUNAR_LAKE, None),
]


@dataclass(frozen=True)
class Identification:
    family: IntelFamily
    ip_version: str | None  # "12.55.8"
    source: str             # how the family was found: architecture, device id, name, none


def ip_version(architecture: int | None) -> tuple[int, int, int] | None:
    """(major, minor, revision) from a SYCL architecture id; None for ids that are not an
    Intel GPU's (family byte 0x03 is Intel CPUs, 0x01 NVIDIA, 0x02 AMD, 0x99 unknown)."""
    # Below 2**32 is no Intel GPU in this format (their GMD IDs start at 8.0.0 << 8); a
    # value there is not decoded rather than read as some other layout.
    if architecture is None or architecture < 1 << 32 or architecture >> 56 != 0x00:
        return None
    gmdid = (architecture >> 8) & 0xFFFFFFFF
    return gmdid >> 22, (gmdid >> 14) & 0xFF, gmdid & 0x3F


def identify(props: XPUProperties) -> Identification:
    version = ip_version(props.architecture)
    text = ".".join(map(str, version)) if version else None
    if version is not None and version[:2] in _BY_IP:
        return Identification(_BY_IP[version[:2]], text, "architecture")
    if props.device_id is not None and props.device_id in _BY_DEVICE_ID:
        return Identification(_BY_DEVICE_ID[props.device_id], text, "device id")
    for pattern, family, integrated in _BY_NAME:
        if pattern.search(props.name) and integrated in (None, props.is_integrated_gpu):
            return Identification(family, text, "name")
    return Identification(IntelFamily.UNKNOWN, text, "none")
