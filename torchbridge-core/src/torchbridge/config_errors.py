"""Config mistakes in the user's words: pydantic's ValidationError becomes one
ConfigurationError whose message names the key, what it must be, the value given and where
it came from, with the nearest known key for a misspelt one:

    unknown config key 'optimization_levle' (from torchbridge.toml); did you mean
    'optimization_level'?
    config key 'memory.max_memory_fraction' must be a number above 0 and at most 1, got
    'lots' (from environment variable TORCHBRIDGE_MEMORY__MAX_MEMORY_FRACTION)

What a key must be comes from the field's type and bounds where the model is known, else
from the pydantic error type (`_EXPECTED`); no pydantic phrase ("Input should be", "Extra
inputs are not permitted") reaches the user.
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from torchbridge.errors import ConfigurationError
from torchbridge.suggestions import did_you_mean

ENV_PREFIX = "TORCHBRIDGE_"  # of the variables that set config keys (torchbridge.config)

# pydantic error type -> what the value must be (formatted with the error's ctx). Used
# where the field itself cannot tell: a list element, a plugin field of an unusual type.
_EXPECTED = {
    "bool_type": "true or false", "bool_parsing": "true or false",
    "int_type": "a whole number", "int_parsing": "a whole number",
    "int_from_float": "a whole number", "int_parsing_size": "a whole number of a usable size",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "decimal_type": "a number", "decimal_parsing": "a number",
    "string_type": "text", "string_unicode": "text", "bytes_type": "text",
    "string_too_short": "text of at least {min_length} character(s)",
    "string_too_long": "text of at most {max_length} character(s)",
    "string_pattern_mismatch": "text matching {pattern}",
    "list_type": "a list", "tuple_type": "a list", "set_type": "a list",
    "frozen_set_type": "a list", "iterable_type": "a list",
    "too_short": "a list of at least {min_length} item(s)",
    "too_long": "a list of at most {max_length} item(s)",
    "dict_type": "a table of settings", "mapping_type": "a table of settings",
    "model_type": "a table of settings", "model_attributes_type": "a table of settings",
    "dataclass_type": "a table of settings",
    "literal_error": "one of {expected}", "enum": "one of {expected}",
    "greater_than": "greater than {gt}", "greater_than_equal": "at least {ge}",
    "less_than": "less than {lt}", "less_than_equal": "at most {le}",
    "multiple_of": "a multiple of {multiple_of}",
    "none_required": "null", "is_instance_of": "a {class}", "is_subclass_of": "a {class}",
    "path_type": "a file path", "url_type": "a URL", "url_parsing": "a URL",
    "uuid_type": "a UUID", "uuid_parsing": "a UUID",
    "date_type": "a date", "date_parsing": "a date", "datetime_type": "a date and time",
    "datetime_parsing": "a date and time", "time_delta_type": "a duration",
    "time_delta_parsing": "a duration", "json_type": "JSON text", "json_invalid": "valid JSON",
    "callable_type": "a callable",
}
# Left as pydantic says them, without its capitalized openings.
_PYDANTIC_OPENINGS = ("Value error, ", "Assertion failed, ")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}...{text[-12:]}"


def _number(value: Any) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def _unwrap(annotation: Any) -> list[Any]:
    """The types an annotation allows, None and Annotated/SerializeAsAny wrappers left out."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return [t for arg in typing.get_args(annotation) for t in _unwrap(arg)]
    if annotation is type(None) or annotation is None:
        return []
    return [annotation]


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The model class of a section field's annotation (Optional, Annotated and
    SerializeAsAny unwrapped), or None when it names no model."""
    found = [t for t in _unwrap(annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
    return found[0] if found else None


def _bounds(info: FieldInfo) -> str:
    low = high = ""
    for item in info.metadata:
        if getattr(item, "ge", None) is not None:
            low = f"at least {_number(item.ge)}"
        elif getattr(item, "gt", None) is not None:
            low = f"above {_number(item.gt)}"
        if getattr(item, "le", None) is not None:
            high = f"at most {_number(item.le)}"
        elif getattr(item, "lt", None) is not None:
            high = f"below {_number(item.lt)}"
    if low.startswith("at least") and high.startswith("at most"):
        return f" from {low.removeprefix('at least ')} to {high.removeprefix('at most ')}"
    parts = [part for part in (low, high) if part]
    return f" {' and '.join(parts)}" if parts else ""


def choices_of(annotation: Any) -> list[str]:
    """The values a Literal or Enum field accepts, as text."""
    out: list[str] = []
    for kind in _unwrap(annotation):
        if typing.get_origin(kind) is typing.Literal:
            out += [str(arg) for arg in typing.get_args(kind)]
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            out += [str(member.value) for member in kind]
    return out


def _expected(info: FieldInfo) -> str | None:
    """What a field's value must be, in words, from its type and bounds; None when the
    type is one these words do not cover."""
    words = []
    kinds = _unwrap(info.annotation)
    choices = choices_of(info.annotation)
    if choices:
        # A choice that may also be a boolean ("auto", true, false): one list.
        words.append(f"one of {', '.join(choices + (['true', 'false'] if bool in kinds else []))}")
    for kind in kinds:
        origin = typing.get_origin(kind) or kind
        if origin is typing.Literal or (isinstance(kind, type) and issubclass(kind, enum.Enum)):
            continue
        if kind is bool and choices:
            continue
        if kind is bool:
            words.append("true or false")
        elif kind is int:
            words.append("a whole number" + _bounds(info))
        elif kind is float:
            words.append("a number" + _bounds(info))
        elif kind is str:
            words.append("text")
        elif origin in (list, tuple, set, frozenset):
            args = typing.get_args(kind)
            words.append("a list of text values" if args[:1] == (str,) else "a list")
        elif isinstance(kind, type) and issubclass(kind, BaseModel):
            words.append("a table of settings")
        else:
            return None
    return " or ".join(dict.fromkeys(words)) or None


def input_keys(model: type[BaseModel]) -> dict[str, str]:
    """The keys `model` accepts as input -> the field each sets: a field's alias where it
    has one (and its name too where the model populates by name), else its name. An error
    must offer only keys that would be accepted."""
    by_name = bool(model.model_config.get("populate_by_name")) or bool(
        model.model_config.get("validate_by_name"))
    keys: dict[str, str] = {}
    for name, info in model.model_fields.items():
        alias = info.validation_alias if isinstance(info.validation_alias, str) else info.alias
        if alias:
            keys[alias] = name
        if not alias or by_name:
            keys.setdefault(name, name)
    return keys


def _walk(model: type[BaseModel] | None, loc: Sequence[str | int]
          ) -> tuple[list[str | int], type[BaseModel] | None, FieldInfo | None]:
    """The part of `loc` that names config keys (pydantic adds union-member tags such as
    'int' or 'function-after[...]' after them), the model holding the last key, and that
    key's field (None where unknown)."""
    if model is None:
        return [p for p in loc if isinstance(p, int) or "[" not in p], None, None
    kept: list[str | int] = []
    parent: type[BaseModel] | None = model
    info: FieldInfo | None = None
    current: Any = model
    for part in loc:
        section = section_model(current) if current is not None else None
        if isinstance(part, str) and section is not None:
            # pydantic names an aliased field by its alias in an error's location.
            field_name = input_keys(section).get(part, part)
            parent, info = section, section.model_fields.get(field_name)
            kept.append(part)
            if info is None:  # an unknown key: nothing below it is ours to name
                return kept, parent, None
            current = info.annotation
        elif isinstance(part, int) and kept:  # a list's element
            kept.append(part)
            info, current = None, None
        else:  # a union member's tag ('int', "literal['auto']"): the key ends before it
            break
    return kept, parent, info


def _path(parts: Sequence[str | int]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text or "<root>"


def _env_name(parts: Sequence[str | int]) -> str:
    return ENV_PREFIX + "__".join(str(p) for p in parts).upper()


def unknown_key_suggestion(loc: Sequence[str | int], keys: Sequence[str], source: str,
                           reserved: Sequence[str] = (), *, what: str = "keys") -> str:
    """"; did you mean 'optimization_level'?" for the unknown key at `loc` among the
    `keys` of its section; for an environment variable, the variable it should have been
    (`reserved`: the TORCHBRIDGE_* variables that are not config keys, at the top level).
    Without a close key: the keys (or `what`) there are."""
    parent, typed = list(loc[:-1]), str(loc[-1])
    variable = source.removeprefix("environment variable ") \
        if source.startswith("environment variable ") else None
    if variable is not None and variable.startswith(ENV_PREFIX):
        # The same variable with the misspelt part replaced (any deeper parts kept).
        parts = variable[len(ENV_PREFIX):].split("__")
        depth = len(parent)

        def shown(key: str) -> str:
            return key if key.startswith(ENV_PREFIX) else ENV_PREFIX + "__".join(
                [*parts[:depth], key.upper(), *parts[depth + 1:]])

        extra = list(reserved) if not parent else []
        candidates = {key: key for key in keys}
        candidates.update({name.removeprefix(ENV_PREFIX).lower(): name for name in extra})
        hint = did_you_mean(typed, list(candidates), show=lambda key: shown(candidates[key]))
    else:
        hint = did_you_mean(typed, keys, show=lambda key: f"'{_path([*parent, key])}'")
    if hint:
        return hint
    where = f"in '{_path(parent)}'" if parent else "at the top level"
    return f"; the {what} {where} are {', '.join(keys) or 'none'}"


def _problem(err: Any, prefix: tuple[str, ...], sources: dict[tuple[str, ...], str],
             model: type[BaseModel] | None, reserved: Sequence[str],
             source_of: Any) -> tuple[str, str, Any, str]:
    """(path, message, value, source) of one pydantic error."""
    kind = err["type"]
    loc, parent, info = _walk(model, tuple(err["loc"]))
    full = (*prefix, *loc)
    path = _path(full)
    source = source_of(tuple(str(p) for p in full), sources)
    value = err.get("input")
    if kind == "extra_forbidden":
        keys = list(input_keys(parent)) if parent is not None else []
        hint = unknown_key_suggestion(full, keys, source, reserved)
        return path, f"unknown config key '{path}' (from {source}){hint}", value, source
    if kind == "missing":
        return path, f"config key '{path}' is required and was not given (from {source})", \
            value, source
    if kind in ("frozen_field", "frozen_instance"):
        return path, f"config key '{path}' cannot be changed (from {source})", value, source
    if kind in ("value_error", "assertion_error"):
        message = str(err["msg"])
        for opening in _PYDANTIC_OPENINGS:
            message = message.removeprefix(opening)
        shown = "" if _shown(value) in message else f" = {_shown(value)}"
        return path, f"config key '{path}'{shown} (from {source}): {message}", value, source
    expected = _expected(info) if info is not None else None
    if expected is None and kind in _EXPECTED:
        try:
            expected = _EXPECTED[kind].format(**(err.get("ctx") or {}))
        except (KeyError, IndexError):
            expected = _EXPECTED[kind].split("{")[0].strip()
    if expected is not None:
        if expected == "a table of settings":
            expected = f"a table of settings (a section such as [{path}])"
        hint = ""
        if info is not None and isinstance(value, str):
            hint = did_you_mean(value, choices_of(info.annotation))
        return path, (f"config key '{path}' must be {expected}, got {_shown(value)} "
                      f"(from {source}){hint}"), value, source
    message = str(err["msg"]).replace("Input should be", "must be")
    return path, f"config key '{path}' = {_shown(value)} (from {source}): {message}", \
        value, source


def configuration_error(exc: ValidationError, prefix: tuple[str, ...],
                        sources: dict[tuple[str, ...], str], model: type[BaseModel] | None,
                        source_of: Any, reserved: Sequence[str] = ()) -> ConfigurationError:
    """One ConfigurationError for every problem in `exc`: `prefix` is where the validated
    model sits in the root config, `sources` where each value came from, `model` the
    validated class (for the field types and keys), `source_of(path, sources)` the lookup."""
    problems: dict[str, tuple[str, Any, str]] = {}
    for err in exc.errors():
        path, message, value, source = _problem(err, prefix, sources, model, reserved,
                                                source_of)
        problems.setdefault(path, (message, value, source))  # a union's members: one line
    (first_path, (_, first_value, first_source)), *_ = problems.items()
    messages = [message for message, _, _ in problems.values()]
    if len(messages) == 1:
        text = messages[0]
    else:
        text = (f"{len(messages)} problems in the TorchBridge configuration: "
                + "; ".join(f"({n}) {m}" for n, m in enumerate(messages, 1)))
    return ConfigurationError(text, field=first_path, value=first_value, source=first_source)
