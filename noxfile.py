"""Sessions: `nox -s tests tests_xla tests_kernels` (the README's test command),
`tests_gpu`, `demo`, `lint`, `typecheck`, `bench`.

torch is pinned: an unpinned `torch` pulls a multi-GB CUDA build; 2.13.0 is the CPU wheel.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

TORCH = ["torch==2.13.0", "numpy"]
# Optional integrations the tests exercise (never dependencies of the core): Lightning,
# hypothesis, and transformers (tests/test_hf_models.py skips without it; also for
# `torchbridge bench --suite hf`).
# The HF tests reach into transformers 5.x internals (its attention registry): a range
# CI has passed; move it when a newer transformers passes tests/test_hf_*.py.
HF = "transformers>=5.0,<5.24"
TEST_EXTRAS = ["lightning>=2.4,<3", "hypothesis>=6.100", HF, "safetensors>=0.4"]
# The meta-distribution with every extra, resolved against the local plugin folders.
PACKAGES = ["./torchbridge-core", "./plugins/nvidia", "./plugins/amd", "./plugins/intel",
            "./plugins/tpu", ".[all]"]


def install_torchbridge(session: nox.Session, *extra: str) -> None:
    session.install(*TORCH)
    session.install(*PACKAGES, *extra)


@nox.session
def tests(session: nox.Session) -> None:
    """Fresh venv, torch 2.13.0 CPU, the core and every plugin, the example plugin, pytest."""
    install_torchbridge(session, "./tests/example_plugin", "./tests/misbehaving_plugins",
                         "./tests/misbehaving_twin", "pytest", *TEST_EXTRAS)
    session.run("pytest", "--ignore=tests/kernels", *session.posargs)


@nox.session
def tests_xla(session: nox.Session) -> None:
    """torch 2.9.1 + torch-xla 2.9.0: the whole suite on torch 2.9 (the core supports it),
    then the TPU plugin and the backend contract against the real XLA runtime on this CPU
    (PJRT_DEVICE=CPU). PyPI ships torch 2.9.1 only as its CUDA build: about 7 GB."""
    session.install("torch==2.9.1", "torch-xla==2.9.0", "numpy")
    session.install(*PACKAGES, "./tests/example_plugin", "./tests/misbehaving_plugins",
                    "./tests/misbehaving_twin", "pytest", *TEST_EXTRAS)
    session.run("pytest", "tests", "--ignore=tests/xla", "--ignore=tests/kernels",
                *session.posargs)
    session.run("pytest", "tests/xla", *session.posargs, env={"PJRT_DEVICE": "CPU"})


# The ahead-of-time check uses triton.compile(ASTSource(fn, signature, constexprs), target)
# as Triton 3.9 spells it; move the range when a newer Triton passes tests/kernels.
TRITON = "triton>=3.9,<3.10"


@nox.session
def tests_kernels(session: nox.Session) -> None:
    """The custom kernels on this CPU: every Triton kernel under Triton's interpreter against
    the reference (TRITON_INTERPRET=1 is set here, before anything imports triton: Triton
    reads it when a kernel is decorated), numba.cuda kernels in numba's CUDA simulator, and,
    in a subprocess without the interpreter, every Triton kernel compiled ahead of time for
    sm_80, sm_90 and gfx942."""
    install_torchbridge(session, "./tests/example_plugin", "./tests/misbehaving_plugins",
                        "./tests/misbehaving_twin", TRITON, "numba", HF, "pytest")
    session.run("pytest", "tests/kernels", *session.posargs,
                env={"TRITON_INTERPRET": "1", "NUMBA_ENABLE_CUDASIM": "1"})


@nox.session
def tests_gpu(session: nox.Session) -> None:
    """On a GPU machine: the tests marked cuda/rocm/xpu. torch is left unpinned here on
    purpose so that pip picks the accelerator build for this machine; PyPI's is CUDA's, so
    on an AMD or Intel GPU name the build's index, e.g.
    TORCH_INDEX_URL=https://download.pytorch.org/whl/rocm6.4 (or /whl/xpu) nox -s tests_gpu."""
    index = os.environ.get("TORCH_INDEX_URL")
    session.install("torch", *(["--index-url", index] if index else []))
    session.install("numpy")
    session.install(*PACKAGES, "./tests/example_plugin", "./tests/misbehaving_plugins",
                    "./tests/misbehaving_twin", "pytest", *TEST_EXTRAS)
    session.run("pytest", "-m", "cuda or rocm or xpu", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """Prepare and run a model on this machine's default backend and show what was done."""
    install_torchbridge(session)
    session.run("torchbridge", "doctor")
    session.run("python", "examples/quickstart.py", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "torchbridge-core", "plugins", "tests", "benchmarks",
                "examples", "noxfile.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    install_torchbridge(session, "mypy", "pytest")
    session.run("mypy", "torchbridge-core/src/torchbridge", "plugins/nvidia/src",
                "plugins/amd/src", "plugins/intel/src", "plugins/tpu/src")


@nox.session
def bench(session: nox.Session) -> None:
    """Startup benchmark: import cost and discovery time."""
    install_torchbridge(session)
    session.run("python", "benchmarks/startup.py", *session.posargs)
