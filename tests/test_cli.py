from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchbridge.cli import main


def test_doctor_text(capsys: pytest.CaptureFixture[str], no_cuda_reason: str) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "backend: cpu" in out
    for vendor in ("nvidia", "amd", "intel", "tpu"):
        assert f"torchbridge-{vendor}" in out
    assert "broken_import" in out and "ImportError" in out
    assert no_cuda_reason in out


def test_doctor_json_shows_config_sources(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TORCHBRIDGE_OPTIMIZATION_LEVEL", "O1")
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["selected"]["name"] == "cpu"
    assert report["selected"]["memory"]["allocated_bytes"] is None
    backends = {b["name"]: b for b in report["backends"]}
    assert all(not backends[n]["available"] and backends[n]["reason"]
               for n in ("cuda", "rocm", "xpu", "tpu"))
    assert report["config"]["non_default"]["optimization_level"] == {
        "value": "O1", "source": "environment variable TORCHBRIDGE_OPTIMIZATION_LEVEL"}
    plugins = {p["name"]: p for p in report["plugins"]}
    assert plugins["broken_detect"]["status"] == "error"


def test_doctor_reports_a_bad_config_instead_of_crashing(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    monkeypatch.setenv("TORCHBRIDGE_STRICT", "maybe")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert ("config key 'strict' must be true or false, got 'maybe' (from environment "
            "variable TORCHBRIDGE_STRICT)") in out


def test_console_script_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "torchbridge", "doctor", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["selected"]["name"] == "cpu"


# -- ordinary mistakes: one line, exit status 2, no traceback -------------------------------

MISTAKES = [
    (["validate", "--level", "O9"], "unknown optimization level 'O9'"),
    (["validate", "--backends", "cpu,nosuch"], "unknown backend 'nosuch'"),
    (["validate", "--backends", "cpu,,example"], "comma-separated backend names"),
    (["validate", "--backends", "cpu,cpu:\u00b2"], "bad device index"),
    (["validate", "--model", "nosuch.mod:f"], "cannot import nosuch.mod"),
    (["validate", "--model", "os:no_such_function"], "has no function 'no_such_function'"),
    (["validate", "--model", "os:getcwd"], "must return (model, sample_input)"),
    (["validate", "--model", ":f"], "expected package.module:function"),
    (["validate", "--model", "resnet"], "unknown model 'resnet'"),
    (["validate", "--batch", "-3"], "--batch: must be a positive integer"),
    (["validate", "--batch", "0"], "--batch: must be a positive integer"),
    (["validate", "--tolerance", "nan"], "--tolerance: must be finite and positive"),
    (["validate", "--tolerance", "inf"], "--tolerance: must be finite and positive"),
    (["validate", "--tolerance", "-1"], "--tolerance: must be finite and positive"),
    (["validate", "--tolerance", "0"], "--tolerance: must be finite and positive"),
    (["validate", "--backends", "cpu"], "at least two usable backends, but has only 1 (cpu)"),
    # Compared with itself, a backend passed whatever it computed.
    (["validate", "--backends", "cpu,cpu"], "cpu name one device more than once in "
     "'cpu,cpu'"),
    (["validate", "--backends", "cpu,CPU:0"], "CPU:0, cpu name one device more than once"),
    (["validate", "--backends", "cpu,cuda"], "backend 'cuda' is unavailable"),
    (["validate", "--backends", "cuda,cpu"], "the reference backend (the first) cannot run"),
    (["validate", "--backends", "cpu,example:5"], "example has 2 device(s); index 5"),
    (["bench", "--models", "resnet"], "not in the reference suite"),
    (["bench", "--models", "vgg"], "invalid choice: 'vgg'"),
    (["frobnicate"], "unknown command 'frobnicate'; the commands are doctor, bench"),
]


@pytest.mark.parametrize(("argv", "problem"), MISTAKES, ids=[" ".join(m[0]) for m in MISTAKES])
def test_an_ordinary_mistake_is_one_line_and_exit_status_2(
        argv: list[str], problem: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge import validation

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("validate ran despite a bad argument")

    monkeypatch.setattr(validation, "validate", must_not_run)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and problem in lines[0], captured.err
    assert "Traceback" not in captured.err


def test_a_bad_environment_variable_is_one_line_for_every_working_command(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from torchbridge import bench

    monkeypatch.setenv("TORCHBRIDGE_HARDWARE__CPU__NUM_THREADS", "4294967296")
    monkeypatch.setattr(bench, "run", lambda **kwargs: pytest.fail("bench ran"))
    for argv in (["validate", "--backends", "cpu,example"], ["bench"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "TORCHBRIDGE_HARDWARE__CPU__NUM_THREADS" in err and "\n" not in err


def test_debug_shows_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--backends", "cpu,nosuch", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1].startswith("torchbridge validate: error: unknown")
    assert main(["--debug", "validate", "--batch", "-1"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_the_benchmark_runs(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    from torchbridge import bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setattr(bench, "run", lambda **kwargs: pytest.fail("the benchmark ran"))
    assert main(["bench", "--plot", str(tmp_path / "chart.png")]) == 2
    assert capsys.readouterr().err.strip() == \
        "torchbridge bench: error: --plot needs matplotlib: pip install matplotlib"


def test_validate_with_a_module_function_from_the_working_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    monkeypatch.delitem(sys.modules, "my_models", raising=False)
    (tmp_path / "my_models.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Linear(4, 2), torch.randn(3, 4)\n"
        "def broken():\n"
        "    raise RuntimeError('no weights here')\n"
        "def misfit():\n"
        "    return torch.nn.Linear(4, 2), torch.randn(3, 5)\n")
    assert main(["validate", "--model", "my_models:build", "--backends", "cpu,example"]) == 0
    assert "PASSED" in capsys.readouterr().out
    assert main(["validate", "--model", "my_models:broken", "--backends", "cpu,example"]) == 2
    assert "the function raised RuntimeError: no weights here" in capsys.readouterr().err
    assert main(["validate", "--model", "my_models:misfit", "--backends", "cpu,example"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("torchbridge validate: error: --model my_models:misfit: the "
                          "reference backend cpu failed") and "\n" not in err, err


def test_version_flags_print_the_version_and_the_contract(
        capsys: pytest.CaptureFixture[str]) -> None:
    import torchbridge
    from torchbridge.cli import main

    for flag in ("--version", "-V"):
        assert main([flag]) == 0
        line = capsys.readouterr().out.strip()
        assert line.startswith(f"torchbridge {torchbridge.__version__}")
        contract = getattr(torchbridge, "CONTRACT_VERSION", None)
        assert (f"plugin contract {contract}" in line) if contract else line.count(" ") == 1
