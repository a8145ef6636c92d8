"""The PyDotCompute kernel API of every Backend: arrays in and out, compile a kernel,
launch it, cache what was compiled.

    backend = torchbridge.get_backend()
    kernel = backend.compile_kernel(add_kernel)            # a @triton.jit function
    x = backend.to_device(numpy_array)
    backend.launch_kernel(kernel, (blocks,), {"BLOCK": 256}, x, y, out, n)
    result = backend.to_host(out)                          # a NumPy array

Triton kernels compile for cuda, rocm and xpu (and run on CPU tensors under Triton's
interpreter, TRITON_INTERPRET=1); `signature` plus `target` ("cuda:90", "hip:gfx942")
compile ahead of time without the device. A numba.cuda kernel (numba installed) runs on an
NVIDIA GPU, or on numba's simulator (NUMBA_ENABLE_CUDASIM=1). `enable_caching()` points
Triton's cache at the TorchBridge cache directory, so a second process compiles nothing
(Triton's kernels; numba's are not cached on disk).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchbridge.errors import KernelCompilationError, KernelError, KernelLaunchError

if TYPE_CHECKING:
    import numpy as np

    from torchbridge.backend import Backend

logger = logging.getLogger(__name__)

TRITON_BACKENDS = ("cuda", "rocm", "xpu")


@dataclass
class CompiledKernel:
    """A kernel `compile_kernel` accepted: `kind` is "triton" or "numba"; `compiled` the
    ahead-of-time result when a target was given (Triton's CompiledKernel: `.asm`)."""

    name: str
    kind: str
    function: Any
    compiled: Any = None


def cache_dir(backend: Backend) -> Path:
    configured = backend.config.kernel.cache_dir
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchbridge"


_ours: list[str] = []  # the TRITON_CACHE_DIR enable_caching set, if it set one


def enable_caching(backend: Backend, enabled: bool = True) -> Path | None:
    """Compiled Triton kernels are kept under the TorchBridge cache directory
    (`config.kernel.cache_dir`) and reused by later processes (which inherit the variable
    or call this too). A TRITON_CACHE_DIR the user set is left alone, also by disabling,
    which removes only the one this set (Triton then uses its default, ~/.triton/cache).
    Returns the Triton cache directory in use (None when disabled). numba.cuda kernels are
    not cached on disk (numba caches only kernels compiled with cache=True)."""
    current = os.environ.get("TRITON_CACHE_DIR")
    if not enabled:
        if _ours and current == _ours[0]:
            del os.environ["TRITON_CACHE_DIR"]
        _ours.clear()
        return None
    if current and not (_ours and current == _ours[0]):
        return Path(current)  # the user's
    triton_dir = cache_dir(backend) / "triton"
    try:
        triton_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelError(f"cannot create the kernel cache {triton_dir}: {exc}") from exc
    os.environ["TRITON_CACHE_DIR"] = str(triton_dir)
    _ours[:] = [str(triton_dir)]
    return triton_dir


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _is_triton(func: Any) -> bool:
    if "triton" not in sys.modules:
        return False
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return isinstance(func, (JITFunction, InterpretedFunction))


def _numba_cuda() -> Any:
    if importlib.util.find_spec("numba") is None:
        return None
    from numba import cuda

    return cuda


def _is_numba_kernel(func: Any) -> bool:
    if "numba" not in sys.modules:
        return False
    cls = type(func)
    return cls.__module__.startswith("numba.cuda") and hasattr(func, "__getitem__")


def _target(target: Any) -> Any:
    from triton.backends.compiler import GPUTarget

    if target is None or isinstance(target, GPUTarget):
        return target
    kind, _, arch = str(target).partition(":")
    if kind == "cuda" and arch.isdigit():
        return GPUTarget("cuda", int(arch), 32)
    if kind == "hip" and arch.startswith("gfx"):
        return GPUTarget("hip", arch, 64 if arch.startswith("gfx9") else 32)
    raise KernelCompilationError(f"target {target!r}: expected 'cuda:<sm>' (e.g. cuda:90) or "
                                 "'hip:<gfx arch>' (e.g. hip:gfx942)")


def compile_kernel(backend: Backend, func: Any, signature: dict[str, str] | None = None, *,
                   constexprs: dict[str, Any] | None = None, target: Any = None
                   ) -> CompiledKernel:
    """Accept a Triton kernel (@triton.jit) or a numba.cuda kernel for this backend.

    Triton: with `signature` ({"x_ptr": "*fp32", "n": "i32"}) and `constexprs`, compile now
    for `target` (default: this machine's device), so compile errors surface here; without
    it Triton compiles at the first launch. A plain Python function becomes a numba.cuda
    kernel when numba is installed."""
    name = str(getattr(func, "__name__", None) or getattr(
        getattr(func, "fn", None), "__name__", type(func).__name__))
    if _is_triton(func):
        if target is None and backend.name not in TRITON_BACKENDS and not _interpreted():
            raise KernelCompilationError(
                f"kernel {name}: Triton compiles for {', '.join(TRITON_BACKENDS)}, not "
                f"{backend.name}; on CPU set TRITON_INTERPRET=1 before importing triton to "
                "run it interpreted, or pass target= to compile ahead of time")
        compiled = None
        if signature is not None and (target is not None or not _interpreted()):
            import triton

            try:
                compiled = triton.compile(triton.compiler.ASTSource(
                    fn=func, signature=signature, constexprs=constexprs or {}),
                    target=_target(target))
            except Exception as exc:
                raise KernelCompilationError(f"kernel {name} failed to compile: "
                                             f"{type(exc).__name__}: {exc}") from exc
        return CompiledKernel(name, "triton", func, compiled)
    if _is_numba_kernel(func):
        return CompiledKernel(name, "numba", func)
    if callable(func):
        cuda = _numba_cuda()
        if cuda is None:
            raise KernelCompilationError(f"kernel {name}: not a Triton kernel, and numba (for "
                                         "numba.cuda kernels) is not installed")
        try:
            jitted = cuda.jit(signature)(func) if signature else cuda.jit(func)
        except Exception as exc:
            raise KernelCompilationError(f"kernel {name} failed to compile with numba: "
                                         f"{exc}") from exc
        return CompiledKernel(name, "numba", jitted)
    raise KernelCompilationError(f"compile_kernel expects a Triton or numba.cuda kernel, got "
                                 f"{type(func).__name__}")


def _numba_argument(arg: Any) -> Any:
    if not isinstance(arg, torch.Tensor):
        return arg
    if arg.device.type == "cuda":
        cuda = _numba_cuda()
        return cuda.as_cuda_array(arg.detach())
    return arg.detach().numpy()  # the simulator works on host arrays; shares the memory


def launch_kernel(backend: Backend, kernel: Any, grid: Any, block: Any, *args: Any) -> None:
    """Launch `kernel` (from compile_kernel, or a raw Triton / numba.cuda kernel).

    grid: the number of programs (Triton) or blocks (numba), an int or a tuple.
    block: numba: threads per block; Triton: a dict of meta-parameters (the kernel's
    constexprs and num_warps), or None."""
    if not isinstance(kernel, CompiledKernel):
        kernel = compile_kernel(backend, kernel)
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
    if kernel.kind == "triton" and not isinstance(block, (dict, type(None))):
        raise KernelLaunchError(f"kernel {kernel.name}: block must be a dict of Triton "
                                f"meta-parameters (constexprs, num_warps), got {block!r}")
    try:
        if kernel.kind == "triton":
            kernel.function[grid](*args, **(block or {}))
        else:
            block = tuple(block) if isinstance(block, (tuple, list)) else (block,)
            kernel.function[grid, block](*(_numba_argument(a) for a in args))
    except KernelError:
        raise
    except Exception as exc:
        cls = KernelCompilationError if "Compilation" in type(exc).__name__ \
            else KernelLaunchError
        raise cls(f"kernel {kernel.name} failed to launch: {type(exc).__name__}: "
                  f"{exc}") from exc


def allocate(backend: Backend, shape: Any, dtype: Any = torch.float32) -> torch.Tensor:
    """An uninitialised tensor of `shape` and `dtype` on the backend's device."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise KernelError(f"allocate: shape must be non-negative integers, got {shape!r}")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise KernelError(f"allocate: dtype must be a torch.dtype or its name, got {dtype!r}")
    return torch.empty(dims, dtype=dtype, device=backend.device)


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy copy of `tensor` (bfloat16, which NumPy lacks, as float32)."""
    if not isinstance(tensor, torch.Tensor):
        raise KernelError(f"to_host expects a tensor, got {type(tensor).__name__}")
    host = tensor.detach().cpu()
    if host.dtype == torch.bfloat16:
        host = host.float()
    try:
        array: np.ndarray = host.numpy().copy()  # a copy also on CPU, where .numpy() shares
        return array
    except TypeError as exc:
        raise KernelError(f"to_host: NumPy has no {tensor.dtype}; convert the tensor "
                          f"first (e.g. .float())") from exc


def memory_info(backend: Backend) -> tuple[int, int] | None:
    """(free bytes, total bytes) of the device, None where either is unknowable."""
    stats = backend.get_memory_stats()
    if stats.free_bytes is None or stats.total_bytes is None:
        return None
    return int(stats.free_bytes), int(stats.total_bytes)
