"""Sessions: `nox -s tests tests_xla tests_kernels build docs` (the README's test command,
what CI runs), `tests_gpu`, `demo`, `lint`, `typecheck`, `bench`.

torch is pinned: an unpinned `torch` pulls a multi-GB CUDA build; 2.13.0 is the CPU wheel.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

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
# torchbridge-core[quantize] asks for torchao>=0.18; the range the tests session passes on
# torch 2.13 (its CUDA libraries fail to load on a CPU machine, harmlessly). Not in
# tests_xla: torchao 0.18 has been tried here only beside torch 2.13, not 2.9.1.
TORCHAO = "torchao>=0.18,<0.19"
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
                         "./tests/misbehaving_twin", "pytest", *TEST_EXTRAS, TORCHAO, "tqdm")
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
    TORCH_INDEX_URL=https://download.pytorch.org/whl/rocm6.4 (or /whl/xpu) nox -s tests_gpu.
    No triton extra: torch's CUDA wheels depend on triton, and ROCm and XPU builds bring
    their own under the same module name, which PyPI's triton would replace."""
    index = os.environ.get("TORCH_INDEX_URL")
    session.install("torch", *(["--index-url", index] if index else []))
    session.install("numpy")
    session.install(*PACKAGES, "./tests/example_plugin", "./tests/misbehaving_plugins",
                    "./tests/misbehaving_twin", "pytest", *TEST_EXTRAS)
    session.run("pytest", "-m", "cuda or rocm or xpu", *session.posargs)


# The six distributions, each built from its own folder: the meta-distribution `torchbridge`
# (extras nvidia, amd, intel, tpu, all, and the core's triton, quantize, progress, ...),
# torchbridge-core and the four vendor plugins.
DISTRIBUTIONS = [".", "torchbridge-core", "plugins/nvidia", "plugins/amd", "plugins/intel",
                 "plugins/tpu"]
# What each extra of the meta-distribution installs, checked from its wheels in `build`:
# (extra, its plugins, prepare_model levels to run, modules the extra adds). O2 compiles
# with inductor (about a minute on the 2-core CI machine), so it runs once. `all` comes
# last and alone adds third-party packages (tqdm, torchao), so the earlier extras run
# without them.
EXTRAS = [
    ("amd", "amd", "O1,O2", ""),
    ("nvidia", "nvidia", "O1", ""),
    ("intel", "intel", "O1", ""),
    ("tpu", "tpu", "O1", ""),
    ("all,progress,quantize", "nvidia,amd,intel,tpu", "O1", "tqdm,torchao"),
]


def _build_requires() -> list[str]:
    """Every distribution's build-system.requires."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # nox itself depends on tomli before 3.11
        import tomli as tomllib
    requires: list[str] = []
    for folder in DISTRIBUTIONS:
        with open(Path(folder, "pyproject.toml"), "rb") as f:
            requires += tomllib.load(f)["build-system"]["requires"]
    return sorted(set(requires))


@nox.session
def build(session: nox.Session) -> None:
    """The release as users get it. Builds the sdist and wheel of all six distributions into
    dist/ (each wheel from its sdist, so an sdist that lacks a file fails here) and checks
    them (tests/packaging/dists.py: LICENSE, README, py.typed, one version, the pins,
    triton only in the `triton` extra; `twine check --strict`). Then, in one clean venv
    with torch 2.13.0 CPU, for each extra of `torchbridge`: installs it from dist/ alone
    (its third-party requirements from the index first, then `--no-index --find-links
    dist`, so no TorchBridge distribution can come from anywhere else), and runs `pip
    check`, `torchbridge doctor` and tests/packaging/smoke.py (imports from the venv, the
    exact TorchBridge distributions of the extra, no triton, doctor's plugins and backends,
    prepare_model's output against eager).

    One venv for every extra, not one each: installing torch takes about 90 s here and
    TorchBridge's wheels a few seconds, and every TorchBridge distribution is uninstalled
    between extras; smoke.py checks each time that exactly the extra's are installed."""
    root = Path.cwd()
    dist = root / "dist"
    started = time.monotonic()
    _build_distributions(session, dist)
    session.log(f"built and checked in {time.monotonic() - started:.0f} s")

    venv = Path(session.create_tmp()).resolve() / "wheel-venv"
    shutil.rmtree(venv, ignore_errors=True)
    session.run("python", "-m", "venv", str(venv))
    started = time.monotonic()
    session.run(str(venv / "bin" / "python"), "-m", "pip", "--quiet", "install", *TORCH,
                external=True)
    session.log(f"torch installed in {time.monotonic() - started:.0f} s")
    (venv / "constraints.txt").write_text(TORCHAO + "\n")  # what the tests session passes with
    with session.chdir(venv):  # away from the source tree: nothing can import from it
        for extra, plugins, levels, adds in EXTRAS:
            started = time.monotonic()
            _check_extra(session, root, dist, venv, extra, plugins, levels, adds)
            session.log(f"torchbridge[{extra}]: checked in {time.monotonic() - started:.0f} s")
    shutil.rmtree(venv)


def _build_distributions(session: nox.Session, dist: Path) -> None:
    # The build backend is installed here from what the pyprojects' build-system.requires
    # say, and shared by the six builds (--no-isolation): an isolated build makes two fresh
    # venvs per distribution, 12 in all, about 2 minutes on the 2-core CI machine.
    session.install("build", "twine", *_build_requires())
    shutil.rmtree(dist, ignore_errors=True)
    for folder in DISTRIBUTIONS:
        session.run("python", "-m", "build", "--quiet", "--no-isolation", "--outdir", str(dist),
                    folder)
    session.run("python", "tests/packaging/dists.py", "check", str(dist))
    session.run("twine", "check", "--strict", *sorted(str(p) for p in dist.iterdir()))


def _check_extra(session: nox.Session, root: Path, dist: Path, venv: Path, extra: str,
                 plugins: str, levels: str, adds: str) -> None:
    """Install torchbridge[extra] into `venv` from `dist` alone, in place of what the
    previous extra installed, and check it there."""
    session.log(f"torchbridge[{extra}] from the wheels")
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "--quiet"]
    ours = ["torchbridge", "torchbridge-core", "torchbridge-nvidia", "torchbridge-amd",
            "torchbridge-intel", "torchbridge-tpu"]
    session.run(*pip, "--quiet", "uninstall", "--yes", *ours, external=True)
    version = next(dist.glob("torchbridge_core-*.whl")).name.split("-")[1]
    third_party = str(session.run("python", str(root / "tests/packaging/dists.py"),
                                  "requirements", str(dist), f"torchbridge[{extra}]",
                                  silent=True, log=False)).split()
    session.run(*pip, "install", "-c", str(venv / "constraints.txt"), *third_party,
                external=True)
    session.run(*pip, "install", "--no-index", "--find-links", str(dist),
                f"torchbridge[{extra}]=={version}", external=True)
    session.run(python, "-m", "pip", "check", external=True)
    session.run(str(venv / "bin" / "torchbridge"), "doctor", external=True)
    session.run(python, str(root / "tests/packaging/smoke.py"), "--version", version,
                "--plugins", plugins, "--levels", levels, "--also", adds, external=True)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site: `mkdocs build --strict` (every warning an error: a broken
    link, a missing page, an API reference entry mkdocstrings cannot resolve) into
    build/site. The packages are installed so that the generated pages (the configuration
    reference, from the pydantic models) see what a user's install has."""
    # mkdocstrings formats the separate signatures with ruff (or black).
    install_torchbridge(session, "mkdocs", "mkdocs-material", "mkdocstrings[python]", "ruff")
    session.run("mkdocs", "build", "--strict", "--site-dir", "build/site")


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
