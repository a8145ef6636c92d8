from __future__ import annotations

from pathlib import Path

import pytest
import torchbridge
from torchbridge import ConfigurationError, OptimizationLevel, TorchBridgeConfig


def test_defaults_and_plugin_sections() -> None:
    config = TorchBridgeConfig.load()
    assert config.optimization_level is OptimizationLevel.O2
    assert config.hardware.cpu.num_threads is None
    assert config.hardware.example.greeting == "hello"  # the third-party plugin's section
    assert config.sources == {}


def test_precedence_file_env_kwargs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.torchbridge]\noptimization_level = "O1"\nprecision = "fp16"\n'
        '[tool.torchbridge.hardware.example]\ngreeting = "from file"\nscale = 2.0\n')
    config = TorchBridgeConfig.load()
    assert config.optimization_level is OptimizationLevel.O1
    assert config.precision == "float16"
    assert config.hardware.example.greeting == "from file"
    monkeypatch.setenv("TORCHBRIDGE_HARDWARE__EXAMPLE__GREETING", "from env")
    monkeypatch.setenv("TORCHBRIDGE_OPTIMIZATION_LEVEL", "aggressive")
    config = TorchBridgeConfig.load(precision="bf16")
    assert config.hardware.example.greeting == "from env"
    assert config.hardware.example.scale == 2.0
    assert config.optimization_level is OptimizationLevel.O3
    assert config.precision == "bfloat16"
    assert config.sources["hardware.example.scale"] == str(tmp_path / "pyproject.toml")
    assert config.sources["optimization_level"] == \
        "environment variable TORCHBRIDGE_OPTIMIZATION_LEVEL"
    assert config.sources["precision"] == "keyword arguments"


def test_torchbridge_toml_wins_over_pyproject(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.torchbridge]\nbackend = "cuda"\n')
    (tmp_path / "torchbridge.toml").write_text('backend = "cpu"\n')
    assert TorchBridgeConfig.load().backend == "cpu"


def test_presets() -> None:
    assert TorchBridgeConfig.for_training().optimization_level is OptimizationLevel.O2
    assert TorchBridgeConfig.for_inference().optimization_level is OptimizationLevel.O3
    dev = TorchBridgeConfig.for_development()
    assert dev.optimization_level is OptimizationLevel.O0 and dev.strict
    assert TorchBridgeConfig.for_inference(optimization_level="O1").optimization_level == "O1"


@pytest.mark.parametrize(("setup", "field", "source"), [
    ("env", "memory.max_memory_fraction", "environment variable "
     "TORCHBRIDGE_MEMORY__MAX_MEMORY_FRACTION"),
    ("file", "hardware.example.scale", "torchbridge.toml"),
    ("kwargs", "hardware.cpu.num_threads", "keyword arguments"),
])
def test_bad_value_names_field_value_and_source(setup: str, field: str, source: str,
                                                monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    kwargs = {}
    if setup == "env":
        monkeypatch.setenv("TORCHBRIDGE_MEMORY__MAX_MEMORY_FRACTION", "1.5")
    elif setup == "file":
        (tmp_path / "torchbridge.toml").write_text("[hardware.example]\nscale = -3\n")
    else:
        kwargs = {"hardware": {"cpu": {"num_threads": "many"}}}
    with pytest.raises(ConfigurationError) as info:
        TorchBridgeConfig.load(**kwargs)
    assert info.value.field == field
    assert source in info.value.source
    assert field in str(info.value) and source in str(info.value)


def test_unknown_keys_are_rejected_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHBRIDGE_HARDWARE__NVIDIA_TYPO__X", "1")
    with pytest.raises(ConfigurationError, match=r"hardware\.nvidia_typo"):
        TorchBridgeConfig.load()
    monkeypatch.delenv("TORCHBRIDGE_HARDWARE__NVIDIA_TYPO__X")
    with pytest.raises(ConfigurationError, match=r"memory\.bogus"):
        TorchBridgeConfig(memory={"bogus": 1})
    with pytest.raises(ConfigurationError, match="unknown optimization level"):
        TorchBridgeConfig(optimization_level="O9")


def test_bad_assignment_raises_and_changes_nothing() -> None:
    config = TorchBridgeConfig.load()
    with pytest.raises(ConfigurationError, match=r"^config key 'hardware\.cpu\.num_threads' "
                       r"must be a whole number from 1 to 4096, got 0 \(from assignment\)"):
        config.hardware.cpu.num_threads = 0
    assert config.hardware.cpu.num_threads is None
    with pytest.raises(ConfigurationError, match=r"^config key 'memory\.max_memory_fraction' "
                       r"must be a number above 0 and at most 1, got 2 \(from assignment\)$"):
        config.memory.max_memory_fraction = 2
    assert config.memory.max_memory_fraction is None
    config.optimization_level = "conservative"
    assert config.optimization_level is OptimizationLevel.O1


def test_unreadable_or_missing_file_is_a_configuration_error(tmp_path: Path) -> None:
    (tmp_path / "torchbridge.toml").write_text("this is = = not toml")
    with pytest.raises(ConfigurationError, match=r"torchbridge\.toml is not valid TOML"):
        TorchBridgeConfig.load()
    with pytest.raises(ConfigurationError, match="does not exist"):
        TorchBridgeConfig.load(tmp_path / "nope.toml")


def test_building_a_config_never_probes_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchbridge_amd.probe
    import torchbridge_intel.probe
    import torchbridge_nvidia.probe
    import torchbridge_tpu.probe

    def explode() -> None:
        raise AssertionError("config construction probed hardware")

    for module in (torchbridge_nvidia.probe, torchbridge_amd.probe, torchbridge_intel.probe,
                   torchbridge_tpu.probe):
        monkeypatch.setattr(module, "probe", explode)
    torchbridge.reload_plugins()
    TorchBridgeConfig.for_inference()
    TorchBridgeConfig(optimization_level="O1")


def test_a_plugin_section_that_raises_is_left_out(reload_plugins: None) -> None:
    class BadSection:
        @torchbridge.hookimpl
        def torchbridge_config_section(self) -> None:
            raise RuntimeError("section exploded")

    torchbridge.register_plugin(BadSection(), name="bad_section")
    config = TorchBridgeConfig.load()
    assert hasattr(config.hardware, "cpu")
    from torchbridge.plugins import plugin_records

    record = next(r for r in plugin_records() if r.name == "bad_section")
    assert record.status == "error" and "section exploded" in (record.error or "")


def test_section_rules_for_plugins_are_exported_and_applied(reload_plugins: None) -> None:
    """torchbridge.ConfigSection gives a section the core's rules; a section on plain
    pydantic BaseModel gets them too (a typo is an error, not silently dropped)."""
    from pydantic import BaseModel

    class Plain(BaseModel):
        depth: int = 3

    class Typed(torchbridge.ConfigSection):
        width: int = 8

    class Sections:
        @torchbridge.hookimpl
        def torchbridge_config_section(self) -> tuple[str, type[BaseModel]]:
            return "plainsec", Plain

    class TypedSections:
        @torchbridge.hookimpl
        def torchbridge_config_section(self) -> tuple[str, type[BaseModel]]:
            return "typedsec", Typed

    torchbridge.register_plugin(Sections(), name="plain_sections")
    torchbridge.register_plugin(TypedSections(), name="typed_sections")
    config = TorchBridgeConfig.load()
    assert isinstance(config.hardware.plainsec, Plain)
    with pytest.raises(ConfigurationError, match=r"unknown config key 'hardware\.plainsec\."
                       r"dpeth'.*did you mean 'hardware\.plainsec\.depth'\?.*plugin "
                       "plain_sections"):
        TorchBridgeConfig(hardware={"plainsec": {"dpeth": 4}})
    with pytest.raises(ConfigurationError, match=r"hardware\.plainsec\.depth"):
        config.hardware.plainsec.depth = "deep"
    with pytest.raises(ConfigurationError, match=r"hardware\.typedsec\.width"):
        config.hardware.typedsec.width = "wide"
    with pytest.raises(ConfigurationError, match=r"unknown config section 'hardware\.nosuch' "
                       r"\(from keyword arguments\): no installed plugin"):
        TorchBridgeConfig(hardware={"nosuch": {}})
