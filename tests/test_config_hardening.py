"""Config under bad input: every fault of a config file, numeric bounds, where an unknown key
came from, assignment paths, nested assignment, pickling into a spawned process, malformed
backend strings; and property-based runs over the environment, files and keywords."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import string
import sys
from pathlib import Path
from typing import Any

import pytest
import torchbridge
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchbridge import ConfigurationError, DeviceError, TorchBridgeConfig
from torchbridge.config import MemoryConfig

LATIN1 = "[optimization]\n# caf\u00e9\nlevel_note = 'x'\n".encode("latin-1")


# -- files --------------------------------------------------------------------------------

def test_a_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    (tmp_path / "torchbridge.toml").write_bytes(LATIN1)
    with pytest.raises(ConfigurationError, match=r"torchbridge\.toml is not UTF-8") as info:
        TorchBridgeConfig.load()
    assert info.value.source == str(tmp_path / "torchbridge.toml")


def test_a_pyproject_that_is_not_ours_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_bytes(b"[project]\nname = 'caf\xe9'\n")
    assert TorchBridgeConfig.load().optimization_level.value == "O2"
    (tmp_path / "pyproject.toml").write_text("tool = 1\n")
    assert TorchBridgeConfig.load().optimization_level.value == "O2"


@pytest.mark.parametrize(("content", "problem"), [
    (b"[tool.torchbridge]\noptimization_level = 'O1'\n# caf\xe9\n", "is not UTF-8"),
    (b"tool = 1  # torchbridge\n", "`tool` must be a table"),
    (b"[tool]\ntorchbridge = 3\n", r"\[tool.torchbridge\] must be a table"),
    (b"[tool.torchbridge\n", "is not valid TOML"),
])
def test_a_faulty_pyproject_of_ours_is_named(tmp_path: Path, content: bytes, problem: str
                                             ) -> None:
    (tmp_path / "pyproject.toml").write_bytes(content)
    with pytest.raises(ConfigurationError, match=rf"pyproject\.toml:? {problem}"):
        TorchBridgeConfig.load()


def named_file_error(monkeypatch: pytest.MonkeyPatch, path: str) -> str:
    monkeypatch.setenv("TORCHBRIDGE_CONFIG_FILE", path)
    with pytest.raises(ConfigurationError) as info:
        TorchBridgeConfig.load()
    assert info.value.source == path
    return str(info.value)


def test_config_file_variable_pointing_at_a_directory_fifo_or_overlong_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "is a directory" in named_file_error(monkeypatch, str(tmp_path))
    assert "does not exist" in named_file_error(monkeypatch, str(tmp_path / "nope.toml"))
    long_name = str(tmp_path / ("x" * 3000))
    message = named_file_error(monkeypatch, long_name)
    assert "cannot be read: File name too long" in message and "3" in message
    assert len(message) < 400  # the name is shortened in the message, kept in .source
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo.toml")
        assert "not a regular file" in named_file_error(monkeypatch,
                                                        str(tmp_path / "fifo.toml"))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_an_unreadable_file_is_named() -> None:
    """Read by a forked child that is not root (root reads any file)."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        os.chmod(folder, 0o755)
        path = folder / "secret.toml"
        path.write_text("strict = true\n")
        path.chmod(0)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            message = "loaded"
            try:
                if os.geteuid() == 0:
                    os.setgid(65534)
                    os.setuid(65534)
                TorchBridgeConfig.load(path)
            except ConfigurationError as exc:
                message = f"{exc}|{exc.source}"
            except BaseException as exc:
                message = f"{type(exc).__name__}: {exc}"
            os.write(write, message.encode())
            os._exit(0)
        os.close(write)
        outcome = os.read(read, 65536).decode()
        os.close(read)
        os.waitpid(pid, 0)
        assert outcome == f"config file {path} cannot be read: Permission denied|{path}"
    finally:
        shutil.rmtree(folder)


# -- values -------------------------------------------------------------------------------

@pytest.mark.parametrize(("variable", "value"), [
    ("TORCHBRIDGE_HARDWARE__CPU__NUM_THREADS", "4294967296"),
    ("TORCHBRIDGE_HARDWARE__CPU__NUM_THREADS", "0"),
    ("TORCHBRIDGE_MEMORY__MAX_MEMORY_FRACTION", "nan"),
    ("TORCHBRIDGE_MEMORY__MAX_MEMORY_FRACTION", "0"),
    ("TORCHBRIDGE_MEMORY__OOM_SAFETY_MARGIN", "inf"),
    ("TORCHBRIDGE_MEMORY__OOM_SAFETY_MARGIN", "0.5"),
    ("TORCHBRIDGE_HARDWARE__NVIDIA__MAX_MEMORY_FRACTION", "1.5"),
    ("TORCHBRIDGE_HARDWARE__NVIDIA__POOL_MAX_TENSORS", "-1"),
    ("TORCHBRIDGE_HARDWARE__TPU__MAX_MEMORY_FRACTION", "-0.1"),
])
def test_numeric_fields_have_the_bounds_the_runtime_needs(monkeypatch: pytest.MonkeyPatch,
                                                          variable: str, value: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigurationError, match=f"from environment variable {variable}"):
        TorchBridgeConfig.load()


def test_the_largest_thread_count_allowed_still_creates_a_backend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torchbridge.builtin.cpu.config import MAX_THREADS

    before = torch.get_num_threads()
    monkeypatch.setenv("TORCHBRIDGE_HARDWARE__CPU__NUM_THREADS", str(MAX_THREADS))
    try:
        assert torchbridge.get_backend("cpu").name == "cpu"
        assert torch.get_num_threads() == MAX_THREADS
    finally:
        torch.set_num_threads(before)


def test_an_unknown_key_names_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    monkeypatch.setenv("TORCHBRIDGE_HARDWARE__NVIDIA_TYPO__X", "1")
    with pytest.raises(ConfigurationError,
                       match="from environment variable TORCHBRIDGE_HARDWARE__NVIDIA_TYPO__X"):
        TorchBridgeConfig.load()
    monkeypatch.delenv("TORCHBRIDGE_HARDWARE__NVIDIA_TYPO__X")
    monkeypatch.setenv("TORCHBRIDGE_MEMORY__BOGUS", "1")
    with pytest.raises(ConfigurationError,
                       match=r"unknown config key 'memory\.bogus' \(from environment "
                       r"variable TORCHBRIDGE_MEMORY__BOGUS\); the keys in 'memory' are "):
        TorchBridgeConfig.load()
    monkeypatch.delenv("TORCHBRIDGE_MEMORY__BOGUS")
    (tmp_path / "torchbridge.toml").write_text("[hardware.warp]\nfactor = 9\n[kernel]\nx = 1\n")
    with pytest.raises(ConfigurationError,
                       match=r"config section 'hardware\.warp' \(from .*torchbridge\.toml"):
        TorchBridgeConfig.load()
    (tmp_path / "torchbridge.toml").write_text("[kernel]\nx = 1\n")
    with pytest.raises(ConfigurationError,
                       match=r"unknown config key 'kernel\.x' \(from .*torchbridge\.toml"):
        TorchBridgeConfig.load()


def test_assignment_errors_name_the_full_path_also_in_replaced_sections() -> None:
    config = TorchBridgeConfig.load()
    config.memory = MemoryConfig()
    with pytest.raises(ConfigurationError, match=r"^config key 'memory\.max_memory_fraction' "
                       r"must be a number above 0 and at most 1, got 2 \(from assignment\)"):
        config.memory.max_memory_fraction = 2
    config.memory = {"oom_safety_margin": 2.0}  # type: ignore[assignment]
    with pytest.raises(ConfigurationError, match=r"^config key 'memory\.oom_safety_margin' "
                       r"must be a number from 1 to 10, got 0"):
        config.memory.oom_safety_margin = 0
    with pytest.raises(ConfigurationError,
                       match=r"^config key 'memory\.max_memory_fraction' must .* got 3"):
        config.memory = {"max_memory_fraction": 3}  # type: ignore[assignment]
    assert config.memory.oom_safety_margin == 2.0
    with pytest.raises(ConfigurationError, match=r"^config key 'strict' must be true or false, got "
                       r"'maybe' \(from assignment\)"):
        config.strict = "maybe"  # type: ignore[assignment]


def test_valid_nested_assignments_are_accepted_and_invalid_ones_change_nothing() -> None:
    config = TorchBridgeConfig.load()
    config.hardware = {"cpu": {"num_threads": 2}}  # type: ignore[assignment]
    assert config.hardware.cpu.num_threads == 2
    assert config.hardware.nvidia.allow_tf32 is True  # the other sections: their defaults
    assert config.sources["hardware"] == "assignment"
    with pytest.raises(ConfigurationError, match=r"config key 'hardware\.cpu\.num_threads' must "
                       r"be a whole number from 1 to 4096, got 0 \(from assignment\)"):
        config.hardware.cpu.num_threads = 0
    with pytest.raises(ConfigurationError, match=r"'hardware\.cpu\.num_threads' .*got -1"):
        config.hardware = {"cpu": {"num_threads": -1}}  # type: ignore[assignment]
    with pytest.raises(ConfigurationError, match=r"hardware\.warp"):
        config.hardware = {"warp": {}}  # type: ignore[assignment]
    assert config.hardware.cpu.num_threads == 2
    config.hardware.cpu = {"allow_bf16": False}
    assert config.hardware.cpu.allow_bf16 is False and config.hardware.cpu.num_threads is None


# -- pickling -----------------------------------------------------------------------------

def configured() -> TorchBridgeConfig:
    return TorchBridgeConfig.load(optimization_level="O1", precision="bf16",
                                  memory={"max_memory_fraction": 0.5},
                                  hardware={"cpu": {"num_threads": 3},
                                            "tpu": {"memory_fraction": 0.25}})


def describe_config(config: TorchBridgeConfig) -> dict[str, Any]:
    """Run in a spawned worker: what it sees of the config it was sent."""
    return {"pid": os.getpid(), "values": config.model_dump(mode="json"),
            "sources": config.sources, "threads": config.hardware.cpu.num_threads}


def test_a_config_pickles_with_its_values_and_sources() -> None:
    config = configured()
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config and copy.sources == config.sources
    assert copy.hardware.tpu.max_memory_fraction == 0.25
    with pytest.raises(ConfigurationError, match=r"^config key 'hardware\.cpu\.num_threads' "
                       r"must be a whole number from 1 to 4096, got 0"):
        copy.hardware.cpu.num_threads = 0
    hardware = pickle.loads(pickle.dumps(config.hardware))
    assert hardware == config.hardware


def test_a_config_reaches_a_spawned_worker_intact() -> None:
    config = configured()
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        seen = pool.apply(describe_config, (config,))
    assert seen["pid"] != os.getpid()
    assert seen["values"] == config.model_dump(mode="json")
    assert seen["sources"] == config.sources and seen["threads"] == 3


# -- backend strings ----------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["", ":0", " :1", "cpu:", "cpu:\u00b2", "cpu:1:2", "cpu:-1",
                                  "cpu: 1"])
def test_a_malformed_backend_string_is_a_device_error(spec: str) -> None:
    with pytest.raises(DeviceError, match="backend"):
        torchbridge.get_backend(spec)


def test_a_malformed_backend_from_the_environment_is_a_device_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHBRIDGE_BACKEND", "cpu:x")
    with pytest.raises(DeviceError, match="cpu:x"):
        torchbridge.get_backend()


# -- property-based -----------------------------------------------------------------------

PROPERTIES = settings(max_examples=40, deadline=None, derandomize=True,
                      suppress_health_check=[HealthCheck.function_scoped_fixture])
FIELDS = ["OPTIMIZATION_LEVEL", "PRECISION", "BACKEND", "STRICT", "LOGGING_LEVEL",
          "MEMORY__MAX_MEMORY_FRACTION", "MEMORY__OOM_SAFETY_MARGIN", "MEMORY__BOGUS",
          "KERNEL__DISABLED_OPS", "HARDWARE__CPU__NUM_THREADS", "HARDWARE__NVIDIA__ARCHITECTURE",
          "HARDWARE__TPU__VERSION", "HARDWARE__NOPE__X", "OPTIMIZATION",
          "OPTIMIZATION__QUANTIZE", "OPTIMIZATION__QUANTIZE_MIN_COSINE", "OPTIMIZATION_LEVLE",
          "OPTIMIZATION__DISABLED_PASES", "KERNEL__SUBSTITUTE", "KERNEL__CACHE_DIR"]
VALUES = st.one_of(st.text(max_size=12), st.integers().map(str),
                   st.floats(allow_nan=True).map(str),
                   st.sampled_from(["O1", "bf16", "true", "null", "[]", "{}", "[1, 2]",
                                    '{"x": 1}', "1e999", "-0", "cpu", "ampere", "v5e",
                                    "4294967296", "0.5"]))


# What pydantic says, never what a user should read.
PYDANTIC_PHRASES = ("Input should", "Extra inputs are not permitted", "Field required",
                    "Value error,", "Assertion failed,", "validation error", "type=",
                    "errors.pydantic.dev")


def loads_or_names_the_source(**load: Any) -> None:
    try:
        config = TorchBridgeConfig.load(**load)
    except ConfigurationError as exc:
        assert exc.source, exc  # every refusal says where the value came from
        assert exc.source in str(exc) or str(exc.source) in str(exc), exc
        assert not [p for p in PYDANTIC_PHRASES if p in str(exc)], exc  # the user's words
        return
    config.model_dump()  # a config that loads is a complete, usable one
    pickle.loads(pickle.dumps(config))


@PROPERTIES
@given(env=st.dictionaries(st.sampled_from(FIELDS), VALUES.filter(lambda v: "\x00" not in v),
                           max_size=4))
def test_any_environment_loads_or_is_a_configuration_error(env: dict[str, str]) -> None:
    loads_or_names_the_source(environ={f"TORCHBRIDGE_{k}": v for k, v in env.items()})


TOML_KEYS = st.sampled_from(["optimization_level", "strict", "precision", "backend",
                             "memory", "hardware", "kernel", "cpu", "num_threads",
                             "max_memory_fraction", "x"])
TOML_SCALARS = st.one_of(st.integers(), st.floats(), st.booleans(),
                         st.text(string.printable, max_size=8))
TOML_TREES = st.recursive(TOML_SCALARS, lambda inner: st.dictionaries(TOML_KEYS, inner,
                                                                      max_size=3),
                          max_leaves=8)


@PROPERTIES
@given(tree=st.dictionaries(TOML_KEYS, TOML_TREES, max_size=4), raw=st.binary(max_size=64),
       use_raw=st.booleans())
def test_any_config_file_loads_or_is_a_configuration_error(
        tmp_path: Path, tree: dict[str, Any], raw: bytes, use_raw: bool) -> None:
    path = tmp_path / "torchbridge.toml"
    if use_raw:
        path.write_bytes(raw)
    else:
        import json

        lines = [f"{key} = {json.dumps(value)}" for key, value in tree.items()
                 if not isinstance(value, dict)]
        for key, value in tree.items():
            if isinstance(value, dict):
                lines.append(f"[{key}]")
                lines += [f"{k} = {json.dumps(v)}" for k, v in value.items()]
        path.write_text("\n".join(lines) + "\n")
    loads_or_names_the_source(config_file=path)


@PROPERTIES
@given(kwargs=st.dictionaries(TOML_KEYS, TOML_TREES, max_size=3))
def test_any_keyword_arguments_load_or_are_a_configuration_error(kwargs: dict[str, Any]
                                                                 ) -> None:
    loads_or_names_the_source(**kwargs)


if sys.platform == "win32":  # pragma: no cover
    pytestmark = pytest.mark.skip("POSIX file semantics")


@pytest.mark.parametrize(("section", "key"), [
    ("memory", "max_memory_fraction"), ("memory", "oom_safety_margin"),
    ("optimization", "quantize_min_cosine"), ("optimization", "quantize_min_argmax_agreement")])
def test_a_bool_for_a_number_is_refused_naming_the_key(section: str, key: str) -> None:
    """pydantic's lax mode read `max_memory_fraction: true` as a cap of 1.0."""
    with pytest.raises(ConfigurationError, match=rf"{section}\.{key}.*got the bool True"):
        TorchBridgeConfig(**{section: {key: True}})
    config = TorchBridgeConfig()
    before = getattr(getattr(config, section), key)
    with pytest.raises(ConfigurationError, match="got the bool"):
        setattr(getattr(config, section), key, False)
    assert getattr(getattr(config, section), key) == before


def test_a_bool_for_the_cpu_thread_count_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"hardware\.cpu\.num_threads.*bool"):
        TorchBridgeConfig(hardware={"cpu": {"num_threads": True}})
    assert TorchBridgeConfig(hardware={"cpu": {"num_threads": 2}}).hardware.cpu.num_threads == 2
