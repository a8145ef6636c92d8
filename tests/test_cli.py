from __future__ import annotations

import json
import subprocess
import sys

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
    assert "strict = 'maybe' (from environment variable TORCHBRIDGE_STRICT)" in out


def test_console_script_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "torchbridge", "doctor", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["selected"]["name"] == "cpu"
