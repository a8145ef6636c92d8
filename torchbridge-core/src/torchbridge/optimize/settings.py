"""Process-wide settings that passes change: declared, watched, reported, and scoped.

Some speedups are not changes to the model but to torch's global state: TF32 for float32
matmuls, cuDNN's autotuner, the BLAS or flash-attention library on ROCm. A pass that
changes one names it in `OptimizationPass.settings`. The pipeline reads every setting it
knows before and after each pass, declared or not, so a pass that changes one silently is
caught and rolled back.

When the run ends, each change whose setting torch reads when an op runs (scope "call") is
put back process-wide and set again around every call of the prepared model, as the compile
pass does with inductor's freezing option: other models in the process keep their numbers.
A setting torch reads once per process, or that cannot be undone (scope "process"), stays
changed; the report lists it with its value before and after, and
`OptimizationResult.restore_process_settings()` puts back what can be put back.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

_MISSING = object()


@dataclass(frozen=True)
class ProcessSetting:
    """One process-wide setting. `read()` returns its value; `write(value)` sets it, and is
    None where it cannot be set back. scope "call": torch reads it each time an op runs,
    so it can be set around a model's calls; "process": it holds for the whole process
    (`why_process` says why)."""

    name: str
    read: Callable[[], Any]
    write: Callable[[Any], None] | None
    scope: Literal["call", "process"] = "call"
    why_process: str = ""
    # Names of settings that change with this one (torch keeps TF32 in a legacy flag and
    # in fp32_precision): declaring this one declares those.
    covers: tuple[str, ...] = ()
    # Scope "process" only. True: a setting that changes how fast any model of the process
    # runs (glibc's malloc), so O0 and the uncompiled forward were timed under it too; when
    # the timing keeps one of them and undoes the pass, the setting stays, or the kept
    # model would not run as it was timed.
    kept_after_timing: bool = False

    @property
    def stays_after_timing(self) -> bool:
        """Stays when the timing undoes its pass (kept_after_timing holds for scope
        "process" only: a setting of scope "call" was never in force around O0)."""
        return self.kept_after_timing and self.scope == "process"


def attribute_setting(path: str, covers: tuple[str, ...] = ()) -> ProcessSetting:
    """A setting that is an attribute of a torch module, e.g.
    "torch.backends.cuda.matmul.allow_tf32" (read when an op runs: scope "call")."""
    owner_path, attr = path.rsplit(".", 1)

    # Resolved once, at first use: scoped settings are read and written around every call
    # of a prepared model (walking the path each time cost about 4 us per setting). The
    # attribute itself is read each time.
    @functools.cache
    def owner() -> Any:
        obj: Any = importlib.import_module(owner_path.split(".")[0])
        for part in owner_path.split(".")[1:]:
            obj = getattr(obj, part)
        return obj

    return ProcessSetting(path, lambda: getattr(owner(), attr, None),
                          lambda value: setattr(owner(), attr, value), covers=covers)


def function_setting(path: str) -> ProcessSetting:
    """A setting read and written through one torch function (called without arguments it
    returns the value, with one it sets it), e.g. torch.backends.cuda.preferred_blas_library."""

    def fn() -> Any:
        module, name = path.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)

    return ProcessSetting(path + "()", lambda: fn()(), lambda value: fn()(value))


def environment_setting(variable: str, why_process: str) -> ProcessSetting:
    """An environment variable the runtime reads (scope "process": see why_process)."""

    def write(value: Any) -> None:
        if value is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = value

    return ProcessSetting(f"environment {variable}", lambda: os.environ.get(variable), write,
                          scope="process", why_process=why_process)


# torch 2.9+ holds float32 precision in fp32_precision attributes too; the legacy TF32
# flags and torch.set_float32_matmul_precision write both.
_PRECISION = ("torch.backends.fp32_precision", "torch.backends.cuda.matmul.fp32_precision",
              "torch.backends.cudnn.fp32_precision", "torch.backends.cudnn.conv.fp32_precision",
              "torch.backends.cudnn.rnn.fp32_precision", "torch.backends.mkldnn.fp32_precision",
              "torch.backends.mkldnn.matmul.fp32_precision",
              "torch.backends.mkldnn.conv.fp32_precision",
              "torch.backends.mkldnn.rnn.fp32_precision")
_MATMUL_PRECISION = "torch.get_float32_matmul_precision()"

TF32_MATMUL = attribute_setting(
    "torch.backends.cuda.matmul.allow_tf32",
    covers=("torch.backends.cuda.matmul.fp32_precision", _MATMUL_PRECISION))
CUDNN_TF32 = attribute_setting("torch.backends.cudnn.allow_tf32",
                               covers=tuple(p for p in _PRECISION if ".cudnn." in p))
CUDNN_BENCHMARK = attribute_setting("torch.backends.cudnn.benchmark")
ONEDNN_TF32 = attribute_setting("torch.backends.mkldnn.allow_tf32",
                                covers=tuple(p for p in _PRECISION if ".mkldnn." in p))
BLAS_LIBRARY = function_setting("torch.backends.cuda.preferred_blas_library")
ROCM_FLASH_LIBRARY = function_setting("torch.backends.cuda.preferred_rocm_fa_library")

# Where inductor keeps compiled artifacts (its FX graph and autograd caches): the compile
# pass sets it from config optimization.compile_cache_dir.
COMPILE_CACHE_DIR = environment_setting(
    "TORCHINDUCTOR_CACHE_DIR", "inductor reads its cache folder from the environment when "
    "it compiles, for every model of the process")

# Read before and after every pass, whether a pass declares them or not; put back in this
# order (the fp32_precision attributes first: writing a legacy flag after them would mix
# the two APIs, which torch then refuses to read).
WATCHED: tuple[ProcessSetting, ...] = (
    *(attribute_setting(path) for path in _PRECISION),
    TF32_MATMUL, CUDNN_TF32, CUDNN_BENCHMARK, ONEDNN_TF32,
    attribute_setting("torch.backends.cudnn.enabled"),
    attribute_setting("torch.backends.cudnn.deterministic"),
    ProcessSetting("torch.get_default_dtype()", torch.get_default_dtype,
                   torch.set_default_dtype),
    ProcessSetting("torch.are_deterministic_algorithms_enabled()",
                   torch.are_deterministic_algorithms_enabled,
                   torch.use_deterministic_algorithms),
    ProcessSetting("torch.get_num_threads()", torch.get_num_threads, torch.set_num_threads),
    ProcessSetting(_MATMUL_PRECISION, torch.get_float32_matmul_precision,
                   torch.set_float32_matmul_precision),
)
if hasattr(torch.backends.cuda, "preferred_blas_library"):
    WATCHED += (BLAS_LIBRARY,)
if hasattr(torch.backends.cuda, "preferred_rocm_fa_library"):
    WATCHED += (ROCM_FLASH_LIBRARY,)


def read(setting: ProcessSetting) -> Any:
    """The setting's value; _MISSING when this torch cannot say (reported as unknown)."""
    try:
        return setting.read()
    except Exception:
        return _MISSING


def watched(declared: Sequence[ProcessSetting]) -> list[ProcessSetting]:
    """The settings to read around one pass: the watched ones and the pass's own."""
    names = {s.name for s in declared}
    return [*declared, *(s for s in WATCHED if s.name not in names)]


def declared_names(declared: Sequence[ProcessSetting]) -> set[str]:
    """The names a pass declares changing: its settings and those they cover."""
    return {name for s in declared for name in (s.name, *s.covers)}


def values(settings: Sequence[ProcessSetting]) -> dict[str, tuple[ProcessSetting, Any]]:
    return {s.name: (s, read(s)) for s in settings}


def differs(before: Any, after: Any) -> bool:
    if before is _MISSING or after is _MISSING:
        return False
    try:
        return bool(before != after)
    except Exception:
        return before is not after


@dataclass(frozen=True)
class SettingChange:
    """A process-wide setting a pass changed: its value before the run and after the pass;
    scope "call" when it is in force only around the prepared model's calls."""

    name: str
    before: Any
    after: Any
    scope: Literal["call", "process"]
    pass_name: str
    plugin: str | None
    why_process: str = ""
    setting: ProcessSetting | None = None

    def describe(self) -> str:
        where = "around each call of the prepared model" if self.scope == "call" else \
            f"process-wide ({self.why_process})" if self.why_process else "process-wide"
        return f"{self.name}: {self.before!r} -> {self.after!r}, {where} " \
               f"(pass {self.pass_name})"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "before": repr(self.before), "after": repr(self.after),
                "scope": self.scope, "pass": self.pass_name, "plugin": self.plugin,
                "why_process": self.why_process}


def put(setting: ProcessSetting, value: Any) -> None:
    """Set `setting` to `value`; raises where it cannot be set (write is None)."""
    if setting.write is None:
        raise RuntimeError(f"{setting.name} cannot be set back "
                           f"({setting.why_process or 'no way to write it'})")
    setting.write(value)


@contextlib.contextmanager
def in_force(changes: Sequence[SettingChange]) -> Iterator[None]:
    """The changes' `after` values in force inside, the values found outside restored."""
    saved = [(c.setting, read(c.setting)) for c in changes if c.setting is not None]
    for change in changes:
        assert change.setting is not None
        put(change.setting, change.after)
    try:
        yield
    finally:
        for setting, value in reversed(saved):
            if value is not _MISSING:
                put(setting, value)


def scope_to_calls(model: nn.Module, changes: Sequence[SettingChange]) -> None:
    """The model's forward with `changes` in force around each call (outermost, outside any
    compiled region, so a compile at the first call sees them too)."""
    from torchbridge.optimize.forward import install_forward

    changes = list(changes)

    def make(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            with in_force(changes):
                return inner(*args, **kwargs)
        return forward

    install_forward(model, make, lambda twin: scope_to_calls(twin, changes))
