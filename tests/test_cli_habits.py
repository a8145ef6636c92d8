"""The command line's habits: help written for users, did-you-mean for every name a user
types, bench's --backend/--level/--batch, a closed pipe and Ctrl-C without a traceback,
and one unit convention (binary MiB/GiB, named so) in what people read."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torchbridge import cli
from torchbridge.cli import main

HANG_BOUND = 300  # generous: only to catch a hang


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


# -- help -------------------------------------------------------------------------------------

def test_help_is_written_for_users(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "The only module that prints" not in text
    for command in ("doctor", "bench", "kernels", "validate", "launch"):
        assert re.search(rf"^\s+{command}\s+\S", text, re.MULTILINE), command
    assert "examples:" in text and "exit status:" in text and "141" in text


@pytest.mark.parametrize("command", ["doctor", "bench", "kernels", "validate"])
def test_each_command_has_a_description_and_examples(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]
    assert len(description.split()) >= 10, text  # a sentence or more, not a blank
    assert "examples:" in text and f"torchbridge {command}" in text.split("examples:")[1]


def test_bench_help_names_backend_level_and_batch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    for option in ("--backend NAME", "--level LEVEL", "--batch N"):
        assert option in text


# -- did you mean -------------------------------------------------------------------------------

SUGGESTED = [
    (["doctr"], "unknown command 'doctr'; the commands are doctor, bench, kernels, "
                "validate, launch; did you mean 'doctor'?"),
    (["doctor", "--jsn"], "unrecognized arguments: --jsn; did you mean --json?"),
    (["bench", "--models", "convnt"], "did you mean 'convnet'?"),
    (["bench", "--level", "O4"], "unknown optimization level 'O4'; choose one of O0, O1, "
                                 "O2, O3, none, conservative, balanced, aggressive (O3 is "
                                 "the highest)"),
    (["bench", "--level", "O1,o3x"], "unknown optimization level 'o3x'; choose one of O0, "
                                     "O1, O2, O3, none, conservative, balanced, aggressive; "
                                     "did you mean 'O3'?"),
    (["validate", "--level", "balancd"], "did you mean 'balanced'?"),
    (["validate", "--backends", "cpu,cdua"], "unknown backend 'cdua'; known backends: "),
    (["kernels", "--backend", "cdua"], "unknown backend 'cdua'"),
    (["bench", "--backend", "cdua"], "unknown backend 'cdua'"),
    (["validate", "--model", "mpl"], "unknown model 'mpl'; the models are mlp, convnet, "
                                     "encoder, decoder_lm, or give package.module:function "
                                     "returning (model, sample_input); did you mean 'mlp'?"),
]


@pytest.mark.parametrize(("argv", "message"), SUGGESTED, ids=[" ".join(a) for a, _ in SUGGESTED])
def test_a_misspelt_name_gets_the_nearest_one(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge import bench

    monkeypatch.setattr(bench, "run", lambda **kwargs: pytest.fail("bench ran"))
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert message in line, line
    if "backend 'cdua'" in message:
        assert line.endswith("did you mean 'cuda'?"), line


def test_validate_complains_about_the_model_before_the_backends(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--model", "nosuch", "--backends", "cpu,nosuch"]) == 2
    line = one_error_line(capsys)
    assert "unknown model 'nosuch'; the models are mlp, convnet, encoder, decoder_lm" in line
    assert "backend" not in line


def test_the_cli_knows_the_models_the_library_has() -> None:
    from torchbridge.models import reference_models

    assert tuple(r.name for r in reference_models(scale=0.25)) == cli.SUITES["reference"]


def test_a_misspelt_config_key_is_named_with_the_nearest_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "torchbridge.toml").write_text("optimization_levle = 'O1'\n")
    assert main(["validate", "--backends", "cpu,example"]) == 2
    line = one_error_line(capsys)
    assert line == ("torchbridge validate: error: unknown config key 'optimization_levle' "
                    f"(from {tmp_path / 'torchbridge.toml'}); did you mean "
                    "'optimization_level'?")
    (tmp_path / "torchbridge.toml").unlink()
    monkeypatch.setenv("TORCHBRIDGE_OPTIMIZATION__DISABLED_PASES", '["fuse"]')
    assert main(["validate", "--backends", "cpu,example"]) == 2
    assert one_error_line(capsys).endswith(
        "did you mean TORCHBRIDGE_OPTIMIZATION__DISABLED_PASSES?")


# -- bench's options ----------------------------------------------------------------------------

def test_bench_passes_backend_levels_and_batch(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from torchbridge import bench

    calls: list[dict[str, Any]] = []

    def run(**kwargs: Any) -> dict[str, Any]:
        calls.append(kwargs)
        return {"rows": []}

    monkeypatch.setattr(bench, "run", run)
    monkeypatch.setattr(bench, "render", lambda report: "the table")
    argv = ["bench", "--models", "mlp", "--backend", "cpu", "--level", "O1",
            "--level", "aggressive,O2,O1", "--batch", "8"]
    assert main(argv) == 0
    assert calls == [{"models": ["mlp"], "suite": "reference", "backend": "cpu",
                      "levels": ["O1", "O3", "O2"], "batch": 8}]
    captured = capsys.readouterr()
    assert captured.out.strip() == "the table"
    assert "\r" not in captured.err  # no hand-drawn progress frames in a log file
    calls.clear()
    assert main(["bench"]) == 0
    assert calls == [{"models": None, "suite": "reference", "backend": None, "levels": None,
                      "batch": None}]


@pytest.mark.parametrize(("argv", "problem"), [
    (["bench", "--batch", "0"], "--batch: must be a positive integer"),
    (["bench", "--level", ""], "expected levels such as O2 or O1,O3"),
    (["bench", "--level", "O1,,O2"], "expected levels such as O2 or O1,O3"),
    (["bench", "--backend", "cuda"], "backend 'cuda' is unavailable"),
])
def test_bench_options_are_checked_before_it_runs(
        argv: list[str], problem: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from torchbridge import bench

    monkeypatch.setattr(bench, "run", lambda **kwargs: pytest.fail("bench ran"))
    assert main(argv) == 2
    assert problem in one_error_line(capsys)


# -- a closed pipe, Ctrl-C ------------------------------------------------------------------

def run_into_a_closed_pipe(*words: str) -> subprocess.CompletedProcess[str]:
    """`torchbridge WORDS | head -c 0`, deterministically: the reading end is closed before
    the command starts, so its first write finds no reader."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "torchbridge", *words], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=HANG_BOUND)
    finally:
        os.close(write_end)


# argparse prints --help itself and ignores a failed write (its own choice): quiet, 0.
@pytest.mark.parametrize(("words", "status"), [(["--version"], 141), (["--help"], 0),
                                               (["doctor", "--json"], 141)])
def test_a_closed_pipe_exits_quietly_with_141(words: list[str], status: int) -> None:
    done = run_into_a_closed_pipe(*words)
    assert done.returncode == status
    assert cli.EXIT_CLOSED_PIPE == 141
    own = [line for line in done.stderr.splitlines()
           if not line.startswith(("WARNING torchbridge.plugins: ",))]
    assert own == [], done.stderr


def test_ctrl_c_is_one_line_and_exit_status_130(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_doctor", interrupted)
    assert main(["doctor"]) == 130
    assert one_error_line(capsys) == "torchbridge doctor: interrupted"
    assert main(["doctor", "--debug"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().endswith("torchbridge doctor: interrupted")


def test_a_broken_pipe_inside_a_command_is_quiet(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    def closed(args: object) -> int:
        raise BrokenPipeError

    monkeypatch.setattr(cli, "_doctor", closed)
    assert main(["doctor"]) == 141
    assert capsys.readouterr().err == ""


# -- units --------------------------------------------------------------------------------------

def test_doctor_prints_memory_in_gib(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    memory = next(line for line in capsys.readouterr().out.splitlines()
                  if line.strip().startswith("memory:"))
    assert re.search(r"total \d+\.\d\d GiB$", memory), memory
    assert " MB" not in memory and " GB" not in memory
