"""Configuration: pydantic v2 models, one section per installed plugin, merged at load time.

Sources in increasing precedence: defaults (or a preset's), `torchbridge.toml` or
`[tool.torchbridge]` in pyproject.toml, environment variables `TORCHBRIDGE_...` (double
underscore for nesting), keyword arguments. Every layer is merged first and validated once,
so a bad value from any source raises ConfigurationError naming the field path, the value
and the source, and no partially applied config ever exists. Building a config never probes
hardware: plugin sections are pydantic models with static defaults.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, NoReturn

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializeAsAny,
    ValidationError,
    create_model,
    field_validator,
)

from torchbridge.config_errors import (
    ENV_PREFIX,
    configuration_error,
    input_keys,
    section_model,
    unknown_key_suggestion,
)
from torchbridge.errors import ConfigurationError
from torchbridge.levels import OptimizationLevel
from torchbridge.plugins import (
    PluginHost,
    cached_for,
    describe,
    exclusive_step,
    get_plugin_host,
    is_fatal,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

logger = logging.getLogger(__name__)

CONFIG_FILE_ENV = "TORCHBRIDGE_CONFIG_FILE"
# Read by the plugin loader, not config fields.
RESERVED_ENV = {"TORCHBRIDGE_PLUGINS", "TORCHBRIDGE_DISABLE_PLUGINS", CONFIG_FILE_ENV,
                "TORCHBRIDGE_DETECT_TIMEOUT", "TORCHBRIDGE_PROGRESS"}
_PRECISION_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
                      "half": "float16", "float": "float32"}


def _source_of(loc: tuple[str, ...], sources: dict[tuple[str, ...], str]) -> str:
    """Where the value at `loc` came from: the longest recorded prefix of its path, else
    the sources of the values recorded below it (an unknown section set through
    TORCHBRIDGE_HARDWARE__X__Y is recorded at hardware.x.y and reported at hardware.x)."""
    for cut in range(len(loc), 0, -1):
        if loc[:cut] in sources:
            return sources[loc[:cut]]
    below = sorted({source for path, source in sources.items() if path[:len(loc)] == loc})
    return " and ".join(below) if below else "defaults"


def _raise_configuration_error(exc: ValidationError, prefix: tuple[str, ...],
                               sources: dict[tuple[str, ...], str],
                               model: type[BaseModel] | None = None) -> NoReturn:
    """`exc` as a ConfigurationError in the user's words (see torchbridge.config_errors):
    `model` is the class validated at `prefix`, for its keys and field types."""
    raise configuration_error(exc, prefix, sources, model, _source_of,
                              sorted(RESERVED_ENV)) from None


class _RootRef:
    """A section's link to its root config: weak (no cycle to keep a config alive), not a
    value (two equal configs must stay equal; ConfigSection.__eq__ compares values only),
    and not pickled (a section pickled on its own has no root in the receiving process;
    a pickled root config binds its sections again)."""

    __slots__ = ("_ref",)

    def __init__(self, root: Any = None) -> None:
        self._ref = weakref.ref(root) if root is not None else None

    def __call__(self) -> Any:
        return self._ref() if self._ref is not None else None

    def __eq__(self, other: object) -> bool:
        return other is None or isinstance(other, _RootRef)

    def __hash__(self) -> int:
        return 0

    def __reduce__(self) -> tuple[Any, ...]:
        return _RootRef, ()

    def __deepcopy__(self, memo: dict[int, Any]) -> _RootRef:
        return _RootRef()  # a deep copy's root binds it again (TorchBridgeConfig)


class ConfigSection(BaseModel):
    """Base of every config model, and of plugin sections: unknown keys are rejected and
    assignments validated. A bad assignment (`config.memory.max_memory_fraction = 2`)
    raises ConfigurationError naming the field path (`memory.max_memory_fraction`) and
    leaves the value unchanged. Exported as `torchbridge.ConfigSection`.

    Sections must not override __init__: pydantic calls an overridden __init__ for nested
    models too, and the error's field path would be lost. A section built on plain
    `pydantic.BaseModel` is given the same rules by the core (see `strict_section`).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    # Where this section sits in its root config: "" for the root, None while unbound.
    _path: str | None = PrivateAttr(default=None)
    # The root config this section belongs to, so that an assignment here is recorded in
    # the root's sources (see _RootRef).
    _root: Any = PrivateAttr(default_factory=lambda: _RootRef())

    def _prefix(self) -> tuple[str, ...]:
        if self._path is None:
            return (type(self).__name__,)
        return tuple(self._path.split(".")) if self._path else ()

    def __eq__(self, other: object) -> bool:
        """Equal values, wherever they came from: pydantic's own comparison also compares
        private attributes, among them the root's `sources`, so `TorchBridgeConfig() ==
        TorchBridgeConfig(strict=False)` was False, and so was a JSON round trip. Two
        hardware sections compare by their plugin sections, whichever plugin set built
        their classes."""
        if not isinstance(other, BaseModel):
            return NotImplemented
        if not isinstance(other, ConfigSection) or _kind(type(self)) is not _kind(type(other)):
            return False
        fields = type(self).model_fields
        if isinstance(self, HardwareConfig) and fields.keys() != type(other).model_fields.keys():
            return False
        return ((self.__pydantic_extra__ or {}) == (other.__pydantic_extra__ or {})
                and all(getattr(self, name) == getattr(other, name) for name in fields))

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            super().__setattr__(name, value)
            return
        prefix = self._prefix()
        # A section that belongs to a config (`b.memory = a.memory`) is assigned as a copy:
        # one object in two configs can record an assignment in only one of them, and the
        # other's `sources` would no longer describe its values.
        value = _unshared(value)
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            _raise_configuration_error(exc, prefix, {(*prefix, name): "assignment"},
                                       type(self))
        except Exception as exc:  # a plugin's validator raising something else
            if isinstance(exc, ConfigurationError):
                raise
            # As loading reports it (_merge_sections): a ConfigurationError naming the
            # field and the section's plugin, not the validator's own exception.
            key = ".".join((*prefix, name))
            owner = hardware_sections().owners.get(prefix[1]) \
                if len(prefix) > 1 and prefix[0] == "hardware" else None
            of = f" (section of plugin {owner})" if owner else ""
            raise ConfigurationError(
                f"config {key} = {value!r} (from assignment){of}: its validator raised "
                f"{describe(exc)}", field=key, value=value, source="assignment") from None
        root = self._root_config()
        child = getattr(self, name, None)
        if isinstance(child, ConfigSection) and self._path is not None:
            child._bind_paths(".".join((*prefix, name)), root)
        # `config.memory.max_memory_fraction = 0.5` is as much an assignment as
        # `config.strict = True`: the root's sources must say so, not keep crediting the
        # file or variable whose value was just replaced.
        if root is not None:
            root._record_assignment(".".join((*prefix, name)))

    def _root_config(self) -> Any:
        """The root config this section is bound in, if it is still there: a section taken
        out of a config (or left behind by a deep copy) records nothing in it."""
        root = self._root()
        if root is None or self._path is None:
            return None
        node: Any = root
        for part in self._prefix():
            node = getattr(node, part, None)
        return root if node is self else None

    def _record_assignment(self, key: str) -> None:
        """Overridden by the root config, which keeps the sources."""

    def _bind_paths(self, path: str, root: ConfigSection | None = None) -> None:
        """Tell this model and the sections inside it where they sit in the root config."""
        self._path = path
        self._root = _RootRef(root)
        for name in type(self).model_fields:
            child = getattr(self, name, None)
            if isinstance(child, ConfigSection):
                child._bind_paths(f"{path}.{name}" if path else name, root)


ConfigModel = ConfigSection  # the name plugins written before ConfigSection import

# strict_section's subclass -> the plugin's model it was made from: the same section, for
# equality, whichever plugin-set build made the subclass.
_strict_origin: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


def _kind(model: type) -> type:
    """What a section's class is, for equality: every HardwareConfig built for a plugin set
    is HardwareConfig, a strict_section subclass is the plugin's model."""
    if issubclass(model, HardwareConfig):
        return HardwareConfig
    return _strict_origin.get(model, model)


def _unshared(value: Any) -> Any:
    """`value`, or a deep copy of it where it is a section bound in a config (see
    ConfigSection.__setattr__); the values of a dict likewise."""
    if isinstance(value, ConfigSection) and value._root_config() is not None:
        return value.model_copy(deep=True)
    if isinstance(value, dict):
        return {key: _unshared(item) for key, item in value.items()}
    return value


def strict_section(model: type[BaseModel]) -> type[ConfigSection]:
    """`model` with ConfigSection's rules. A plain BaseModel section would silently drop a
    misspelt key; this subclass forbids unknown keys (unless the model chose `extra`
    itself) and validates assignments. It is still an instance of the plugin's class."""
    if issubclass(model, ConfigSection):
        return model
    settings = dict(model.model_config)
    settings.setdefault("extra", "forbid")
    settings["validate_assignment"] = True
    strict: type[ConfigSection] = type(model.__name__, (model, ConfigSection), {
        "model_config": ConfigDict(**settings),  # type: ignore[typeddict-item]
        "__module__": model.__module__, "__qualname__": model.__qualname__,
        "__doc__": model.__doc__})
    _strict_origin[strict] = model
    return strict


def not_a_bool(value: Any) -> Any:
    """For a numeric field's `mode="before"` validator: a bool is an int to Python and to
    pydantic's lax mode, which read `max_memory_fraction: true` as a cap of 1.0; a number
    field of the core takes numbers only, as shapes and byte counts do."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the bool {value}")
    return value


class KernelConfig(ConfigSection):
    enabled: bool = Field(default=True, description="use the kernels plugins provide for "
                          "torchbridge ops (off: every op runs its reference)")
    disabled_ops: list[str] = Field(default_factory=list,
                                    description="ops that always use the reference kernel")
    substitute: bool = Field(default=True, description="at O3, swap modules that compute an "
                             "op (RMSNorm, SwiGLU MLPs) for ones calling the chosen kernel")
    cache_dir: str | None = Field(default=None, description="where compiled kernels are "
                                  "cached (None: $XDG_CACHE_HOME/torchbridge or "
                                  "~/.cache/torchbridge)")


class MemoryConfig(ConfigSection):
    max_memory_fraction: float | None = Field(
        default=None, gt=0.0, le=1.0,
        description="cap this process's share of device memory (None: no cap)")
    enable_oom_protection: bool = Field(
        default=True, description="check an allocation against free device memory (times "
        "oom_safety_margin) before making it, and raise OutOfMemoryError naming the figures")
    oom_safety_margin: float = Field(
        default=1.1, ge=1.0, le=10.0, description="factor on a requested size that must fit "
        "in free device memory when enable_oom_protection is on")

    _numbers = field_validator("max_memory_fraction", "oom_safety_margin",
                               mode="before")(not_a_bool)


QuantizeMode = Literal["int8", "int8_weight_only", "int4_weight_only", "float8"]


class OptimizationConfig(ConfigSection):
    disabled_passes: list[str] = Field(default_factory=list,
                                       description="pass names prepare_model must skip")
    quantize: QuantizeMode | None = Field(
        default=None, description="quantize the model's Linear layers with torchao "
        "(int8: dynamic int8 activations and int8 weights); None: no quantization. "
        "prepare_model(quantize=...) overrides it")
    quantize_min_cosine: float = Field(
        default=0.99, ge=-1.0, le=1.0, description="accuracy gate of a quantized model: "
        "least cosine similarity of its outputs to the unquantized model's on the sample "
        "input; below it the quantization is rolled back")
    quantize_min_argmax_agreement: float = Field(
        default=0.90, ge=0.0, le=1.0, description="accuracy gate of a quantized model: "
        "least share of rows whose argmax (top class or token) matches the unquantized "
        "model's on the sample input")

    _numbers = field_validator("quantize_min_cosine", "quantize_min_argmax_agreement",
                               mode="before")(not_a_bool)
    time_first_call: bool = Field(
        default=True, description="without a sample input, O2 and O3 time the prepared "
        "model on its first call's input (eval mode) against O0 and itself uncompiled, and "
        "keep the fastest; until then prepare_model keeps what undoes its passes (a copy "
        "of the model's tensors). False: no timing, the prepared model as it is")
    compile_cache_dir: str | None = Field(
        default=None, description="where torch.compile keeps compiled artifacts, so that "
        "another process preparing the same model reuses them (None: inductor's default, "
        "$TORCHINDUCTOR_CACHE_DIR or a folder under the system's temporary directory)")


class HardwareConfig(ConfigSection):
    """Holds one section per installed plugin; the concrete class is built at load time.
    It pickles as its values, rebuilt against the receiving process's plugin sections."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_hardware, (self.model_dump(by_alias=True),)


def _rebuild_hardware(values: dict[str, Any]) -> HardwareConfig:
    hardware = _validate_hardware(values, {("hardware",): "a pickled config"})
    hardware._bind_paths("hardware")
    return hardware


@dataclass(frozen=True)
class HardwareSections:
    """The HardwareConfig class built for one plugin set, and which plugin owns each
    section."""

    model: type[HardwareConfig]
    owners: dict[str, str]
    # Sections left out, and why ("plugin bad: section hardware.bad ..."), so that a
    # setting for one is not answered with "no installed plugin provides it".
    rejected: dict[str, str] = field(default_factory=dict)


_sections: tuple[PluginHost, int, HardwareSections] | None = None  # (host, generation, sections)
_sections_lock = threading.Lock()


def _section_problem(name: object, model: object, taken: dict[str, str]) -> str | None:
    if not (isinstance(name, str) and name.isidentifier()):
        return f"section name must be an identifier, got {name!r}"
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return f"section hardware.{name} must be a pydantic model class, got {model!r}"
    if name in taken:
        return f"section hardware.{name} is already provided by plugin {taken[name]}"
    return None


def _defaults_problem(name: str, plugin: str, model: type[BaseModel],
                      defaults: BaseModel) -> str | None:
    """Why the defaults of section `name` are not values of its own fields, or None.
    pydantic does not validate defaults, so `threads: int = Field(-3, ge=1)` builds; but a
    config pickles as its values (to a spawned worker) and those would be refused there,
    blamed on "a pickled config". The same round trip here refuses the section at once."""
    try:
        model.model_validate(defaults.model_dump(by_alias=True))
    except ValidationError as exc:
        error = configuration_error(exc, ("hardware", name), {}, model, _source_of)
        return (f"section hardware.{name} of plugin {plugin} has defaults its own fields "
                f"refuse: {error}")
    except BaseException as exc:
        if is_fatal(exc):
            raise
        return (f"section hardware.{name} of plugin {plugin}: its defaults cannot be "
                f"validated again (as a pickled config is): {describe(exc)}")
    return None


def hardware_sections() -> HardwareSections:
    """The plugin sections of the current plugin set, built once per set. A section that
    is malformed or cannot be built from its defaults is left out, and its plugin is
    reported with an error naming `hardware.<name>`."""
    global _sections
    host = get_plugin_host()
    cached: HardwareSections | None = cached_for(_sections, host)
    if cached is not None:
        return cached
    with exclusive_step("building config sections"), _sections_lock:
        cached = cached_for(_sections, host)  # another thread may have built them meanwhile
        if cached is not None:
            return cached
        results = list(host.call_each("torchbridge_config_section"))
        # A section name belongs to the plugin that provided it first: built-ins, then
        # installed entry points, then register_plugin calls, each in the order they were
        # registered (pluggy keeps that order). pluggy *calls* the latest registered first,
        # so a plugin registered at run time took hardware.nvidia from the NVIDIA plugin,
        # which was then the one reported. Built-ins come first whatever happens: a plugin
        # cannot replace hardware.cpu.
        registered = {name: index for index, (name, _) in
                      enumerate(host.pm.list_name_plugin())}

        def claim_order(item: tuple[str, Any]) -> tuple[bool, int]:
            record = host.records.get(item[0])
            return (record is None or record.group != "builtin",
                    registered.get(item[0], len(registered)))

        results.sort(key=claim_order)
        fields: dict[str, Any] = {}
        owners: dict[str, str] = {}
        rejected: dict[str, str] = {}
        for plugin, result in results:
            try:
                name, model = result
            except (TypeError, ValueError):
                host.record_hook_error(plugin, "torchbridge_config_section",
                                       f"expected (name, pydantic model class), got {result!r}")
                continue
            problem = _section_problem(name, model, owners)
            if problem is None:
                model = strict_section(model)
                try:
                    defaults = model()
                except BaseException as exc:
                    if is_fatal(exc):
                        raise
                    problem = (f"section hardware.{name} cannot be built from its defaults "
                               f"(every field needs one): {describe(exc)}")
                else:
                    problem = _defaults_problem(name, plugin, model, defaults)
            if problem is not None:
                host.record_hook_error(plugin, "torchbridge_config_section", problem)
                if isinstance(name, str) and name not in owners:
                    rejected[name] = f"plugin {plugin}: {problem}"
                continue
            fields[name] = (model, Field(default_factory=model))
            owners[name] = plugin
        sections = HardwareSections(
            create_model("HardwareConfig", __base__=HardwareConfig, **fields), owners,
            {name: why for name, why in rejected.items() if name not in owners})
        _sections = (host, host.generation, sections)
        return sections


def hardware_model() -> type[HardwareConfig]:
    """The HardwareConfig subclass with a field per plugin section."""
    return hardware_sections().model


def default_section(name: str) -> ConfigSection | None:
    """Section `hardware.<name>` of the current plugin set with its defaults (its errors
    name `hardware.<name>`), or None when no plugin provides it: the section of a config
    built before that plugin was registered, which could set none of its values."""
    info = hardware_sections().model.model_fields.get(name)
    if info is None or not isinstance(info.annotation, type):
        return None
    section: ConfigSection = info.annotation()
    section._bind_paths(f"hardware.{name}")
    return section


def _shown(path: Path) -> str:
    """A path for a message; an overlong one shortened (it may be thousands of characters)."""
    text = str(path)
    return text if len(text) <= 200 else f"{text[:120]}...{text[-60:]} ({len(text)} characters)"


def _read_file(path: Path) -> bytes:
    """The bytes of config file `path`; ConfigurationError naming it for anything that is
    not a readable regular file. Opened non-blocking, so a FIFO is refused, not waited on."""
    def error(problem: str) -> ConfigurationError:
        return ConfigurationError(f"config file {_shown(path)} {problem}", source=str(path))

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error("does not exist") from None
    except IsADirectoryError:
        raise error("is a directory, not a file") from None
    except (OSError, ValueError) as exc:  # permissions, an overlong name, a NUL byte
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise error(f"cannot be read: {reason}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise error("is a directory, not a file")
        if not stat.S_ISREG(mode):
            raise error("is not a regular file (a FIFO, socket or device)")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise error(f"cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _read_toml(path: Path, data: bytes | None = None) -> dict[str, Any]:
    """The TorchBridge settings in `path`: the whole of a torchbridge.toml, the
    [tool.torchbridge] table of a pyproject.toml."""
    raw = _read_file(path) if data is None else data
    shown = _shown(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigurationError(f"config file {shown} is not UTF-8 text (TOML must be): "
                                 f"{exc}", source=str(path)) from None
    try:
        settings: Any = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"config file {shown} is not valid TOML: {exc}",
                                 source=str(path)) from None
    if path.name == "pyproject.toml":
        tool = settings.get("tool", {})
        if not isinstance(tool, dict):
            raise ConfigurationError(f"config file {shown}: `tool` must be a table, got "
                                     f"{tool!r}", source=str(path))
        settings = tool.get("torchbridge", {})
        if not isinstance(settings, dict):
            raise ConfigurationError(f"config file {shown}: [tool.torchbridge] must be a "
                                     f"table, got {settings!r}", source=str(path))
    return dict(settings)


def find_config_file(start: Path | None = None, *,
                     environ: dict[str, str] | None = None,
                     ignored: dict[str, str] | None = None) -> Path | None:
    """TORCHBRIDGE_CONFIG_FILE, else torchbridge.toml, else a pyproject.toml with
    [tool.torchbridge], in the working directory. A pyproject.toml that does not mention
    torchbridge is not parsed: it is some other tool's, and its faults are not ours.
    `environ` (default os.environ) is where TORCHBRIDGE_CONFIG_FILE is looked up:
    `load(environ=...)` reads no other environment.

    With both files there, torchbridge.toml is read and the pyproject.toml's
    [tool.torchbridge] is not: that is logged as a warning (once per pair of files) and
    said in `ignored` ({path: why}, which `load` keeps as `config.ignored_sources`)."""
    explicit = (os.environ if environ is None else environ).get(CONFIG_FILE_ENV)
    if explicit:
        return Path(explicit)
    folder = start or Path.cwd()
    pyproject = folder / "pyproject.toml"
    if os.path.lexists(folder / "torchbridge.toml"):
        chosen = folder / "torchbridge.toml"
        if _has_our_table(pyproject, quiet=True):
            why = (f"its [tool.torchbridge] is not read: {_shown(chosen)} is in the same "
                   "folder, and torchbridge.toml comes first (move the settings into one "
                   "file)")
            if ignored is not None:
                ignored[str(pyproject)] = why
            _warn_once((str(pyproject), str(chosen)), f"config file {_shown(pyproject)}: "
                       f"{why}")
        return chosen
    return pyproject if _has_our_table(pyproject) else None


def _has_our_table(pyproject: Path, quiet: bool = False) -> bool:
    """Whether `pyproject` is a file with a non-empty [tool.torchbridge]. A fault in one
    that mentions torchbridge is a ConfigurationError naming it, or (`quiet`, for a file
    that is not read anyway) False."""
    if not pyproject.is_file():
        return False
    try:
        data = _read_file(pyproject)
        return b"torchbridge" in data and bool(_read_toml(pyproject, data))
    except ConfigurationError:
        if quiet:
            return False
        raise


_warned: set[tuple[str, ...]] = set()  # warnings already logged in this process


def _warn_once(key: tuple[str, ...], message: str) -> None:
    """Log `message` the first time `key` is seen: a config is loaded on every
    get_backend() without one, and the same file or variable would be named each time."""
    if key not in _warned:
        _warned.add(key)
        logger.warning("%s", message)


def _env_path(parts: tuple[str, ...], model: type[BaseModel] | None) -> tuple[str, ...]:
    """`parts` (lowercased from a variable's name) as the keys `model` accepts: a variable
    name has no case to give, so TORCHBRIDGE_HARDWARE__X__MAXBATCH sets a field `maxBatch`
    (or one aliased `MaxBatch`). A part that matches no key is left for validation to
    refuse."""
    out: list[str] = []
    for part in parts:
        if model is None:
            out.append(part)
            continue
        if issubclass(model, HardwareConfig):
            model = hardware_model()
        keys = input_keys(model)
        key = part if part in keys else next(
            (key for key in keys if key.lower() == part), part)
        out.append(key)
        info = model.model_fields.get(keys.get(key, key))
        model = section_model(info.annotation) if info is not None else None
    return tuple(out)


def _env_layer(environ: dict[str, str], model: type[BaseModel] | None = None,
               ignored: dict[str, str] | None = None
               ) -> dict[tuple[str, ...], tuple[Any, str]]:
    """The settings of the TORCHBRIDGE_* variables, flattened to one entry per key. A JSON
    table (`TORCHBRIDGE_MEMORY='{"max_memory_fraction": 0.5}'`) sets the keys it names, no
    others. Variables are applied shallowest first (then by name), so the outcome never
    depends on the order of the environment: a more specific variable
    (TORCHBRIDGE_MEMORY__OOM_SAFETY_MARGIN) wins over a whole section's JSON for its key.

    The prefix is upper case, as for every TORCHBRIDGE_ variable (the plugin lists too);
    the rest of the name matches keys whatever its case. A variable whose prefix is in
    another case (`torchbridge_strict`) is not read: that is logged as a warning (once per
    name) and said in `ignored`."""
    layer: dict[tuple[str, ...], tuple[Any, str]] = {}
    ordered = sorted(environ.items(), key=lambda item: (item[0].count("__"), item[0]))
    for var, raw in ordered:
        if not var.startswith(ENV_PREFIX) and var.upper().startswith(ENV_PREFIX):
            upper = var.upper()
            why = (f"not read: TorchBridge's variables start with {ENV_PREFIX} in capitals "
                   f"(rename it {upper})")
            if ignored is not None:
                ignored[f"environment variable {var}"] = why
            _warn_once(("env", var), f"environment variable {var} is {why}")
            continue
        if not var.startswith(ENV_PREFIX) or var in RESERVED_ENV:
            continue
        path = _env_path(tuple(var[len(ENV_PREFIX):].lower().split("__")), model)
        value: Any = raw
        if raw.strip().startswith(("[", "{")) or raw.strip() == "null":
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ConfigurationError(f"{var}: not valid JSON: {exc}", field=".".join(path),
                                         value=raw, source=f"environment variable {var}") from None
        source = f"environment variable {var}"
        entries = (_flatten(value, source, path) if isinstance(value, dict)
                   else {path: (value, source)})
        _merge(layer, entries)
    return layer


def _flatten(data: dict[str, Any], source: str, prefix: tuple[str, ...] = ()
             ) -> dict[tuple[str, ...], tuple[Any, str]]:
    """One entry per key; an empty table stays an entry ({}), which `_merge` keeps only
    where nothing else sets that section."""
    flat: dict[tuple[str, ...], tuple[Any, str]] = {}
    for key, value in data.items():
        path = (*prefix, str(key))
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, source, path))
        else:
            flat[path] = (value, source)
    if not data and prefix:
        flat[prefix] = ({}, source)
    return flat


def _merge(flat: dict[tuple[str, ...], tuple[Any, str]],
           layer: dict[tuple[str, ...], tuple[Any, str]]) -> None:
    """Apply `layer`'s entries to `flat`, key by key: a later entry replaces the value at
    its own key, and whatever lay below it (a value that is not a table replaces the whole
    section) or above it (a value where the key needs a section). An empty table sets
    nothing (`load(memory={})` keeps the file's memory settings) unless nothing else is
    there. So every entry left is a value the config really gets, and `sources` credits
    only those."""
    for path, (value, source) in layer.items():
        below = [key for key in flat if key[:len(path)] == path and len(key) > len(path)]
        if isinstance(value, dict) and not value:
            if (path in flat and isinstance(flat[path][0], dict)) or below:
                continue
        for key in below:
            del flat[key]
        for cut in range(1, len(path)):
            flat.pop(path[:cut], None)
        flat[path] = (value, source)


def _nest(flat: dict[tuple[str, ...], tuple[Any, str]]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for path, (value, source) in flat.items():
        node = nested
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigurationError(
                    f"config key '{'.'.join(path)}' (from {source}): '{'.'.join(path[:-1])}' "
                    "is a value, not a section",
                    field=".".join(path), value=value, source=source)
            node = child
        node[path[-1]] = value
    return nested


def _missing_section_reason(name: str, sections: HardwareSections) -> str | None:
    """Why section `name` is absent when a plugin is installed that would provide it: the
    plugin is disabled (or failed to load), or its section was rejected. A disabled
    plugin's hooks are never called, so its section is taken to bear its name, as every
    vendor plugin's does."""
    if name in sections.rejected:
        return f"its section was rejected ({sections.rejected[name]})"
    host = get_plugin_host()
    for record in host.records.values():
        if record.name.split("[")[0] == name and record.status in (
                "disabled", "failed", "incompatible"):
            reason = record.error or record.status
            return (f"plugin {record.name} is installed but not loaded ({reason}), so its "
                    "section is not available")
    return None


def _validate_hardware(values: dict[str, Any], sources: dict[tuple[str, ...], str]
                       ) -> HardwareConfig:
    """Each plugin section on its own, so an error names `hardware.<name>` and the plugin
    that owns it, whatever the plugin's validators raise."""
    sections = hardware_sections()
    fields = sections.model.model_fields
    validated: dict[str, Any] = {}
    for name, value in values.items():
        if name not in fields:
            source = _source_of(("hardware", name), sources)
            why = _missing_section_reason(name, sections)
            hint = "" if why else unknown_key_suggestion(("hardware", name), list(fields),
                                                         source, what="sections")
            raise ConfigurationError(
                f"unknown config section 'hardware.{name}' (from {source}): "
                f"{why or 'no installed plugin provides it'}{hint}",
                field=f"hardware.{name}", value=value, source=source)
        model = fields[name].annotation
        assert isinstance(model, type)
        owner = f" (section of plugin {sections.owners[name]})"
        try:
            validated[name] = model.model_validate(value)
        except ValidationError as exc:
            try:
                _raise_configuration_error(exc, ("hardware", name), sources, model)
            except ConfigurationError as error:
                raise ConfigurationError(str(error) + owner, field=error.field,
                                         value=error.value, source=error.source) from None
        except Exception as exc:  # a plugin's validator raising something else
            source = _source_of(("hardware", name), sources)
            raise ConfigurationError(
                f"config section 'hardware.{name}' (from {source}){owner}: its validator "
                f"raised {describe(exc)}", field=f"hardware.{name}", value=value,
                source=source) from None
    return sections.model(**validated)


class TorchBridgeConfig(ConfigSection):
    """The root config. `TorchBridgeConfig(...)` takes only its arguments;
    `TorchBridgeConfig.load(...)` and the presets read every source."""

    optimization_level: OptimizationLevel = Field(
        default=OptimizationLevel.O2, description="prepare_model's level when none is "
        "given: O0 placement only, O1 exact rewrites, O2 low precision and compile, O3 "
        "everything for inference")
    precision: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="low-precision dtype at O2+; auto: the device's preferred one")
    backend: str | None = Field(default=None, description="force a backend by name")
    strict: bool = Field(default=False, description="a failing optimization pass raises")
    logging_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] | None = Field(
        default=None, description="level of the 'torchbridge' logger, set when a backend is "
        "created (None: leave the logger as the application set it)")
    kernel: KernelConfig = Field(default_factory=KernelConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    optimization: OptimizationConfig = Field(default_factory=OptimizationConfig)
    # SerializeAsAny: dump the plugin sections of the concrete class, not the empty base.
    hardware: SerializeAsAny[HardwareConfig] = Field(default_factory=lambda: hardware_model()())

    _sources: dict[str, str] = {}
    _ignored: dict[str, str] = {}

    _PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "training": {"optimization_level": "O2"},
        "inference": {"optimization_level": "O3"},
        "development": {"optimization_level": "O0", "strict": True, "logging_level": "DEBUG"},
    }

    def __init__(self, **data: Any) -> None:
        sources = getattr(_load_context, "sources", None) or {
            (key,): "keyword arguments" for key in data}
        # A section of another config is taken as a copy (see ConfigSection.__setattr__).
        data = {key: _unshared(value) for key, value in data.items()}
        hardware = data.pop("hardware", None)
        if isinstance(hardware, dict):
            data["hardware"] = _validate_hardware(hardware, sources)
        elif hardware is not None:
            data["hardware"] = hardware
        try:
            BaseModel.__init__(self, **data)
        except ValidationError as exc:
            _raise_configuration_error(exc, (), sources, type(self))
        self._bind_paths("", self)
        self._sources = {".".join(path): source for path, source in sources.items()}
        self._ignored = dict(getattr(_load_context, "ignored", None) or {})

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "hardware" and isinstance(value, dict):
            # The field's declared type is the empty base class; the sections are checked
            # against this plugin set's concrete class, as when loading.
            value = _validate_hardware(_unshared(value), {("hardware",): "assignment"})
        super().__setattr__(name, value)  # records the assignment (_record_assignment)

    def _record_assignment(self, key: str) -> None:
        # A new dict, not an update: a shallow copy of this config shares the old one.
        sources = {path: source for path, source in self._sources.items()
                   if path != key and not path.startswith(f"{key}.")}
        sources[key] = "assignment"
        self._sources = sources

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> TorchBridgeConfig:
        # The copy's sections must record assignments in the copy, not in this config.
        copied = super().__deepcopy__(memo)
        copied._bind_paths("", copied)
        return copied

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles as its values and their sources, rebuilt in the receiving process
        against its own plugin sections (a spawned worker gets an equal config)."""
        return _rebuild_config, (type(self), self.model_dump(by_alias=True),
                                 dict(self._sources), dict(self._ignored))

    @field_validator("optimization_level", mode="before")
    @classmethod
    def _parse_level(cls, value: Any) -> Any:
        try:
            return OptimizationLevel.parse(value)
        except ConfigurationError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("precision", mode="before")
    @classmethod
    def _parse_precision(cls, value: Any) -> Any:
        if isinstance(value, str):
            return _PRECISION_ALIASES.get(value.lower(), value.lower())
        return value

    @property
    def sources(self) -> dict[str, str]:
        """Where each value that is not a default came from: {"memory.max_memory_fraction":
        "environment variable TORCHBRIDGE_MEMORY__MAX_MEMORY_FRACTION", ...}."""
        return dict(self._sources)

    @property
    def ignored_sources(self) -> dict[str, str]:
        """What `load` found and did not read, and why: {"/project/pyproject.toml": "its
        [tool.torchbridge] is not read: /project/torchbridge.toml is in the same folder,
        ...", "environment variable torchbridge_strict": "not read: ..."}. Each is also
        logged as a warning, once per process."""
        return dict(self._ignored)

    @classmethod
    def load(cls, config_file: str | Path | None = None, *, preset: str | None = None,
             environ: dict[str, str] | None = None, **overrides: Any) -> TorchBridgeConfig:
        """Read every source: defaults or preset, config file, environment, `overrides`."""
        flat: dict[tuple[str, ...], tuple[Any, str]] = {}
        ignored: dict[str, str] = {}
        if preset is not None:
            if preset not in cls._PRESETS:
                raise ConfigurationError(f"unknown preset {preset!r}; choose one of "
                                         f"{', '.join(cls._PRESETS)}", field="preset",
                                         value=preset, source="preset")
            _merge(flat, _flatten(cls._PRESETS[preset], f"preset {preset}"))
        env = dict(os.environ if environ is None else environ)
        path = (Path(config_file) if config_file is not None
                else find_config_file(environ=env, ignored=ignored))
        if path is not None:
            _merge(flat, _flatten(_read_toml(path), str(path)))
        _merge(flat, _env_layer(env, cls, ignored))
        _merge(flat, _flatten(overrides, "keyword arguments"))
        data = _nest(flat)
        _load_context.sources = {path: source for path, (_, source) in flat.items()}
        _load_context.ignored = ignored
        try:
            return cls(**data)
        finally:
            _load_context.sources = _load_context.ignored = None

    @classmethod
    def for_training(cls, **overrides: Any) -> TorchBridgeConfig:
        """O2: mixed precision and compilation; the model stays trainable."""
        return cls.load(preset="training", **overrides)

    @classmethod
    def for_inference(cls, **overrides: Any) -> TorchBridgeConfig:
        """O3: everything, including eval-only passes such as freezing."""
        return cls.load(preset="inference", **overrides)

    @classmethod
    def for_development(cls, **overrides: Any) -> TorchBridgeConfig:
        """O0, strict, debug logging: nothing clever between you and your bug."""
        return cls.load(preset="development", **overrides)


def _rebuild_config(cls: type[TorchBridgeConfig], values: dict[str, Any],
                    sources: dict[str, str], ignored: dict[str, str] | None = None
                    ) -> TorchBridgeConfig:
    _load_context.sources = {(key,): "a pickled config" for key in values}
    try:
        config = cls(**values)
    finally:
        _load_context.sources = None
    config._sources = dict(sources)
    config._ignored = dict(ignored or {})
    return config


_load_context = threading.local()
