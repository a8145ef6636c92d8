"""The host survives every kind of misbehaving third-party plugin.

The plugins live in two installed distributions with real entry points,
tests/misbehaving_plugins (`tb_misbehaving`, one module per failure class) and
tests/misbehaving_twin (`tb_misbehaving_twin`, whose entry-point name clashes with one of the
first). Both are inert unless TB_MISBEHAVING_PLUGINS=1, because they are installed next to
the rest of the test suite. The end-to-end checks run `torchbridge doctor` in subprocesses
with the gate open; the focused checks open it in this process (module fixture
`misbehaving`: purge the cached inert modules, set the variable, reload the plugins).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch
import torchbridge
from hang_bounds import HANG_S
from torchbridge.plugins import PluginRecord, plugin_records

pytest.importorskip("tb_misbehaving", reason="pip install -e tests/misbehaving_plugins")
pytest.importorskip("tb_misbehaving_twin", reason="pip install -e tests/misbehaving_twin")

GATE = "TB_MISBEHAVING_PLUGINS"
DIST = "torchbridge-misbehaving-plugins"
TWIN_DIST = "torchbridge-misbehaving-twin"
TWIN_MAIN, TWIN_OTHER = f"twin[{DIST}]", f"twin[{TWIN_DIST}]"
CPU_SHADOW = f"cpu[{DIST}]"  # the entry point named "cpu", registered under this name
# The detection deadline with the gate open: how long discovery waits for mb_detect_hang
# (once per process). 10x mb_detect_slow's 0.6 s, so that the slow hook is never late,
# however loaded the machine.
DETECT_TIMEOUT_S = "6"
CLI = Path(sys.executable).parent / "torchbridge"

# What doctor reveals: entry point -> (status, fragment of one of its errors, or of one of
# its warnings when the status is "loaded").
EXPECTED = {
    "mb_import_exit": ("failed", "at import: SystemExit: 3"),
    "mb_import_argparse": ("failed", "at import: SystemExit: 2"),
    "mb_import_reentrant": ("failed", "at import: PluginError: a plugin called back into "
                                      "torchbridge while loading plugins"),
    "mb_detect_exit": ("error", "in torchbridge_detect: SystemExit: mb_detect_exit"),
    "mb_detect_malformed": ("error", "in torchbridge_detect: mb_fake_cuda: claims"),
    "mb_detect_cpu": ("error", "in torchbridge_detect: the cpu backend is built in"),
    "mb_detect_reentrant": ("error", "in torchbridge_detect: PluginError: a plugin called "
                                     "back into torchbridge while discovering backends"),
    "mb_detect_wrapper": ("error", "in torchbridge_detect: wrappers are not supported"),
    "mb_typo": ("loaded", "implements torchbridge_detct, which is no torchbridge hook"),
    TWIN_MAIN: ("loaded", f"entry point name 'twin' is also used by {TWIN_DIST}"),
    TWIN_OTHER: ("loaded", f"entry point name 'twin' is also used by {DIST}"),
    "mb_config_no_default": ("error", "section hardware.strictless cannot be built from its "
                                      "defaults"),
    "mb_config_validator": ("error", "section hardware.grumpy cannot be built from its "
                                     "defaults"),
    "mb_config_cpu": ("error", "section hardware.cpu is already provided by plugin cpu"),
    "mb_config_reentrant": ("error", "PluginError: a plugin called back into torchbridge "
                                     "while building config sections"),
    "mb_passes_single": ("error", "returned OptimizationPass, expected a list"),
    "mb_passes_int": ("error", "returned int, expected a list"),
    "mb_passes_malformed": ("error", "in torchbridge_optimization_passes: pass 'mb_"),
    "mb_passes_exit": ("error", "in torchbridge_optimization_passes: SystemExit"),
    "mb_passes_veto_typo": ("loaded", "vetoes pass 'compiel', but no plugin offers"),
    "mb_device_override": ("error", "in torchbridge_device_info: returned dict, expected "
                                    "DeviceInfo"),
    "mb_badinfo": ("error", "in torchbridge_device_info: RuntimeError: badinfo: cannot "
                            "describe cpu:0"),
    "mb_kernel": ("error", "in torchbridge_kernel: returned 42, which is not callable"),
    "mb_detect_hang": ("error", "in torchbridge_detect: timed out after"),
    "mb_device_sick": ("error", "in torchbridge_device_info: RuntimeError: sick: cpu:0 does "
                                "not answer"),
    "mb_detect_many": ("error", "in torchbridge_detect: manycore: claims"),
    "mb_contract_old": ("incompatible", "written for plugin contract >=1,<3, but this "
                                        "torchbridge-core implements contract 3."),
    CPU_SHADOW: ("failed", "entry point name 'cpu' is the built-in plugin's"),
}
# Well-formed as far as doctor can tell: lax's section only misbehaves with bad values, and
# slowness is shown as such ("slow discovery"), not as an error.
# mb_passes_lying has its own gate (TB_LYING_PASSES) and is tested in tests/test_truth.py.
QUIET_IN_DOCTOR = {"mb_detect_slow", "mb_config_lax", "mb_passes_lying"}


# -- helpers and fixtures -------------------------------------------------------------------
def _purge_modules() -> None:
    for name in [m for m in sys.modules if m.startswith("tb_misbehaving")]:
        del sys.modules[name]


def records() -> dict[str, PluginRecord]:
    torchbridge.list_backends()  # discovery runs the isolated detect hooks
    return {r.name: r for r in plugin_records()}


def statuses() -> dict[str, torchbridge.BackendStatus]:
    return {s.name: s for s in torchbridge.list_backends()}


def messages(record: PluginRecord | dict[str, Any]) -> list[str]:
    """Every error a plugin record holds: `error` (the first) and `errors` (each distinct
    one), as records and doctor's JSON have them."""
    data = record if isinstance(record, dict) else record.to_dict()
    return list(dict.fromkeys(m for m in [data.get("error"), *(data.get("errors") or [])]
                              if m))


def recorded(record: PluginRecord | dict[str, Any], fragment: str) -> bool:
    return any(fragment in m for m in messages(record))


@pytest.fixture(scope="module")
def misbehaving() -> Iterator[None]:
    """Every misbehaving plugin active in this process, for the tests of this module."""
    with pytest.MonkeyPatch.context() as mp:
        for var in [v for v in os.environ if v.startswith("TORCHBRIDGE_")]:
            mp.delenv(var)
        mp.setenv(GATE, "1")
        mp.setenv("TORCHBRIDGE_DETECT_TIMEOUT", DETECT_TIMEOUT_S)
        _purge_modules()  # imported while inert: they would stay inert
        torchbridge.reload_plugins()
        yield
    _purge_modules()
    torchbridge.reload_plugins()  # inert again for the rest of the suite


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 8)).eval()


def relative_drift(model: torch.nn.Module, reference: torch.nn.Module, x: torch.Tensor
                   ) -> float:
    with torch.no_grad():
        out, ref = model(x).float(), reference(x).float()
    return float((out - ref).abs().max() / ref.abs().max())


INERT_SCRIPT = f"""
import json, tb_misbehaving, tb_misbehaving_twin, torchbridge
from torchbridge.plugins import get_plugin_host, plugin_records
host = get_plugin_host()
statuses = torchbridge.list_backends()
config = torchbridge.TorchBridgeConfig.load()
mine = [r for r in plugin_records() if r.distribution in ({DIST!r}, {TWIN_DIST!r})]
print(json.dumps({{
    "active": [tb_misbehaving.ACTIVE, tb_misbehaving_twin.ACTIVE],
    "records": [r.to_dict() for r in mine],
    "hooks": {{r.name: [c.name for c in host.pm.get_hookcallers(host.pm.get_plugin(r.name))
                        or []] for r in mine}},
    "backend_plugins": [s.plugin for s in statuses],
    "sections": list(config.hardware.model_dump()),
    "selected": torchbridge.get_backend().name,
}}))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The subprocess checks, run side by side: doctor as text and as JSON with the gate
    open, and a plain process with the gate closed."""
    cwd = tmp_path_factory.mktemp("misbehaving")  # no torchbridge.toml here
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBRIDGE_")
            and k != GATE}
    commands = {
        "text": ([str(CLI), "doctor"], {**base, GATE: "1",
                                        "TORCHBRIDGE_DETECT_TIMEOUT": DETECT_TIMEOUT_S}),
        "json": ([str(CLI), "doctor", "--json"], {**base, GATE: "1",
                                                  "TORCHBRIDGE_DETECT_TIMEOUT": DETECT_TIMEOUT_S}),
        "inert": ([sys.executable, "-c", INERT_SCRIPT], base),
    }
    procs = {name: subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, (cmd, env) in commands.items()}
    out: dict[str, dict[str, Any]] = {}
    for name, proc in procs.items():
        # Doctor not waiting for mb_detect_hang (an hour) is what this bound catches; how
        # long doctor takes is not judged (about 10 s alone, 40 s on a busy machine).
        try:
            stdout, stderr = proc.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            pytest.fail(f"{name}: still running after {HANG_S:.0f} s (waiting on the "
                        f"hung hook, or a deadlock)\n{stdout[-3000:]}\n{stderr[-3000:]}")
        out[name] = {"rc": proc.returncode, "stdout": stdout, "stderr": stderr}
    return out


def doctor_plugin_lines(text: str) -> dict[str, list[str]]:
    """The plugins part of doctor's text: name -> [its line, its error/warning lines]."""
    section = text.split("\nplugins:\n", 1)[1].split("\n\n", 1)[0]
    found: dict[str, list[str]] = {}
    current = ""
    for line in section.splitlines():
        if line.startswith("      "):
            found[current].append(line.strip())
        else:
            current = line.split()[0]
            found[current] = [line.strip()]
    return found


# -- the distributions ----------------------------------------------------------------------
def test_every_failure_class_has_an_expectation() -> None:
    declared = {ep.name for ep in metadata.distribution(DIST).entry_points}
    declared |= {ep.name for ep in metadata.distribution(TWIN_DIST).entry_points}
    expected = {*EXPECTED, *QUIET_IN_DOCTOR}
    expected = {name.split("[")[0] for name in expected}
    assert declared == expected


def test_inert_without_the_gate(runs: dict[str, dict[str, Any]]) -> None:
    run = runs["inert"]
    assert run["rc"] == 0, run["stderr"]
    report = json.loads(run["stdout"])
    assert report["active"] == [False, False]
    assert len(report["records"]) == len(EXPECTED) + len(QUIET_IN_DOCTOR)
    for record in report["records"]:
        if record["name"] == CPU_SHADOW:  # the name is the problem: not gated
            assert record["status"] == "failed" and record["module"] == \
                "tb_misbehaving.cpu_shadow", record
            continue
        assert record["status"] == "loaded", record
        assert messages(record) == [], record
        if record["name"].startswith("twin["):  # the name clash is not gated: it is the name
            assert len(record["warnings"]) == 1 and "also used by" in record["warnings"][0]
        else:
            assert record["warnings"] == [], record
    assert all(hooks == [] for hooks in report["hooks"].values()), report["hooks"]
    assert not {p for p in report["backend_plugins"] if p and p.startswith(("mb_", "twin"))}
    assert not {"strictless", "grumpy", "lax", "reentrant_section"} & set(report["sections"])
    assert report["selected"] == "cpu"
    assert "Traceback" not in run["stderr"]


# -- end to end: doctor with every misbehaving plugin active --------------------------------
def test_doctor_survives_every_misbehaving_plugin(runs: dict[str, dict[str, Any]]) -> None:
    text_run = runs["text"]
    for name in ("text", "json"):
        run = runs[name]
        assert run["rc"] == 0, run["stderr"][-3000:]
        assert "Traceback" not in run["stdout"] + run["stderr"]
    text = text_run["stdout"]
    assert "  backend: cpu (cpu, 1 device(s)), plugin cpu" in text
    lines = doctor_plugin_lines(text)
    for name, (status, fragment) in EXPECTED.items():
        shown = "\n".join(lines[name])
        assert lines[name][0].split()[1] == status, shown
        kind = "error: " if status != "loaded" else "warning: "
        assert any(line.startswith(kind) and fragment in line for line in lines[name]), shown
    for name in QUIET_IN_DOCTOR:
        assert lines[name][0].split()[1] == "loaded" and len(lines[name]) == 1, lines[name]
    slow = re.search(r"slow discovery: (\d+\.\d+) s", lines["mb_detect_slow"][0])
    assert slow is not None and float(slow.group(1)) >= 0.5, lines["mb_detect_slow"]
    backends = text.split("\nbackends (best first):\n", 1)[1]
    assert "slowpoke priority    1  unavailable: slowpoke: the pretend driver" in backends
    assert "badinfo  priority  -20  available, 1 device(s)" in backends


def test_doctor_json_records(runs: dict[str, dict[str, Any]]) -> None:
    report = json.loads(runs["json"]["stdout"])
    assert set(report) >= {"plugins", "backends", "contributions", "selected", "config",
                           "versions"}
    assert report["selected"]["name"] == "cpu"
    assert report["selected"]["answered_by"]["torchbridge_device_info"] == "cpu"
    assert report["versions"][DIST] == report["versions"][TWIN_DIST] == "0.0.1"
    plugins = {p["name"]: p for p in report["plugins"]}
    for name, (status, fragment) in EXPECTED.items():
        record = plugins[name]
        assert record["status"] == status, record
        if status == "loaded":
            assert messages(record) == [] and record["warnings"], record
            assert any(fragment in w for w in record["warnings"]), record
        else:
            assert recorded(record, fragment), record
    for name in QUIET_IN_DOCTOR:
        assert (plugins[name]["status"], messages(plugins[name]), plugins[name]["warnings"]) \
            == ("loaded", [], []), plugins[name]
    assert plugins["mb_detect_slow"]["detect_seconds"] >= 0.5
    assert plugins["mb_detect_slow"]["status"] == "loaded"
    assert plugins["mb_detect_slow"]["error"] is None
    backends = {b["name"]: b for b in report["backends"]}
    assert backends["slowpoke"]["available"] is False
    assert backends["slowpoke"]["detect_seconds"] >= 0.5
    assert backends["badinfo"]["available"] is True
    assert backends["cpu"]["available"] is True and backends["cpu"]["plugin"] == "cpu"
    offered = {b["name"] for b in report["backends"]}
    assert not offered & {"mb_reentrant", "mb_typo", "mb_hang", "contract_old"}
    for name in ("mb_priority_str", "mb_priority_none", "mb_available_str", "mb_zero_devices",
                 "mb_warpdrive", "mb_fake_cuda", "manycore"):  # rejected, shown by name
        assert backends[name]["available"] is False, backends[name]
        assert "its Detection was rejected: " in backends[name]["reason"], backends[name]
    assert next(b for b in report["backends"] if b["available"])["name"] == "sick"
    assert backends["sick"]["plugin"] == "mb_device_sick"
    assert "twin_one" in offered and "twin_two" in offered
    assert report["config"]["values"]["hardware"]["lax"] == {"batch_hint": 8, "label": "lax"}
    assert "hijacked" not in report["config"]["values"]["hardware"]["cpu"]
    assert not {"strictless", "grumpy", "reentrant_section"} \
        & set(report["config"]["values"]["hardware"])
    assert report["contributions"]["mb_config_lax"]["config_sections"] == ["hardware.lax"]
    assert "cpu" not in report["contributions"].get("mb_config_cpu", {}).get(
        "config_sections", [])
    # mb_kernel answers 42 for every op: skipped, so never listed as providing a kernel
    assert "kernels" not in report["contributions"].get("mb_kernel", {})
    assert "rms_norm:example_rms_norm on cpu" in report["contributions"]["example"]["kernels"]


# -- end to end in process: selection and prepare_model -------------------------------------
def test_cpu_is_selected_and_prepare_model_works(misbehaving: None) -> None:
    assert torchbridge.detect_best_backend() == "cpu"
    backend = torchbridge.get_backend()
    assert backend.name == "cpu"
    model, x = mlp(), torch.randn(8, 16)
    at_o0 = backend.prepare_model(model, "O0", strict=False)
    assert relative_drift(at_o0, model, x) <= 1e-6
    at_o2 = backend.prepare_model(model, "O2", strict=False)
    assert relative_drift(at_o2, model, x) <= 3e-2
    result = torchbridge.optimization_result(at_o2)
    assert any(p.name == "device_placement" and p.status == "applied" for p in result.passes)
    failed = {p.name for p in result.passes if p.status == "failed"}
    assert failed == {"mb_check_raises", "mb_apply_none"}
    assert torch.equal(model(x), mlp()(x))  # prepare_model left the caller's model alone


def test_strict_mode_turns_a_malformed_pass_into_model_optimization_error(
        misbehaving: None) -> None:
    backend = torchbridge.get_backend()
    with pytest.raises(torchbridge.ModelOptimizationError, match="mb_no_apply"):
        backend.prepare_model(mlp(), "O2", strict=True)
    with pytest.raises(torchbridge.ModelOptimizationError, match="mb_passes_malformed"):
        torchbridge.get_backend(config=torchbridge.TorchBridgeConfig(strict=True)
                                ).prepare_model(mlp(), "O0")


# -- import time ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mb_import_exit", "mb_import_argparse",
                                  "mb_import_reentrant"])
def test_import_time_failure(misbehaving: None, name: str) -> None:
    status, fragment = EXPECTED[name]
    record = records()[name]
    assert (record.status, record.group, record.distribution) == \
        (status, "torchbridge.backends", DIST)
    assert messages(record) and messages(record)[0].startswith(fragment), messages(record)
    assert f"tb_misbehaving.{record.module.rsplit('.', 1)[1]}" not in sys.modules  # type: ignore[union-attr]
    assert torchbridge.get_backend().name == "cpu"


# -- detection ------------------------------------------------------------------------------
def test_detect_raising_system_exit(misbehaving: None) -> None:
    record = records()["mb_detect_exit"]
    assert record.status == "error"
    assert set(messages(record)) == {"in torchbridge_detect: SystemExit: mb_detect_exit: "
                                     "detect hook exits the process"}
    assert statuses()["cpu"].available


@pytest.fixture(scope="module")
def malformed_discovery(misbehaving: None) -> dict[str, Any]:
    """The backends a fresh discovery offers."""
    return {s.name: s for s in torchbridge.list_backends(rescan=True)}


MALFORMED = [  # (index in tb_misbehaving.detect_malformed.malformed(), name, problem)
    (0, "mb_priority_str", "mb_priority_str: priority must be an int, got 'high'"),
    (1, "mb_priority_none", "mb_priority_none: priority must be an int, got None"),
    (2, None, "backend name must be lower-case letters, digits, '_' or '-', got None"),
    (3, "mb_available_str", "mb_available_str: available must be True or False, got 'no'"),
    (4, "mb_zero_devices", "mb_zero_devices: an available backend needs device_count >= 1, "
                           "got 0"),
    (5, "mb_warpdrive", "mb_warpdrive: device_type 'warpdrive' is not a torch device type"),
    (6, "mb_fake_cuda", "mb_fake_cuda: claims {fake_cuda} cuda device(s), but torch"),
]


@pytest.mark.parametrize(("index", "name", "problem"), MALFORMED,
                         ids=[name or "name_none" for _, name, _ in MALFORMED])
def test_malformed_detection_is_rejected(malformed_discovery: dict[str, Any], index: int,
                                         name: str | None, problem: str) -> None:
    from tb_misbehaving import detect_malformed
    from torchbridge.selection import detection_problem

    problem = problem.format(fake_cuda=detect_malformed.fake_cuda_count())
    if name == "mb_fake_cuda":
        assert detect_malformed.fake_cuda_count() == 1  # torch sees no cuda device here
    detection = detect_malformed.malformed()[index]
    assert problem in (detection_problem(detection, "mb_detect_malformed", False) or "")
    found = malformed_discovery
    if name is None:
        assert None not in found
    else:  # reported by name, unavailable, with the reason
        assert not found[name].available and found[name].plugin == "mb_detect_malformed"
        reason = found[name].reason or ""
        assert reason.startswith("plugin mb_detect_malformed reported it, but its Detection "
                                 "was rejected: "), reason
        assert problem.removeprefix(f"{name}: ") in reason
        with pytest.raises(torchbridge.BackendUnavailableError,
                           match=f"backend '{name}' is unavailable: plugin mb_detect_malformed "
                                 "reported it, but its Detection was rejected"):
            torchbridge.get_backend(name)
    assert found["cpu"].available and torchbridge.detect_best_backend() == "cpu"
    record = records()["mb_detect_malformed"]
    assert record.status == "error"
    expected = f"in torchbridge_detect: {problem}"
    assert any(m.startswith(expected) for m in messages(record)), messages(record)


def test_plugin_cannot_make_cpu_unavailable(misbehaving: None) -> None:
    record = records()["mb_detect_cpu"]
    assert record.status == "error"
    assert messages(record)[0] == ("in torchbridge_detect: the cpu backend is built in; a "
                                   "plugin cannot replace it or mark it unavailable")
    cpu = statuses()["cpu"]
    assert (cpu.available, cpu.plugin, cpu.reason, cpu.device_count) == (True, "cpu", None, 1)
    assert torchbridge.get_backend("cpu").get_device_info().backend == "cpu"


def test_reentrant_detect_is_a_plugin_error(misbehaving: None) -> None:
    found = torchbridge.list_backends(rescan=True)  # returns: no deadlock, no recursion
    record = records()["mb_detect_reentrant"]
    assert record.status == "error"
    assert messages(record)[0].startswith(
        "in torchbridge_detect: PluginError: a plugin called back into torchbridge while "
        "discovering backends"), messages(record)
    assert "mb_reentrant" not in {s.name for s in found}
    assert torchbridge.detect_best_backend() == "cpu"


def test_slow_detect_is_timed_not_failed(misbehaving: None) -> None:
    from tb_misbehaving.detect_slow import SLEEP_SECONDS

    slow = statuses()["slowpoke"]
    record = records()["mb_detect_slow"]
    assert (record.status, messages(record), record.warnings) == ("loaded", [], [])
    assert record.detect_seconds is not None and record.detect_seconds >= SLEEP_SECONDS - 0.1
    assert slow.detect_seconds is not None and slow.detect_seconds >= 0.5
    assert (slow.available, slow.plugin) == (False, "mb_detect_slow")
    with pytest.raises(torchbridge.BackendUnavailableError, match="the pretend driver"):
        torchbridge.get_backend("slowpoke")


def test_wrapper_detect_is_reported_and_ignored(misbehaving: None) -> None:
    torchbridge.list_backends(rescan=True)
    record = records()["mb_detect_wrapper"]
    assert record.status == "error"
    assert messages(record)[0] == ("in torchbridge_detect: wrappers are not supported on this "
                                   "hook; ignored")
    assert record.detect_seconds is None  # never called
    assert torchbridge.detect_best_backend() == "cpu"


# -- config sections ------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "section", "problem"), [
    ("mb_config_no_default", "strictless",
     "in torchbridge_config_section: section hardware.strictless cannot be built from its "
     "defaults (every field needs one): ValidationError"),
    ("mb_config_validator", "grumpy",
     "in torchbridge_config_section: section hardware.grumpy cannot be built from its "
     "defaults (every field needs one): RuntimeError: grumpy: no value is ever good enough"),
    ("mb_config_reentrant", "reentrant_section",
     "in torchbridge_config_section: PluginError: a plugin called back into torchbridge "
     "while building config sections"),
])
def test_broken_config_section_is_left_out(misbehaving: None, name: str, section: str,
                                           problem: str) -> None:
    config = torchbridge.TorchBridgeConfig.load()  # builds the sections: no deadlock
    record = records()[name]
    assert record.status == "error"
    assert messages(record)[0].startswith(problem), messages(record)
    assert not hasattr(config.hardware, section)
    # A section rejected by name says so, with why; one whose hook failed before naming
    # it cannot be told from a section nobody provides.
    with pytest.raises(torchbridge.ConfigurationError,
                       match=rf"hardware\.{section}\b.*(its section was rejected \(plugin "
                             rf"{name}: |no installed plugin provides)"):
        torchbridge.TorchBridgeConfig(hardware={section: {}})
    assert config.hardware.lax.batch_hint == 8  # the well-formed sections are all there
    assert torchbridge.get_backend(config=config).name == "cpu"


def test_config_section_cannot_take_the_cpu_name(misbehaving: None) -> None:
    from torchbridge.builtin.cpu.config import CPUConfig
    from torchbridge.config import hardware_sections

    config = torchbridge.TorchBridgeConfig.load()
    record = records()["mb_config_cpu"]
    assert record.status == "error"
    assert messages(record)[0] == ("in torchbridge_config_section: section hardware.cpu is "
                                   "already provided by plugin cpu")
    assert hardware_sections().owners["cpu"] == "cpu"
    assert isinstance(config.hardware.cpu, CPUConfig)
    assert "hijacked" not in config.hardware.cpu.model_dump()
    with pytest.raises(torchbridge.ConfigurationError, match=r"hardware\.cpu\.hijacked"):
        torchbridge.TorchBridgeConfig(hardware={"cpu": {"hijacked": True}})


def test_plain_basemodel_section_gets_config_section_rules(
        misbehaving: None, monkeypatch: pytest.MonkeyPatch) -> None:
    config = torchbridge.TorchBridgeConfig.load()
    lax = config.hardware.lax
    assert (lax.batch_hint, lax.label) == (8, "lax")
    assert isinstance(lax, torchbridge.ConfigSection)
    assert type(lax).__mro__[1].__module__ == "tb_misbehaving.config_lax"  # still theirs
    with pytest.raises(torchbridge.ConfigurationError) as unknown:
        torchbridge.TorchBridgeConfig(hardware={"lax": {"typo_key": 1}})
    assert "hardware.lax.typo_key" in str(unknown.value)
    assert unknown.value.field == "hardware.lax.typo_key"
    assert "section of plugin mb_config_lax" in str(unknown.value)
    with pytest.raises(torchbridge.ConfigurationError) as wrong_type:
        lax.batch_hint = "many"
    assert wrong_type.value.field == "hardware.lax.batch_hint"
    assert "hardware.lax.batch_hint" in str(wrong_type.value)
    assert lax.batch_hint == 8  # unchanged
    monkeypatch.setenv("TORCHBRIDGE_HARDWARE__LAX__TYPO_KEY", "1")
    with pytest.raises(torchbridge.ConfigurationError,
                       match=r"hardware\.lax\.typo_key\b.*environment variable"):
        torchbridge.TorchBridgeConfig.load()
    record = records()["mb_config_lax"]
    assert (record.status, messages(record)) == ("loaded", [])


# -- passes ---------------------------------------------------------------------------------
PASS_HOOK_FAILURES = [
    ("mb_passes_single", "in torchbridge_optimization_passes: returned OptimizationPass, "
                         "expected a list of OptimizationPass"),
    ("mb_passes_int", "in torchbridge_optimization_passes: returned int, expected a list of "
                      "OptimizationPass"),
    ("mb_passes_exit", "in torchbridge_optimization_passes: SystemExit: mb_passes_exit: no "
                       "passes for cpu, exiting instead"),
]


@pytest.mark.parametrize(("name", "problem"), PASS_HOOK_FAILURES)
def test_pass_hook_returning_garbage_or_exiting(misbehaving: None, name: str, problem: str
                                                ) -> None:
    result = torchbridge.get_backend().optimize(mlp(), "O1", strict=False)
    record = records()[name]
    assert record.status == "error" and problem in messages(record), messages(record)
    assert "mb_lonely" not in {p.name for p in result.passes}
    assert isinstance(result.model, torch.nn.Module)


@pytest.mark.parametrize(("name", "problem"), PASS_HOOK_FAILURES)
def test_pass_hook_failure_reaches_the_report_and_strict_mode(
        misbehaving: None, reload_plugins: None, monkeypatch: pytest.MonkeyPatch,
        name: str, problem: str) -> None:
    monkeypatch.setenv("TORCHBRIDGE_PLUGINS", name)  # this plugin alone, and the built-ins
    torchbridge.reload_plugins()
    backend = torchbridge.get_backend()
    result = backend.optimize(mlp(), "O1", strict=False)
    assert f"plugin {name}: {problem}" in result.notes
    with pytest.raises(torchbridge.ModelOptimizationError, match=name):
        backend.prepare_model(mlp(), "O1", strict=True)


def test_malformed_and_failing_passes(misbehaving: None) -> None:
    from tb_misbehaving.passes_malformed import passes

    model, x = mlp(), torch.randn(4, 16)
    result = torchbridge.get_backend().optimize(model, "O0", sample_input=x, strict=False)
    prefix = "plugin mb_passes_malformed: in torchbridge_optimization_passes: "
    for problem in ("pass 'mb_no_apply': apply must be callable, got None",
                    "pass 'mb_level_o7': min_level 'O7' is not O0-O3",
                    "pass 'mb_order_none': order must be a number, got None"):
        assert prefix + problem in result.notes, result.notes
    by_name = {p.name: p for p in result.passes}
    assert not {"mb_no_apply", "mb_level_o7", "mb_order_none"} & set(by_name)
    assert (by_name["mb_check_raises"].status, by_name["mb_check_raises"].detail) == \
        ("failed", "RuntimeError: mb_check_raises: the check exploded")
    assert by_name["mb_apply_none"].status == "failed"
    assert by_name["mb_apply_none"].detail.startswith("TypeError: apply returned NoneType")
    assert by_name["mb_apply_none"].plugin == "mb_passes_malformed"
    assert by_name["device_placement"].status == "applied"
    assert result.max_abs_diff == 0.0  # the failed passes were rolled back
    record = records()["mb_passes_malformed"]
    assert record.status == "error"
    for name in ("mb_no_apply", "mb_level_o7", "mb_order_none"):
        assert recorded(record, f"in torchbridge_optimization_passes: pass '{name}': ")
    assert len(passes()) == 5


def test_veto_naming_no_pass_is_a_warning(misbehaving: None) -> None:
    result = torchbridge.get_backend().optimize(mlp(), "O2", strict=False)
    message = ("vetoes pass 'compiel', but no plugin offers a pass of that name for backend "
               "'cpu'")
    assert any(n.startswith(f"plugin mb_passes_veto_typo {message}") for n in result.notes)
    record = records()["mb_passes_veto_typo"]
    assert (record.status, messages(record)) == ("loaded", [])
    assert any(w.startswith(message) for w in record.warnings), record.warnings
    compile_pass = next(p for p in result.passes if p.name == "compile")
    assert "vetoed" not in compile_pass.detail  # the misspelt veto hits nothing


# -- device-level hooks ---------------------------------------------------------------------
def test_owner_with_broken_device_hooks(misbehaving: None) -> None:
    backend = torchbridge.get_backend("badinfo")
    assert (backend.plugin, backend.fallbacks, backend.device_count) == ("mb_badinfo", (), 1)
    with pytest.raises(torchbridge.DeviceError) as info_error:
        backend.get_device_info()
    assert "no plugin answered torchbridge_device_info for cpu:0 of backend 'badinfo'" \
        in str(info_error.value)
    assert ("plugin mb_badinfo in torchbridge_device_info: RuntimeError: badinfo: cannot "
            "describe cpu:0, the driver is on fire") in str(info_error.value)
    stats = backend.get_memory_stats()
    assert isinstance(stats, torchbridge.MemoryStats)
    assert stats.total_bytes is None and stats.free_bytes is None
    # The note names this hook's problem, not the plugin's first error (device_info's).
    assert "no plugin answered torchbridge_memory_stats for cpu:0 of backend 'badinfo' " \
        "(plugin mb_badinfo, fallbacks: none); plugin mb_badinfo in torchbridge_memory_stats: " \
        "returned str, expected MemoryStats or None" in (stats.notes or ""), stats.notes
    record = records()["mb_badinfo"]
    assert record.status == "error"
    assert "in torchbridge_memory_stats: returned str, expected MemoryStats or None" \
        in messages(record)
    model, x = mlp(), torch.randn(4, 16)
    prepared = backend.prepare_model(model, "O0")
    assert relative_drift(prepared, model, x) <= 1e-6
    result = torchbridge.optimization_result(prepared)
    assert any(n.startswith("device description unavailable") for n in result.notes)
    assert torchbridge.get_backend().name == "cpu"


def test_override_answering_the_wrong_type_is_skipped(misbehaving: None) -> None:
    backend = torchbridge.get_backend("cpu")
    info = backend.get_device_info()
    assert isinstance(info, torchbridge.DeviceInfo)
    assert info.backend == "cpu" and info.name != "Totally Real Accelerator"
    assert backend.answered_by["torchbridge_device_info"] == "cpu"
    record = records()["mb_device_override"]
    assert record.status == "error"
    assert "in torchbridge_device_info: returned dict, expected DeviceInfo or None" \
        in messages(record)
    example = torchbridge.get_backend("example").get_device_info()
    assert example.name.startswith("Example Accelerator")  # the owner still answers


@pytest.mark.parametrize("op", ["silu_mul", "scaled_dot_product_attention"])
def test_kernel_answer_that_is_not_callable(misbehaving: None, op: str) -> None:
    from torchbridge.kernels import REFERENCE_KERNELS

    kernel = torchbridge.get_kernel(op)
    assert kernel.implementation is None and kernel.call is REFERENCE_KERNELS[op]
    record = records()["mb_kernel"]
    assert record.status == "error"
    assert "in torchbridge_kernel: returned 42, which is not callable" in messages(record)


def test_rms_norm_kernel_answer_that_is_not_callable(
        misbehaving: None, reload_plugins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.kernels import REFERENCE_KERNELS

    assert callable(torchbridge.get_kernel("rms_norm"))  # with the example plugin's kernel
    # Without the example plugin's tryfirst rms_norm, mb_kernel's answer is asked first.
    monkeypatch.setenv("TORCHBRIDGE_DISABLE_PLUGINS", "example")
    torchbridge.reload_plugins()
    assert messages(records()["mb_kernel"]) == []
    kernel = torchbridge.get_kernel("rms_norm")
    assert kernel.implementation is None and kernel.call is REFERENCE_KERNELS["rms_norm"]
    x = torch.randn(2, 8)
    assert torch.allclose(kernel(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert messages(records()["mb_kernel"]) == \
        ["in torchbridge_kernel: returned 42, which is not callable"]


# -- registration ---------------------------------------------------------------------------
def test_misnamed_and_undecorated_hooks_are_warnings(misbehaving: None) -> None:
    record = records()["mb_typo"]
    assert (record.status, messages(record)) == ("loaded", [])
    assert "implements torchbridge_detct, which is no torchbridge hook (a typo?); it is never " \
        "called" in record.warnings
    assert "torchbridge_synchronize is not decorated with @torchbridge.hookimpl; it is never " \
        "called" in record.warnings
    assert "mb_typo" not in statuses()  # its misnamed detect (priority 1000) is never called
    assert torchbridge.detect_best_backend() == "cpu"
    torchbridge.get_backend().synchronize()  # the undecorated synchronize is not asked


def test_duplicate_entry_point_names_across_distributions(misbehaving: None) -> None:
    found = records()
    assert "twin" not in found
    for name, dist, other, backend in ((TWIN_MAIN, DIST, TWIN_DIST, "twin_one"),
                                       (TWIN_OTHER, TWIN_DIST, DIST, "twin_two")):
        record = found[name]
        assert (record.status, messages(record), record.distribution) == ("loaded", [], dist)
        assert record.warnings == [f"entry point name 'twin' is also used by {other}; "
                                   f"registered as {name!r}"]
        status = statuses()[backend]
        assert (status.plugin, status.available) == (name, False)
        assert status.reason and status.reason.startswith(f"{backend}: ")


# -- contract v3: deadlines, health, device counts, the cpu name, contract ranges -----------
def test_hanging_detection_times_out_once_per_process(misbehaving: None,
                                                      reload_plugins: None) -> None:
    # The module's deadline, not a shorter one: a deadline only a fast machine meets would
    # time out the quick hooks too (and that is remembered for the rest of the process).
    started = time.perf_counter()
    found = statuses()  # mb_detect_hang timed out under the module's deadline, or now
    cpu = torchbridge.get_backend("cpu")
    assert cpu.name == "cpu" and torchbridge.detect_best_backend() == "cpu"
    record = records()["mb_detect_hang"]
    assert record.status == "error" and record.detect_timed_out
    assert any(m.startswith("in torchbridge_detect: timed out after ") and
               "not asked again in this process" in m for m in messages(record))
    assert "mb_hang" not in found
    hang = sys.modules["tb_misbehaving.detect_hang"]
    asked = hang.calls[0]
    assert asked >= 1
    for _ in range(3):  # a rescan, and a reload of the plugins, never wait again
        torchbridge.reload_plugins()
        torchbridge.list_backends(rescan=True)
        assert hang.calls[0] == asked  # not asked again: nothing to wait for
        assert records()["mb_detect_hang"].detect_timed_out
    # Only a hang catcher (waiting on the hook's hour); not waiting again is checked above
    # by the hook's call count, not by the clock.
    assert time.perf_counter() - started < HANG_S


def test_device_hooks_failing_pass_the_backend_over(misbehaving: None) -> None:
    torchbridge.list_backends(rescan=True)
    assert next(s for s in torchbridge.list_backends() if s.available).name == "sick"
    assert torchbridge.detect_best_backend() == "cpu"
    assert torchbridge.get_backend().name == "cpu"
    sick = statuses()["sick"]
    assert sick.available and sick.health is not None
    assert sick.health.startswith("its device hooks failed: DeviceError: no plugin answered "
                                  "torchbridge_device_info for cpu:0 of backend 'sick'")
    assert "RuntimeError: sick: cpu:0 does not answer" in sick.health
    assert torchbridge.get_backend("sick").name == "sick"  # asked by name, it still comes
    assert records()["mb_device_sick"].status == "error"


def test_device_count_beyond_the_host_is_rejected(misbehaving: None) -> None:
    from tb_misbehaving.detect_many import DEVICES

    manycore = statuses()["manycore"]
    assert not manycore.available
    assert f"claims {DEVICES} cpu-hosted device(s), but this host has" in (
        manycore.reason or "") or "no host has more than 64" in (manycore.reason or "")
    assert torchbridge.detect_best_backend() == "cpu"
    with pytest.raises(torchbridge.BackendUnavailableError, match=r"manycore.*rejected"):
        torchbridge.get_backend("manycore")


@pytest.mark.parametrize("disable", [None, "cpu", "cpu,example"])
def test_entry_point_named_cpu_cannot_replace_the_builtin(
        misbehaving: None, reload_plugins: None, monkeypatch: pytest.MonkeyPatch,
        disable: str | None) -> None:
    if disable:
        monkeypatch.setenv("TORCHBRIDGE_DISABLE_PLUGINS", disable)
    torchbridge.reload_plugins()
    found = records()
    assert found["cpu"].group == "builtin" and found["cpu"].status == "builtin"
    shadow = found[CPU_SHADOW]
    assert shadow.status == "failed" and "is the built-in plugin's" in (shadow.error or "")
    assert "tb_misbehaving.cpu_shadow" not in sys.modules  # never imported
    cpu = statuses()["cpu"]
    assert (cpu.available, cpu.plugin, cpu.device_count) == (True, "cpu", 1)
    assert torchbridge.get_backend("cpu").get_device_info().backend == "cpu"
    assert torchbridge.detect_best_backend() == "cpu"


def test_incompatible_contract_is_reported_not_run(misbehaving: None) -> None:
    record = records()["mb_contract_old"]
    assert (record.status, record.contract) == ("incompatible", ">=1,<3")
    assert "contract_old" not in statuses()
    host = torchbridge.plugins.get_plugin_host()
    assert host.pm.get_plugin("mb_contract_old") is None  # never registered
    assert torchbridge.detect_best_backend() == "cpu"
    with pytest.raises(torchbridge.BackendUnavailableError,
                       match="plugin mb_contract_old is incompatible: written for plugin "
                             "contract >=1,<3"):
        torchbridge.get_backend("mb_contract_old")


def test_disabled_plugin_is_reported_by_name(
        misbehaving: None, reload_plugins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    torchbridge.list_backends(rescan=True)
    assert statuses()["twin_one"].plugin == TWIN_MAIN
    monkeypatch.setenv("TORCHBRIDGE_DISABLE_PLUGINS", "example_backend,twin,mb_detect_exit")
    torchbridge.reload_plugins()
    with pytest.raises(torchbridge.BackendUnavailableError,
                       match="backend 'example' is unavailable: plugin example_backend is "
                             "disabled by TORCHBRIDGE_DISABLE_PLUGINS"):
        torchbridge.get_backend("example")
    with pytest.raises(torchbridge.BackendUnavailableError,  # named after its plugin
                       match="backend 'mb_detect_exit' is unavailable: plugin mb_detect_exit "
                             "is disabled by TORCHBRIDGE_DISABLE_PLUGINS"):
        torchbridge.get_backend("mb_detect_exit")
    twin = statuses()["twin_one"]  # reported earlier in this process, by a plugin now off
    assert not twin.available and "is disabled by TORCHBRIDGE_DISABLE_PLUGINS" in (
        twin.reason or "")
