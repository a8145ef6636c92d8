"""Config mistakes in the user's words: the key, what it must be, the value given and where
it came from, the nearest key for a misspelt one; never pydantic's phrases."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from torchbridge.config import TorchBridgeConfig, hardware_model
from torchbridge.errors import ConfigurationError

# What pydantic says, never what a user should read.
PYDANTIC_WORDS = ("Input should", "Extra inputs are not permitted", "Field required",
                  "Value error,", "Assertion failed,", "validation error", "type=",
                  "errors.pydantic.dev", "valid dictionary", "valid number", "valid integer",
                  "valid boolean", "valid string", "valid list", "unable to parse")

KWARGS = "(from keyword arguments)"

MESSAGES: list[tuple[dict[str, Any], str]] = [
    ({"optimization_levle": "O1"},
     f"unknown config key 'optimization_levle' {KWARGS}; did you mean "
     "'optimization_level'?"),
    ({"optimization": {"disabled_pases": []}},
     f"unknown config key 'optimization.disabled_pases' {KWARGS}; did you mean "
     "'optimization.disabled_passes'?"),
    ({"memory": {"bogus": 1}},
     f"unknown config key 'memory.bogus' {KWARGS}; the keys in 'memory' are "
     "max_memory_fraction, enable_oom_protection, oom_safety_margin"),
    ({"memory": {"max_memory_fraction": "lots"}},
     "config key 'memory.max_memory_fraction' must be a number above 0 and at most 1, got "
     f"'lots' {KWARGS}"),
    ({"memory": {"oom_safety_margin": 0.5}},
     f"config key 'memory.oom_safety_margin' must be a number from 1 to 10, got 0.5 {KWARGS}"),
    ({"precision": "bf61"},
     "config key 'precision' must be one of auto, float32, bfloat16, float16, got 'bf61' "
     f"{KWARGS}"),
    ({"optimization": {"quantize": "int9"}},
     "config key 'optimization.quantize' must be one of int8, int8_weight_only, "
     f"int4_weight_only, float8, got 'int9' {KWARGS}; did you mean 'int8'?"),
    ({"strict": "maybe"}, f"config key 'strict' must be true or false, got 'maybe' {KWARGS}"),
    ({"memory": 5},
     "config key 'memory' must be a table of settings (a section such as [memory]), got 5 "
     f"{KWARGS}"),
    ({"kernel": {"disabled_ops": [1]}},
     f"config key 'kernel.disabled_ops[0]' must be text, got 1 {KWARGS}"),
    ({"kernel": {"disabled_ops": "rms_norm"}},
     "config key 'kernel.disabled_ops' must be a list of text values, got 'rms_norm' "
     f"{KWARGS}"),
    ({"optimization_level": "O4"},
     f"config key 'optimization_level' {KWARGS}: unknown optimization level 'O4'; choose "
     "one of O0, O1, O2, O3, none, conservative, balanced, aggressive (O3 is the highest)"),
    ({"hardware": {"cpu": {"num_threads": "many"}}},
     "config key 'hardware.cpu.num_threads' must be a whole number from 1 to 4096, got "
     f"'many' {KWARGS} (section of plugin cpu)"),
    ({"hardware": {"nvidai": {}}},
     f"unknown config section 'hardware.nvidai' {KWARGS}: no installed plugin provides it; "
     "did you mean 'hardware.nvidia'?"),
    ({"memory": {"max_memory_fraction": 2, "oom_safety_margin": "x"}},
     "2 problems in the TorchBridge configuration: (1) config key "
     "'memory.max_memory_fraction' must be a number above 0 and at most 1, got 2 "
     f"{KWARGS}; (2) config key 'memory.oom_safety_margin' must be a number from 1 to 10, "
     f"got 'x' {KWARGS}"),
]


@pytest.mark.parametrize(("kwargs", "message"), MESSAGES, ids=[m[:60] for _, m in MESSAGES])
def test_a_config_mistake_reads_as_words(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        TorchBridgeConfig.load(**kwargs)
    assert str(info.value) == message
    assert info.value.source == "keyword arguments"


ENVIRONMENT = [
    ({"TORCHBRIDGE_OPTIMIZATION_LEVLE": "O1"},
     "unknown config key 'optimization_levle' (from environment variable "
     "TORCHBRIDGE_OPTIMIZATION_LEVLE); did you mean TORCHBRIDGE_OPTIMIZATION_LEVEL?"),
    ({"TORCHBRIDGE_PLUGIN": "nvidia"},
     "unknown config key 'plugin' (from environment variable TORCHBRIDGE_PLUGIN); did you "
     "mean TORCHBRIDGE_PLUGINS?"),
    ({"TORCHBRIDGE_HARDWARE__NVIDAI__ALLOW_TF32": "0"},
     "unknown config section 'hardware.nvidai' (from environment variable "
     "TORCHBRIDGE_HARDWARE__NVIDAI__ALLOW_TF32): no installed plugin provides it; did you "
     "mean TORCHBRIDGE_HARDWARE__NVIDIA__ALLOW_TF32?"),
    ({"TORCHBRIDGE_MEMORY__MAX_MEMORY_FRACTION": "lots"},
     "config key 'memory.max_memory_fraction' must be a number above 0 and at most 1, got "
     "'lots' (from environment variable TORCHBRIDGE_MEMORY__MAX_MEMORY_FRACTION)"),
]


@pytest.mark.parametrize(("environ", "message"), ENVIRONMENT,
                         ids=[next(iter(e)) for e, _ in ENVIRONMENT])
def test_an_environment_mistake_names_the_variable_to_set(environ: dict[str, str],
                                                          message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        TorchBridgeConfig.load(environ=environ)
    assert str(info.value) == message


def test_variables_that_are_not_config_keys_are_left_alone() -> None:
    config = TorchBridgeConfig.load(environ={"TORCHBRIDGE_PROGRESS": "0",
                                             "TORCHBRIDGE_DETECT_TIMEOUT": "3"})
    assert config.sources == {}


def test_a_file_mistake_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "torchbridge.toml"
    path.write_text("[optimization]\ndisabled_pases = ['fuse']\n")
    with pytest.raises(ConfigurationError) as info:
        TorchBridgeConfig.load(path)
    assert str(info.value) == (f"unknown config key 'optimization.disabled_pases' (from "
                               f"{path}); did you mean 'optimization.disabled_passes'?")


BAD_VALUES = ["lots", "", [1, "a"], {"x": 1}, 10**30, -1e300, math.nan, math.inf, -1, 0,
              3.5, True, None]


def leaf_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()
                ) -> list[tuple[str, ...]]:
    out = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += leaf_fields(annotation, (*prefix, name))
        else:
            out.append((*prefix, name))
    return out


def nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    for part in reversed(path):
        value = {part: value}
    return value


def every_field() -> list[tuple[str, ...]]:
    fields = [f for f in leaf_fields(TorchBridgeConfig) if f[0] != "hardware"]
    return fields + leaf_fields(hardware_model(), ("hardware",))


def test_every_refusal_of_every_field_reads_as_words() -> None:
    """Each field with values of every kind: whatever pydantic refuses reaches the user as
    the key, what it must be and the value, in TorchBridge's words."""
    refused = 0
    for path in every_field():
        for value in BAD_VALUES:
            try:
                TorchBridgeConfig.load(**nested(path, value))
            except ConfigurationError as exc:
                refused += 1
                text = str(exc)
                assert not [w for w in PYDANTIC_WORDS if w in text], text
                assert f"'{'.'.join(path)}" in text and KWARGS in text, text
                assert exc.field is not None and exc.field.startswith(".".join(path)), text
    assert refused > 100  # the sweep did meet refusals of every field
