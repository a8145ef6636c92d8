"""The config tells the truth: every source is merged key by key whatever the order of
the environment, `sources` credits only values the config really has, nested assignments
are recorded, a plugin section whose defaults break its own rules is rejected where it is
merged, and an error about a missing section says why it is missing."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Literal

import pytest
import torchbridge
from pydantic import Field
from torchbridge import ConfigSection, ConfigurationError, TorchBridgeConfig
from torchbridge.plugins import plugin_records

# --- A: a whole-section value and a nested key merge key by key --------------------


@pytest.mark.parametrize("order", ["nested_first", "section_first"])
def test_section_json_and_nested_variable_merge_whatever_the_order(order: str) -> None:
    # Before: the JSON section value replaced the nested variable's value, or not,
    # depending on which came first in os.environ; sources credited the dropped variable.
    nested = ("TORCHBRIDGE_MEMORY__OOM_SAFETY_MARGIN", "2")
    section = ("TORCHBRIDGE_MEMORY", '{"max_memory_fraction": 0.5, "oom_safety_margin": 3}')
    environ = dict([nested, section] if order == "nested_first" else [section, nested])
    config = TorchBridgeConfig.load(environ=environ)
    # The more specific variable wins its key; the section's other keys still apply.
    assert config.memory.oom_safety_margin == 2.0
    assert config.memory.max_memory_fraction == 0.5
    assert config.sources == {
        "memory.oom_safety_margin": "environment variable TORCHBRIDGE_MEMORY__OOM_SAFETY_MARGIN",
        "memory.max_memory_fraction": "environment variable TORCHBRIDGE_MEMORY",
    }


def test_empty_section_keyword_keeps_lower_layers() -> None:
    # Before: `memory={}` wiped the environment's value while sources still credited it.
    config = TorchBridgeConfig.load(
        environ={"TORCHBRIDGE_MEMORY__OOM_SAFETY_MARGIN": "2"}, memory={})
    assert config.memory.oom_safety_margin == 2.0
    assert config.sources == {
        "memory.oom_safety_margin": "environment variable TORCHBRIDGE_MEMORY__OOM_SAFETY_MARGIN"}


def test_empty_section_keyword_over_file(tmp_path: Path) -> None:
    file = tmp_path / "torchbridge.toml"
    file.write_text("[memory]\noom_safety_margin = 3\n")
    config = TorchBridgeConfig.load(file, environ={}, memory={})
    assert config.memory.oom_safety_margin == 3.0
    assert config.sources == {"memory.oom_safety_margin": str(file)}


def test_later_layer_section_json_merges_with_file(tmp_path: Path) -> None:
    file = tmp_path / "torchbridge.toml"
    file.write_text("[memory]\noom_safety_margin = 3\n")
    config = TorchBridgeConfig.load(
        file, environ={"TORCHBRIDGE_MEMORY": '{"max_memory_fraction": 0.5}'})
    assert (config.memory.oom_safety_margin, config.memory.max_memory_fraction) == (3.0, 0.5)
    assert config.sources["memory.oom_safety_margin"] == str(file)


def test_a_section_instance_replaces_lower_layers_in_sources() -> None:
    # A model instance is a whole value: nothing below it may still be credited elsewhere.
    from torchbridge.config import MemoryConfig

    config = TorchBridgeConfig.load(environ={"TORCHBRIDGE_MEMORY__OOM_SAFETY_MARGIN": "2"},
                                    memory=MemoryConfig())
    assert config.memory.oom_safety_margin == 1.1
    assert config.sources == {"memory": "keyword arguments"}


# --- B: nested assignments are recorded ---------------------------------------------


def test_nested_assignment_is_recorded_in_sources() -> None:
    # Before: only assignments to the root's own fields reached `sources`.
    config = TorchBridgeConfig.load(environ={"TORCHBRIDGE_MEMORY__MAX_MEMORY_FRACTION": "0.8"})
    config.memory.max_memory_fraction = 0.5
    config.hardware.cpu.num_threads = 3
    expected = {"memory.max_memory_fraction": "assignment",
                "hardware.cpu.num_threads": "assignment"}
    assert config.sources == expected
    # A pickled config carries its sources (what a spawned worker is told).
    assert pickle.loads(pickle.dumps(config)).sources == expected


def test_assignment_in_a_copy_or_detached_section_stays_there() -> None:
    config = TorchBridgeConfig.load(environ={})
    copied = config.model_copy(deep=True)
    copied.memory.max_memory_fraction = 0.5
    assert copied.sources == {"memory.max_memory_fraction": "assignment"}
    assert config.sources == {}
    memory = config.memory
    config.memory = type(memory)()          # `memory` no longer belongs to `config`
    memory.oom_safety_margin = 2.0
    assert config.sources == {"memory": "assignment"}
    assert pickle.loads(pickle.dumps(memory)).oom_safety_margin == 2.0


# --- C: a section whose defaults break its own rules is rejected when merged --------


class _BadDefaults(ConfigSection):
    threads: int = Field(default=-3, ge=1)
    mode: Literal["fast", "safe"] = "turbo"  # type: ignore[assignment]


def test_section_with_invalid_defaults_is_rejected(reload_plugins: None) -> None:
    # Before: accepted; pickling the config later failed blaming "a pickled config".
    class Plugin:
        @torchbridge.hookimpl
        def torchbridge_config_section(self) -> tuple[str, type[ConfigSection]]:
            return "bad", _BadDefaults

    torchbridge.register_plugin(Plugin(), name="bad")
    config = TorchBridgeConfig.load(environ={})
    assert not hasattr(config.hardware, "bad")
    record = next(r for r in plugin_records() if r.name == "bad")
    assert record.status == "error"
    message = " ".join(record.errors)
    assert "hardware.bad.threads" in message and "hardware.bad.mode" in message
    assert "plugin bad" in message
    pickle.loads(pickle.dumps(config))   # the rest of the config still travels
    # Setting it says why it is missing.
    with pytest.raises(ConfigurationError, match="rejected") as info:
        TorchBridgeConfig.load(environ={}, hardware={"bad": {"threads": 2}})
    assert "no installed plugin" not in str(info.value)


# --- G: a disabled plugin's section -------------------------------------------------


def test_disabled_plugin_section_says_disabled(monkeypatch: pytest.MonkeyPatch,
                                               reload_plugins: None) -> None:
    names = {r.name for r in plugin_records()}
    if "nvidia" not in names:
        pytest.skip("the nvidia plugin is not installed here")
    monkeypatch.setenv("TORCHBRIDGE_DISABLE_PLUGINS", "nvidia")
    torchbridge.reload_plugins()
    with pytest.raises(ConfigurationError) as info:
        TorchBridgeConfig.load(environ={"TORCHBRIDGE_HARDWARE__NVIDIA__ALLOW_TF32": "false"})
    text = str(info.value)
    assert "TORCHBRIDGE_DISABLE_PLUGINS" in text and "no installed plugin" not in text


# --- H: load(environ=...) reads only that environment -------------------------------


def test_environ_config_file_is_read_from_the_given_environ(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = tmp_path / "mine.toml"
    mine.write_text('optimization_level = "O1"\n')
    config = TorchBridgeConfig.load(environ={"TORCHBRIDGE_CONFIG_FILE": str(mine)})
    assert config.optimization_level == "O1"
    assert config.sources == {"optimization_level": str(mine)}
    # ... and os.environ's TORCHBRIDGE_CONFIG_FILE is not read when environ is given.
    monkeypatch.setenv("TORCHBRIDGE_CONFIG_FILE", str(mine))
    assert TorchBridgeConfig.load(environ={}).sources == {}


# --- M: field names with capitals, and aliases --------------------------------------


class _Cased(ConfigSection):
    maxBatch: int = 8  # a plugin's field name, as some plugins write them
    tag: str = Field(default="x", alias="Tag")


@pytest.fixture
def cased(reload_plugins: None) -> None:
    class Plugin:
        @torchbridge.hookimpl
        def torchbridge_config_section(self) -> tuple[str, type[ConfigSection]]:
            return "cased", _Cased

    torchbridge.register_plugin(Plugin(), name="cased")


def test_env_sets_camelcase_and_aliased_fields(cased: None) -> None:
    # Before: variable names are lowercased and `maxbatch` was refused, the error
    # suggesting the very variable that had been set.
    config = TorchBridgeConfig.load(environ={"TORCHBRIDGE_HARDWARE__CASED__MAXBATCH": "4",
                                             "TORCHBRIDGE_HARDWARE__CASED__TAG": "y"})
    assert (config.hardware.cased.maxBatch, config.hardware.cased.tag) == (4, "y")
    assert config.sources["hardware.cased.maxBatch"] == \
        "environment variable TORCHBRIDGE_HARDWARE__CASED__MAXBATCH"


def test_error_offers_the_alias_not_the_refused_field_name(cased: None) -> None:
    # Before: "the keys in 'hardware.cased' are maxBatch, tag" while refusing `tag`.
    with pytest.raises(ConfigurationError) as info:
        TorchBridgeConfig.load(environ={}, hardware={"cased": {"tag": "y"}})
    assert "'hardware.cased.Tag'" in str(info.value)


def test_a_validator_raising_something_else_on_assignment_is_a_configuration_error(
        reload_plugins: None) -> None:
    # Loading wrapped it as a ConfigurationError naming the section and its plugin; an
    # assignment let the validator's RuntimeError out.
    from pydantic import field_validator

    class Modes(ConfigSection):
        mode: str = "fast"

        @field_validator("mode")
        @classmethod
        def _known(cls, value: str) -> str:
            if value not in ("fast", "exact"):
                raise RuntimeError("acme: unknown mode")  # not a ValueError
            return value

    class Plugin:
        @torchbridge.hookimpl
        def torchbridge_config_section(self) -> tuple[str, type[ConfigSection]]:
            return "acme_modes", Modes

    torchbridge.register_plugin(Plugin(), name="acme_modes")
    config = TorchBridgeConfig()
    with pytest.raises(ConfigurationError, match=r"hardware\.acme_modes\.mode = 'turbo' "
                       r"\(from assignment\) \(section of plugin acme_modes\): its validator "
                       r"raised RuntimeError: acme: unknown mode"):
        config.hardware.acme_modes.mode = "turbo"
    assert config.hardware.acme_modes.mode == "fast"
