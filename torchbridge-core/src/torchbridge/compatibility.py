"""Will this model work, and work fast, on a backend that need not be here?

`check_compatibility(model, sample_input, backend="tpu")` looks at the model's dtypes and
attention head sizes against the target's capabilities, and, with a sample input, runs the
model once on this machine's CPU under a dispatch mode (thread-local) that records host
round trips (`.item()`, `float()`, Python branching on tensor values; not printing or
`.tolist()`, which read a CPU tensor's memory without an op to record) and ops whose output
shape depends on the data (nonzero, masked_select, unique): on XLA each is a device-to-host
transfer or a recompilation. When torch_xla is installed and the target is XLA, the model
also runs for real on XLA (PJRT_DEVICE=CPU without a TPU) and XLA's own counters speak.

The seed names `HardwareDetector` and `UnifiedValidator` are thin aliases over this and the
selection API.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torchbridge.backend import get_backend
from torchbridge.errors import TorchBridgeError, UnsupportedDtypeError
from torchbridge.optimize.measure import preserved_state, sample_call
from torchbridge.selection import detect_best_backend, list_backends, normalize_name
from torchbridge.types import DeviceInfo

logger = logging.getLogger(__name__)

# What a target lacks when its device cannot describe itself here (compute capability):
# bf16 tensor cores from Ampere (8.0), FP8 from Ada/Hopper (8.9). No TPU has float64
# hardware, present or not. Whether an Intel GPU has float64 only its description says
# (extra["fp64"]: False on the Arc A-series, True on Xe2 and Data Center GPU Max).
_NO_FLOAT64 = {"tpu": "TPUs have no float64 hardware: XLA emulates or demotes it"}
_FLASH_HEAD_DIMS = "head size a multiple of 8 and at most 256"
_HOST_OPS = {"aten::_local_scalar_dense": "a tensor value read on the host (.item(), "
             "float(), `if tensor:`)"}
_DYNAMIC_OPS = {"aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique2",
                "aten::unique_consecutive", "aten::unique_dim",
                "aten::index with a boolean mask"}
_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                    "float8_e5m2fnuz") if hasattr(torch, n)}
_OCP_FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}
# The float8 dtypes torch multiplies on a device type without FP8 matrix units: on CPUs
# and Intel GPUs torch._scaled_mm goes through oneDNN, which converts them to a wider type
# first (all four here, torch 2.13's CPU build; every current Intel GPU upconverts to f16,
# oneDNN's data types page), and refuses the fnuz ones on Intel GPUs ("Float8_e4m3fnuz is
# not supported in oneDNN!", intel/torch-xpu-ops#2538). On CUDA and ROCm torch._scaled_mm
# refuses a GPU whose FP8 units do not compute the dtype (ScaledBlas.cpp).
_FP8_CONVERTED = {"cpu": _FP8, "xpu": _OCP_FP8}


@dataclass(frozen=True)
class CompatibilityIssue:
    severity: str  # "error": will not run as is; "slow": runs, but slowly
    what: str
    detail: str


@dataclass
class CompatibilityReport:
    backend: str
    target: str  # what the target was taken to be
    issues: list[CompatibilityIssue] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def compatible(self) -> bool:
        """No issue that stops the model from running there."""
        return not any(i.severity == "error" for i in self.issues)

    def __str__(self) -> str:
        return self.summary()

    def summary(self) -> str:
        lines = [f"compatibility with {self.backend} ({self.target}): "
                 f"{'OK' if self.compatible else 'PROBLEMS'}"]
        lines += [f"  {i.severity:5} {i.what}: {i.detail}" for i in self.issues]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _target(name: str, compute_capability: tuple[int, int] | None
            ) -> tuple[str, str, tuple[int, int] | None, DeviceInfo | None]:
    """(canonical name, description, compute capability, the present device's own
    description or None)."""
    name = normalize_name(name)
    status = next((s for s in list_backends() if s.name == name), None)
    if status is None:
        return name, "no installed plugin reports it", compute_capability, None
    if status.available and compute_capability is None:
        try:
            info = get_backend(status.name).get_device_info()
            return status.name, f"{info.name}, present", _capability(info.compute_capability), \
                info
        except TorchBridgeError as exc:
            logger.info("no description of %s: %s", status.name, exc)
    where = "present" if status.available else "not present here"
    cc = compute_capability
    described = f"compute capability {cc[0]}.{cc[1]}" if cc else "capability not given"
    return status.name, f"{where}, {described}", cc, None


def _capability(text: str | None) -> tuple[int, int] | None:
    """(major, minor) from a DeviceInfo's "8.9"; None for anything else (gfx942, ...)."""
    major, _, minor = (text or "").partition(".")
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None


def _model_dtypes(model: nn.Module) -> set[torch.dtype]:
    return {t.dtype for t in [*model.parameters(), *model.buffers()]}


def _head_sizes(model: nn.Module) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            sizes[name or "model"] = module.head_dim
    config = getattr(model, "config", None)  # Hugging Face models
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(heads, int) and heads > 0:
        head_dim = getattr(config, "head_dim", None)
        hidden = getattr(config, "hidden_size", None)
        if not isinstance(head_dim, int) and isinstance(hidden, int):
            head_dim = hidden // heads
        if isinstance(head_dim, int):
            sizes["config"] = head_dim
    return sizes


class _HostSync(TorchDispatchMode):  # type: ignore[misc,no-untyped-call,unused-ignore]
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call,unused-ignore]
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        name = func._schema.name
        if name == "aten::index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                         for i in (args[1] if len(args) > 1 else ())):
            name = "aten::index with a boolean mask"
        if name in _HOST_OPS or name in _DYNAMIC_OPS:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _dtype_names(dtypes: set[torch.dtype]) -> str:
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def _float64_refusal(model: nn.Module, sample_input: Any, info: DeviceInfo | None
                     ) -> str | None:
    """prepare_model's own refusal (the device's extra["fp64"] is False), so that the two
    always agree; None where it would run. A description that merely does not list
    float64 (NVIDIA's and AMD's list what their matrix units compute) says nothing of it."""
    from torchbridge.optimize.pipeline import refuse_float64  # here: its import is costly

    if info is None:
        return None
    try:
        refuse_float64(model, sample_input, info)
    except UnsupportedDtypeError as exc:
        return str(exc)
    return None


def _check_dtypes(report: CompatibilityReport, model: nn.Module, sample_input: Any, name: str,
                  cc: tuple[int, int] | None, info: DeviceInfo | None) -> None:
    dtypes = _model_dtypes(model)
    refusal = _float64_refusal(model, sample_input, info)
    if refusal:
        report.issues.append(CompatibilityIssue("error", "float64", refusal))
    elif torch.float64 in dtypes and name in _NO_FLOAT64:
        report.issues.append(CompatibilityIssue("slow", "float64", _NO_FLOAT64[name]))
    if torch.bfloat16 in dtypes and name == "cuda" and cc is not None and cc < (8, 0):
        report.issues.append(CompatibilityIssue(
            "slow", "bfloat16", f"compute capability {cc[0]}.{cc[1]} (before Ampere) has no "
            "bf16 tensor cores: bf16 runs emulated; use float16 with a GradScaler"))
    fp8 = dtypes & _FP8
    if not fp8:
        return
    if info is not None:
        _check_fp8(report, fp8, info)
    elif name == "cuda" and cc is not None:
        if cc < (8, 9):
            report.issues.append(CompatibilityIssue(
                "error", "fp8", f"{_dtype_names(fp8)} weights need FP8 tensor cores (compute "
                f"capability 8.9 or newer, Ada/Hopper); this target is {cc[0]}.{cc[1]}"))
    else:
        hint = " (give its compute_capability)" if name == "cuda" else ""
        report.notes.append(f"fp8: {_dtype_names(fp8)} weights not checked: no {name} device "
                            f"here to say which FP8 dtypes it computes{hint}")


def _check_fp8(report: CompatibilityReport, fp8: set[torch.dtype], info: DeviceInfo) -> None:
    """FP8 weights against the float8 dtypes the present device lists: those torch computes
    on its FP8 units (e4m3fn and e5m2, or the fnuz pair on MI300), else none."""
    listed = {d for d in info.supported_dtypes if d.startswith("float8")}
    missing = {d for d in fp8 if str(d).removeprefix("torch.") not in listed}
    if not missing:
        return
    names = _dtype_names(missing)
    lists = ", ".join(info.supported_dtypes)
    converted = _FP8_CONVERTED.get(info.device.partition(":")[0], set())
    if missing <= converted:
        report.issues.append(CompatibilityIssue(
            "slow", "fp8", f"{names} weights: {info.name} lists no float8 dtype for them (it "
            f"lists {lists}); torch multiplies them there through oneDNN, converted to a "
            "wider type first"))
    elif listed:
        report.issues.append(CompatibilityIssue(
            "error", "fp8", f"{names} weights: {info.name} computes FP8 in "
            f"{', '.join(sorted(listed))} only, another encoding (the fnuz ones have no "
            "negative zero, one NaN and another exponent bias: e4m3's largest value is 240 "
            "there, 448 in float8_e4m3fn); quantize the weights to those"))
    elif info.architecture == "unknown":
        # A part its plugin's tables do not know is described by what is certain only:
        # its missing FP8 is a fact about the tables, not the device.
        report.notes.append(f"fp8: {names} weights not checked: {info.name} is not in its "
                            f"plugin's tables, whose description lists {lists} only")
    else:
        also = f"; torch converts only {_dtype_names(converted)} there" if converted else ""
        report.issues.append(CompatibilityIssue(
            "error", "fp8", f"{names} weights: {info.name} lists no float8 dtype (it lists "
            f"{lists}), so nothing computes FP8 on it{also}"))


def _check_attention(report: CompatibilityReport, model: nn.Module, name: str) -> None:
    if name not in ("cuda", "rocm", "xpu"):
        return
    for where, size in _head_sizes(model).items():
        if size % 8 or size > 256:
            report.issues.append(CompatibilityIssue(
                "slow", "attention head size", f"{where}: head size {size}; the flash "
                f"attention kernels need a {_FLASH_HEAD_DIMS}, so attention falls back to "
                "the memory-hungry math path"))


def _check_host_syncs(report: CompatibilityReport, model: nn.Module, sample_input: Any,
                      name: str) -> None:
    work = copy.deepcopy(model).cpu()
    recorder = _HostSync()
    with preserved_state(work), recorder:
        work.eval()
        sample_call(_Host(), sample_input)(work)
    severity = "slow" if name in ("tpu", "xla") else "info"
    for op, count in sorted(recorder.counts.items()):
        if op in _HOST_OPS:
            what = "host round trip"
            detail = f"{count} per call: {_HOST_OPS[op]}"
        else:
            what = "dynamic shape"
            detail = f"{op} x{count}: an output shape that depends on the data"
        if severity == "info":
            report.notes.append(f"{what}: {detail} (costly on XLA only)")
        else:
            report.issues.append(CompatibilityIssue(severity, what, detail + "; on XLA each "
                                                    "forces a device sync or a recompile"))


class _Host:
    @staticmethod
    def to_device(obj: Any) -> Any:
        return obj


def _check_on_xla(report: CompatibilityReport, model: nn.Module, sample_input: Any) -> None:
    import os

    from torchbridge.errors import BackendUnavailableError

    # Importing torch_xla sets PJRT_DEVICE (to CPU without a TPU) in os.environ, which every
    # later discovery and child process would read as "a TPU is indicated": put it back.
    pjrt = os.environ.get("PJRT_DEVICE")
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        report.notes.append("torch_xla is not installed: checked on the CPU only, not run "
                            "on XLA")
        return
    finally:
        if pjrt is None:
            os.environ.pop("PJRT_DEVICE", None)
    try:
        backend = get_backend("tpu")
    except BackendUnavailableError as exc:
        report.notes.append(f"not run on XLA: {exc} (PJRT_DEVICE=CPU runs it on XLA:CPU)")
        return
    result = backend.optimize(model, "O1", sample_input=sample_input)
    for note in result.notes:
        if note.startswith("xla_graph_check:"):
            text = note.removeprefix("xla_graph_check: ")
            if text.startswith("static graph"):
                report.notes.append(f"ran on XLA: {text}")
            else:
                report.issues.append(CompatibilityIssue("slow", "XLA graph", text))
    for p in result.failed:
        report.issues.append(CompatibilityIssue("error", f"XLA pass {p.name}", p.detail))


def check_compatibility(model: nn.Module, sample_input: Any = None, backend: str = "cuda", *,
                        compute_capability: tuple[int, int] | None = None
                        ) -> CompatibilityReport:
    """What will not work, or will be slow, for `model` on `backend` (a name such as
    "cuda", "rocm", "xpu", "tpu", "cpu"; it need not be installed or present). A present
    device describes itself; for an absent one, give its `compute_capability` (e.g.
    (7, 5) for Turing) to check dtype support against it. With `sample_input` the model
    runs once on the CPU (and on XLA when the target is XLA and torch_xla is installed)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"check_compatibility takes an nn.Module, got {type(model).__name__}")
    name, target, cc, info = _target(backend, compute_capability)
    report = CompatibilityReport(name, target)
    _check_dtypes(report, model, sample_input, name, cc, info)
    _check_attention(report, model, name)
    if sample_input is not None:
        _check_host_syncs(report, model, sample_input, name)
        if name == "tpu":
            _check_on_xla(report, model, sample_input)
    else:
        report.notes.append("no sample input: host round trips and dynamic shapes not checked")
    return report


@dataclass(frozen=True)
class HardwareProfile:
    """The seeds' hardware profile, from the selected backend's description."""

    hardware_type: str
    device_name: str
    device_count: int
    total_memory_gb: float | None
    compute_capability: tuple[int, int] | None


class HardwareDetector:
    """Seed alias: `HardwareDetector().detect()` and `.get_optimal_backend()` over
    torchbridge's selection (`detect_best_backend`, `get_backend`)."""

    def detect(self) -> HardwareProfile:
        backend = get_backend()
        info = backend.get_device_info()
        return HardwareProfile(backend.name, info.name, backend.device_count,
                               info.memory_total_gb, _capability(info.compute_capability))

    def get_optimal_backend(self) -> str:
        return detect_best_backend()


class UnifiedValidator:
    """Seed alias: per-vendor compatibility checks over `check_compatibility`."""

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def validate_nvidia_compatibility(self, model: nn.Module, sample_input: Any = None, *,
                                      compute_capability: tuple[int, int] | None = None
                                      ) -> CompatibilityReport:
        return check_compatibility(model, sample_input, "cuda",
                                   compute_capability=compute_capability)

    def validate_tpu_compatibility(self, model: nn.Module, sample_input: Any = None
                                   ) -> CompatibilityReport:
        return check_compatibility(model, sample_input, "tpu")
