"""More of the config telling the truth: a section name stays with the plugin that provided
it first, a config file or variable that is not read is named, a section shared between two
configs does not make one's `sources` lie, a config older than a plugin still gives that
plugin's backend its section, and configs compare by their values."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest
import torch
import torchbridge
from pydantic import BaseModel
from torchbridge import ConfigSection, ConfigurationError, TorchBridgeConfig
from torchbridge.config import MemoryConfig, find_config_file, hardware_sections
from torchbridge.plugins import plugin_records

DOCS = Path(__file__).resolve().parents[1] / "docs" / "guide" / "configuration.md"


def _record(name: str) -> torchbridge.plugins.PluginRecord:
    return next(r for r in plugin_records() if r.name == name)


def _docs() -> str:
    return " ".join(DOCS.read_text(encoding="utf-8").split())


# --- 2: a section name stays with the plugin that provided it first -----------------


def _section_plugin(section: str, model: type[BaseModel], tryfirst: bool = False) -> object:
    class Plugin:
        @torchbridge.hookimpl(tryfirst=tryfirst)
        def torchbridge_config_section(self) -> tuple[str, type[BaseModel]]:
            return section, model

    return Plugin()


class _FirstZeta(ConfigSection):
    a: int = 1


class _SecondZeta(ConfigSection):
    b: int = 2


@pytest.mark.parametrize("tryfirst", [False, True])
def test_a_section_stays_with_the_plugin_registered_first(reload_plugins: None,
                                                          tryfirst: bool) -> None:
    # Before: pluggy calls the latest registered plugin first, and the first to answer
    # took the name: `second` got hardware.zeta and `first` was the one reported.
    torchbridge.register_plugin(_section_plugin("zeta", _FirstZeta), name="first")
    torchbridge.register_plugin(_section_plugin("zeta", _SecondZeta, tryfirst),
                                name="second")
    assert hardware_sections().owners["zeta"] == "first"
    config = TorchBridgeConfig(hardware={"zeta": {"a": 5}})
    assert config.hardware.zeta.a == 5
    assert _record("first").errors == []
    assert _record("second").status == "error"
    assert "section hardware.zeta is already provided by plugin first" in \
        " ".join(_record("second").errors)


def test_an_installed_plugins_section_is_not_taken_by_a_runtime_plugin(
        reload_plugins: None) -> None:
    # The adversarial repro: a plugin registered at run time took hardware.nvidia, and
    # the user's nvidia settings were refused as keys of the newcomer's section.
    owner = hardware_sections().owners.get("example")
    if owner is None:
        pytest.skip("the example plugin (tests/example_plugin) is not installed here")
    assert _record(owner).group.startswith("torchbridge.")   # an installed entry point
    installed = type(TorchBridgeConfig().hardware.example)
    torchbridge.register_plugin(_section_plugin("example", _SecondZeta), name="taker")
    assert hardware_sections().owners["example"] == owner
    config = TorchBridgeConfig(hardware={"example": {"greeting": "hej"}})
    assert type(config.hardware.example) is installed
    assert config.hardware.example.greeting == "hej"
    assert f"already provided by plugin {owner}" in " ".join(_record("taker").errors)
    assert not any("already provided" in e for e in _record(owner).errors)


# --- 5: torchbridge.toml next to a pyproject.toml with [tool.torchbridge] -----------


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config's warnings are logged once per process: these tests look for them."""
    monkeypatch.setattr("torchbridge.config._warned", set())


def test_a_pyproject_hidden_by_torchbridge_toml_is_named(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, fresh_warnings: None) -> None:
    # Before: the pyproject's settings were dropped without a word.
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\n[tool.torchbridge]\nstrict = true\n')
    toml = tmp_path / "torchbridge.toml"
    toml.write_text('optimization_level = "O1"\n')
    with caplog.at_level(logging.WARNING, logger="torchbridge.config"):
        config = TorchBridgeConfig.load(environ={})
    # The documented precedence holds: torchbridge.toml is read, the pyproject is not.
    assert config.optimization_level == "O1" and config.strict is False
    assert config.sources == {"optimization_level": str(toml)}
    assert list(config.ignored_sources) == [str(pyproject)]
    assert str(toml) in config.ignored_sources[str(pyproject)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(pyproject) in w and "[tool.torchbridge] is not read" in w
               for w in warnings), warnings
    # Said in every config, logged once (a config is loaded on each get_backend()).
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchbridge.config"):
        assert TorchBridgeConfig.load(environ={}).ignored_sources == config.ignored_sources
    assert not caplog.records
    # It travels with the config (a spawned worker's doctor can say it too).
    assert pickle.loads(pickle.dumps(config)).ignored_sources == config.ignored_sources
    assert find_config_file(tmp_path, environ={}) == toml
    assert "One file is read" in _docs() and "config.ignored_sources" in _docs()


def test_doctor_names_a_config_source_that_was_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reload_plugins: None) -> None:
    # doctor runs with warnings off: the ignored pyproject.toml is said in its config part.
    from torchbridge import doctor

    (tmp_path / "pyproject.toml").write_text("[tool.torchbridge]\nstrict = true\n")
    (tmp_path / "torchbridge.toml").write_text('optimization_level = "O1"\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHBRIDGE_PLUGINS", "none_here")  # only the built-ins: quick
    torchbridge.reload_plugins()
    report = doctor.collect()
    assert list(report["config"]["ignored"]) == [str(tmp_path / "pyproject.toml")]
    config_part = doctor.render(report).split("\nconfig:\n", 1)[1]
    assert f"  ignored: {tmp_path / 'pyproject.toml'}: its [tool.torchbridge] is not " \
           "read" in config_part


def test_a_pyproject_that_only_depends_on_torchbridge_is_not_named(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, fresh_warnings: None) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\ndependencies = ["torchbridge-core"]\n')
    (tmp_path / "torchbridge.toml").write_text('optimization_level = "O1"\n')
    with caplog.at_level(logging.WARNING, logger="torchbridge.config"):
        config = TorchBridgeConfig.load(environ={})
    assert config.ignored_sources == {}
    assert not [r for r in caplog.records if r.name == "torchbridge.config"]


def test_a_broken_pyproject_next_to_torchbridge_toml_still_loads(tmp_path: Path) -> None:
    # It was never read with a torchbridge.toml there; looking at it must not break that.
    (tmp_path / "pyproject.toml").write_text("[tool.torchbridge\nstrict = ")
    (tmp_path / "torchbridge.toml").write_text('optimization_level = "O1"\n')
    config = TorchBridgeConfig.load(environ={})
    assert config.optimization_level == "O1" and config.ignored_sources == {}


# --- 6: a variable whose prefix is not upper case -----------------------------------


def test_a_lower_case_prefix_is_named_not_silently_ignored(
        caplog: pytest.LogCaptureFixture, fresh_warnings: None) -> None:
    # Before: ignored without a word (doctor: "all values are defaults") while the docs
    # said variable names match "whatever their case".
    with caplog.at_level(logging.WARNING, logger="torchbridge.config"):
        config = TorchBridgeConfig.load(environ={"torchbridge_strict": "1",
                                                 "TorchBridge_Precision": "bf16",
                                                 "TORCHBRIDGE_logging_level": "INFO"})
    # The documented rule: the prefix in capitals, the rest in any case.
    assert config.strict is False and config.precision == "auto"
    assert config.logging_level == "INFO"
    assert set(config.ignored_sources) == {"environment variable torchbridge_strict",
                                           "environment variable TorchBridge_Precision"}
    assert "TORCHBRIDGE_STRICT" in config.ignored_sources[
        "environment variable torchbridge_strict"]
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "torchbridge_strict" in warnings and "TORCHBRIDGE_STRICT" in warnings
    assert "The prefix is `TORCHBRIDGE_` in capitals" in _docs()


# --- 7: a section shared between two configs; the backend's config -----------------


def test_assigning_another_configs_section_assigns_a_copy() -> None:
    # Before: `b.memory = a.memory` left one object in both configs, bound to b only: an
    # assignment through `a` changed a's value and was credited to b.
    a, b = TorchBridgeConfig(), TorchBridgeConfig()
    b.memory = a.memory
    assert b.memory is not a.memory and b.memory == a.memory
    a.memory.max_memory_fraction = 0.5
    assert a.sources == {"memory.max_memory_fraction": "assignment"}
    assert b.memory.max_memory_fraction is None
    assert b.sources == {"memory": "assignment"}
    b.memory.oom_safety_margin = 2.0
    assert b.sources == {"memory": "assignment", "memory.oom_safety_margin": "assignment"}
    assert a.memory.oom_safety_margin == 1.1


def test_a_section_of_another_config_given_to_a_constructor_or_in_a_dict_is_copied() -> None:
    a = TorchBridgeConfig()
    b = TorchBridgeConfig(memory=a.memory)   # before: this re-bound a.memory to b
    c = TorchBridgeConfig()
    c.hardware = {"cpu": a.hardware.cpu}
    assert b.memory is not a.memory and c.hardware.cpu is not a.hardware.cpu
    a.memory.max_memory_fraction = 0.5
    a.hardware.cpu.num_threads = 2
    assert a.sources == {"memory.max_memory_fraction": "assignment",
                         "hardware.cpu.num_threads": "assignment"}
    assert b.memory.max_memory_fraction is None and c.hardware.cpu.num_threads is None
    # A section taken out of its config, or never in one, is still assigned as it is.
    free = MemoryConfig(max_memory_fraction=0.25)
    b.memory = free
    assert b.memory is free
    free.oom_safety_margin = 3.0
    assert b.sources["memory.oom_safety_margin"] == "assignment"


def test_process_settings_are_applied_when_a_backend_is_created() -> None:
    # The documented answer to "backend.config says 2 threads, torch runs 1": the config
    # is the caller's object, read live, and its process-wide settings are applied when
    # a backend is created. This pins that behaviour and that the docs say it.
    before = torch.get_num_threads()
    try:
        config = TorchBridgeConfig(hardware={"cpu": {"num_threads": 1}})
        backend = torchbridge.get_backend("cpu", config=config)
        assert backend.config is config and torch.get_num_threads() == 1
        config.hardware.cpu.num_threads = 2
        assert backend.config.hardware.cpu.num_threads == 2
        assert torch.get_num_threads() == 1           # not applied by the assignment ...
        torchbridge.get_backend("cpu", config=config)
        assert torch.get_num_threads() == 2           # ... but by the next backend
    finally:
        torch.set_num_threads(before)
    assert "applied once, when the backend is created" in _docs()


# --- 8: a config built before its plugin was registered -----------------------------


class _LateConfig(ConfigSection):
    allow_bf16: bool = True


class _Late:
    @torchbridge.hookimpl
    def torchbridge_detect(self) -> torchbridge.Detection:
        return torchbridge.Detection("late", True, -30, "cpu", 1, "Late", fallbacks=("cpu",))

    @torchbridge.hookimpl
    def torchbridge_config_section(self) -> tuple[str, type[ConfigSection]]:
        return "late", _LateConfig


def test_a_config_older_than_the_plugin_gives_its_backend_the_section_defaults(
        reload_plugins: None) -> None:
    # Before: backend.hardware_config was None although the plugin has a section, and
    # the documented plugin example raised AttributeError in its own hook.
    config = TorchBridgeConfig.load(environ={})
    torchbridge.register_plugin(_Late(), name="late")
    assert not hasattr(config.hardware, "late")
    backend = torchbridge.get_backend("late", config=config)
    section = backend.hardware_config
    assert isinstance(section, _LateConfig) and section.allow_bf16 is True
    assert backend.hardware_config is section            # one object per backend
    with pytest.raises(ConfigurationError, match=r"hardware\.late\.allow_bf16"):
        section.allow_bf16 = "maybe"
    assert config.sources == {}
    # A config that has the section gives that one.
    newer = TorchBridgeConfig(hardware={"late": {"allow_bf16": False}})
    assert torchbridge.get_backend("late", config=newer).hardware_config is \
        newer.hardware.late
    # Another plugin's backend gets its own section, from the config.
    assert torchbridge.get_backend("cpu", config=config).hardware_config is \
        config.hardware.cpu


# --- 9: equality compares values, not where they came from -------------------------


def test_configs_with_equal_values_are_equal() -> None:
    # Before: pydantic compared the private `_sources` too.
    assert TorchBridgeConfig() == TorchBridgeConfig(strict=False)
    assert TorchBridgeConfig(strict=True) == TorchBridgeConfig.load(
        environ={"TORCHBRIDGE_STRICT": "1"})
    loaded = TorchBridgeConfig.load(environ={"TORCHBRIDGE_HARDWARE__CPU__NUM_THREADS": "3",
                                             "TORCHBRIDGE_MEMORY__OOM_SAFETY_MARGIN": "2"})
    assert TorchBridgeConfig(**loaded.model_dump()) == loaded
    assert TorchBridgeConfig.model_validate_json(loaded.model_dump_json()) == loaded
    assert pickle.loads(pickle.dumps(loaded)) == loaded
    assigned = TorchBridgeConfig()
    assigned.memory.oom_safety_margin = 2.0
    assigned.hardware.cpu.num_threads = 3
    assert assigned == loaded and assigned.memory == loaded.memory
    # Different values still differ, and so do different kinds of section.
    assert TorchBridgeConfig(strict=True) != TorchBridgeConfig()
    assert TorchBridgeConfig(hardware={"cpu": {"num_threads": 2}}) != TorchBridgeConfig()
    assert TorchBridgeConfig().memory != TorchBridgeConfig().kernel
    assert TorchBridgeConfig() != 1


class _PlainSection(BaseModel):   # a plugin section on plain pydantic (strict_section)
    level: int = 1


def test_configs_built_for_two_plugin_sets_compare_by_their_sections(
        reload_plugins: None) -> None:
    torchbridge.register_plugin(_section_plugin("plain_eq", _PlainSection), name="plain_eq")
    before = TorchBridgeConfig()
    torchbridge.register_plugin(_section_plugin("other_eq", _FirstZeta), name="other_eq")
    after = TorchBridgeConfig()   # a new HardwareConfig class, a new strict_section class
    assert type(after.hardware) is not type(before.hardware)
    assert after.hardware.plain_eq == before.hardware.plain_eq
    assert after != before        # it has a section the other has not
    torchbridge.unregister_plugin("other_eq")
    again = TorchBridgeConfig()
    assert type(again.hardware.plain_eq) is not type(before.hardware.plain_eq)
    assert again == before
