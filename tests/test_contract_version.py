"""The plugin contract is versioned: CONTRACT_VERSION, the TORCHBRIDGE_CONTRACT ranges a
plugin may declare, deprecation warnings, and the packages' versions kept in step."""

from __future__ import annotations

import re
import sys
import types
import warnings
from importlib import metadata
from pathlib import Path

import pytest
import torchbridge
from torchbridge.plugins import PluginHost, PluginRecord, contract_problem, deprecated

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECTS = [ROOT / "pyproject.toml", ROOT / "torchbridge-core" / "pyproject.toml",
              *sorted((ROOT / "plugins").glob("*/pyproject.toml"))]


def test_contract_version_is_semantic() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", torchbridge.CONTRACT_VERSION)
    assert torchbridge.CONTRACT_VERSION.startswith("3.")
    assert "CONTRACT_VERSION" in torchbridge.__all__


@pytest.mark.parametrize(("spec", "ok"), [
    (">=3,<4", True), (">=3", True), (">=3.0,<3.1", True), ("==3.*", True), ("~=3.0", True),
    ("<4", True), ("!=2.*", True), (" >= 3 , < 4 ", True),
    (">=1,<3", False), (">=4", False), ("==2.*", False), ("<3", False), ("~=3.1", False),
    ("!=3.*", False), (">3", False),
])
def test_contract_ranges(spec: str, ok: bool) -> None:
    problem = contract_problem(spec, "3.0.0")
    assert (problem is None) is ok, problem
    if not ok:
        assert problem == (f"written for plugin contract {spec.strip()}, but this "
                           "torchbridge-core implements contract 3.0.0")


@pytest.mark.parametrize("spec", ["", "3", ">=three", ">=3;<4", ">=3.*", "~=3", 3, None])
def test_unreadable_contract_range(spec: object) -> None:
    with pytest.raises(ValueError, match=r"TORCHBRIDGE_CONTRACT|version"):
        contract_problem(spec)


def _host_with(module: types.ModuleType) -> tuple[PluginHost, PluginRecord]:
    host = object.__new__(PluginHost)
    host.pm = torchbridge.plugins.get_plugin_host().pm.__class__("torchbridge")
    host.records, host.generation = {}, 0
    record = PluginRecord("probe", "torchbridge.backends", "loaded", "probe-dist", "1.0")
    host._register_checked(module, record)
    return host, record


def test_plugin_outside_its_range_is_incompatible_and_not_registered() -> None:
    old = types.ModuleType("old_plugin")
    old.TORCHBRIDGE_CONTRACT = ">=1,<3"  # type: ignore[attr-defined]
    host, record = _host_with(old)
    assert record.status == "incompatible" and record.contract == ">=1,<3"
    assert "written for plugin contract >=1,<3" in (record.error or "")
    assert host.pm.get_plugin("probe") is None
    current = types.ModuleType("current_plugin")
    current.TORCHBRIDGE_CONTRACT = ">=3,<4"  # type: ignore[attr-defined]
    host, record = _host_with(current)
    assert record.status == "loaded" and host.pm.get_plugin("probe") is current
    broken = types.ModuleType("broken_plugin")
    broken.TORCHBRIDGE_CONTRACT = "three"  # type: ignore[attr-defined]
    host, record = _host_with(broken)
    assert record.status == "failed" and "TORCHBRIDGE_CONTRACT" in (record.error or "")


def test_deprecated_names_the_plugin_and_what_to_change() -> None:
    with pytest.warns(DeprecationWarning) as caught:
        message = deprecated("acme", "torchbridge_old_hook", "implement torchbridge_new_hook")
    assert str(caught[0].message) == message
    assert message.startswith("plugin acme: torchbridge_old_hook; this is deprecated and "
                              "changes in plugin contract 4.0.0")
    assert message.endswith(": implement torchbridge_new_hook")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DeprecationWarning):
            deprecated("acme", "x", "y", removed_in="3.1.0")


def test_versions_are_in_step() -> None:
    versions = {}
    for path in PYPROJECTS:
        project = tomllib.loads(path.read_text())["project"]
        # The core's version is dynamic: read from torchbridge._SOURCE_VERSION.
        versions[project["name"]] = project.get("version", torchbridge._SOURCE_VERSION)
        for dep in project.get("dependencies", []) + [
                d for extra in project.get("optional-dependencies", {}).values() for d in extra]:
            match = re.match(r"torchbridge-[a-z]+(?:\[\w+\])?\s*(==|>=)\s*([\d.]+)", dep)
            if match:
                assert match.group(2) == torchbridge._SOURCE_VERSION, (path, dep)
    assert set(versions.values()) == {torchbridge._SOURCE_VERSION}, versions
    assert len(versions) == 6
    assert torchbridge.__version__ == metadata.version("torchbridge-core")


def test_detect_timeout_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.selection import DEFAULT_DETECT_TIMEOUT, detect_timeout

    monkeypatch.delenv("TORCHBRIDGE_DETECT_TIMEOUT", raising=False)
    assert detect_timeout() == DEFAULT_DETECT_TIMEOUT == 5.0
    monkeypatch.setenv("TORCHBRIDGE_DETECT_TIMEOUT", "0.5")
    assert detect_timeout() == 0.5
    torchbridge.TorchBridgeConfig.load()  # not a config field: the loader reads it
    monkeypatch.setenv("TORCHBRIDGE_DETECT_TIMEOUT", "0")
    assert detect_timeout() is None
    monkeypatch.setenv("TORCHBRIDGE_DETECT_TIMEOUT", "soon")
    with pytest.raises(torchbridge.ConfigurationError, match="TORCHBRIDGE_DETECT_TIMEOUT"):
        detect_timeout()
