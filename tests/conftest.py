"""Every test starts from a clean environment: no TORCHBRIDGE_* variables, no config file in
the working directory, and plugins loaded as installed."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torchbridge


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]) -> None:
    for var in list(os.environ):
        if var.startswith("TORCHBRIDGE_"):
            monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def fresh_discovery() -> Iterator[None]:
    """Discovery runs once per process; tests that replay recorded devices patch a probe
    first, so each test starts (and leaves) with discovery not yet run."""
    from torchbridge import selection

    selection._discovery = None
    yield
    selection._discovery = None


def _prepared_is_fastest(label: str, fn: Callable[[], Any]) -> float:
    fn()
    return {"prepared": 1.0, "uncompiled": 2.0}.get(label, 3.0)


@pytest.fixture(autouse=True)
def prepared_times_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare_model keeps the fastest of O0, the prepared model and the prepared model
    uncompiled, by timing them (optimize/fastest.py). Tests about something else must not
    hang on that measurement (a tiny model on a loaded machine can time either way): here
    the prepared model always times fastest. tests/test_keep_fastest.py tests the decision
    with timers of its own."""
    monkeypatch.setattr("torchbridge.optimize.fastest.default_timer",
                        lambda synchronize: _prepared_is_fastest)


@pytest.fixture(autouse=True)
def heap_reuse_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU backend's heap_reuse pass sets glibc's malloc for the whole process, for
    good: the test process keeps glibc's defaults (the pass would skip, saying so).
    tests/test_heap_reuse.py tests it through its seams and, for real, in a subprocess."""
    monkeypatch.setattr("torchbridge.builtin.cpu.heap.why_not",
                        lambda: "off in the tests (tests/conftest.py)")


@pytest.fixture
def reload_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For tests that change plugin loading (env lists, entry points): undo the patches,
    then reload, so later tests see the plugins as installed."""
    yield
    monkeypatch.undo()
    torchbridge.reload_plugins()


@pytest.fixture
def no_cuda_reason() -> str:
    """Why the NVIDIA backend is unavailable here, as its probe says it: "built without
    CUDA" on the CPU build of torch 2.13, "no NVIDIA GPU visible" on torch-xla's CUDA
    build of torch 2.9 (the tests_xla session)."""
    from torchbridge_nvidia.probe import probe

    reason = probe().reason
    if not reason:  # a GPU machine (nox -s tests_gpu, benchmarks/gpu_session.sh)
        pytest.skip("about a machine without a usable NVIDIA GPU; this one has one")
    return reason


def _present(marker: str) -> bool:
    import torch

    if marker == "cuda":
        return torch.version.hip is None and torch.cuda.is_available()
    if marker == "rocm":
        return torch.version.hip is not None and torch.cuda.is_available()
    if marker == "xpu":
        return hasattr(torch, "xpu") and torch.xpu.is_available()
    if marker == "tpu":
        return os.environ.get("PJRT_DEVICE", "").upper() == "TPU"
    return True


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked cuda, rocm, xpu or tpu are skipped where that device is absent."""
    for marker in ("cuda", "rocm", "xpu", "tpu"):
        if item.get_closest_marker(marker) is not None and not _present(marker):
            pytest.skip(f"needs a {marker} device; none here")


@pytest.fixture
def declare(reload_plugins: None, monkeypatch: pytest.MonkeyPatch) -> Any:
    """declare(plugin, op, name, forward, **fields): registers a plugin whose one kernel
    implementation of `op` for cpu is preferred over the others; returns get_kernel's."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # Triton's would serve cpu

    def register(plugin: str, op: str, name: str, forward: Any, **declared: Any) -> Any:
        from kernel_declaring import _Declares

        torchbridge.register_plugin(_Declares(op, name, forward, **declared), name=plugin)
        kernel = torchbridge.get_kernel(op, "cpu")
        assert kernel.label == f"{name} (plugin {plugin})"
        return kernel

    return register
