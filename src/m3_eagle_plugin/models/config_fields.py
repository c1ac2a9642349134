"""Typed, located reads of checkpoint `config.json` fields.

Every field the model and draft configs read goes through `ConfigFields`, so a wrong type, range
or shape fails as one `ConfigError` "<file>: <field>: <what is wrong>" before any weight is read.
"""
from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any, Mapping

_REQUIRED = object()


class ConfigError(ValueError):
    """A checkpoint config is missing a field or holds a value the model cannot run."""


def show_value(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_refusal(error: ValueError | RecursionError) -> str:
    """Why `json.loads` refused a file's text, as its refusal reads after the file's name: malformed
    (where), nested past Python's stack, or holding an integer literal longer than Python converts
    (`sys.get_int_max_str_digits`)."""
    if isinstance(error, json.JSONDecodeError):
        return f"not valid JSON ({error.msg} at line {error.lineno} column {error.colno})"
    if isinstance(error, RecursionError):
        return "not valid JSON (nested too deeply)"
    return f"cannot be read as JSON ({str(error).split(';')[0]})"


def read_json_object(path: Path) -> dict[str, Any]:
    """The top-level JSON object of a config file; a missing path, one that is not a file (a directory
    named config.json), unreadable, malformed (nested past the stack included), holding an integer
    too long for Python to read, or non-object JSON is a ConfigError."""
    if path.exists() and not path.is_file():
        raise ConfigError(f"{path} is not a file")
    if not path.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not valid JSON (not UTF-8 text)") from None
    except (ValueError, RecursionError) as error:
        raise ConfigError(f"{path}: {json_refusal(error)}") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot be read ({error.strerror or error})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a JSON object, got {type(raw).__name__}")
    return raw


def _finite(value: numbers.Real) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # a JSON integer too large for a float
        return False


class ConfigFields:
    """Typed, range-checked reads from one JSON object of a config file; errors name the file and field."""

    def __init__(self, raw: Any, source: str, section: str = "") -> None:
        if not isinstance(raw, Mapping):
            what = section or "top level"
            raise ConfigError(f"{source}: {what}: must be a JSON object, got {type(raw).__name__}")
        self.raw, self.source, self.section = raw, source, section

    def name(self, key: str) -> str:
        return f"{self.section}.{key}" if self.section else key

    def error(self, key: str, what: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.name(key)}: {what}")

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def need(self, key: str, default: Any = _REQUIRED) -> Any:
        """The raw value; a missing or null field takes `default` (none given: the field is required)."""
        value = self.raw.get(key)
        if value is None:
            if default is _REQUIRED:
                raise self.error(key, "required field is null" if key in self.raw else "required field is missing")
            return default
        return value

    def get_int(self, key: str, default: Any = _REQUIRED, minimum: int | None = None) -> int:
        value = self.need(key, default)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self.error(key, f"expected an integer, got {type(value).__name__} {show_value(value)}")
        if not isinstance(value, numbers.Integral) and not float(value).is_integer():
            raise self.error(key, f"expected an integer, got {show_value(value)}")
        value = int(value)
        if minimum is not None and value < minimum:
            raise self.error(key, f"must be >= {minimum}, got {value}")
        return value

    def get_float(self, key: str, default: Any = _REQUIRED, positive: bool = False) -> float:
        value = self.need(key, default)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not _finite(value):
            raise self.error(key, f"expected a finite number, got {type(value).__name__} {show_value(value)}")
        if positive and value <= 0:
            raise self.error(key, f"must be > 0, got {value}")
        return float(value)

    def get_bool(self, key: str, default: bool) -> bool:
        value = self.need(key, default)
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return bool(value)
        raise self.error(key, f"expected true or false, got {type(value).__name__} {show_value(value)}")

    def get_int_list(self, key: str, default: Any = _REQUIRED) -> tuple[int, ...]:
        values = self.need(key, default)
        if not isinstance(values, (list, tuple)):
            raise self.error(key, f"must be a list of integers, got {type(values).__name__}")
        for i, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise self.error(f"{key}[{i}]", f"expected an integer, got {type(value).__name__} {show_value(value)}")
        return tuple(int(v) for v in values)

    def get_section(self, key: str) -> "ConfigFields | None":
        """A nested object (None when absent)."""
        if not self.has(key):
            return None
        return ConfigFields(self.raw[key], self.source, self.name(key))

    def get_pattern(self, key: str, meaning: Mapping[Any, bool], num_layers: int) -> tuple[bool, ...]:
        """A per-layer list whose entries are keys of `meaning`, exactly one per layer."""
        values = self.need(key)
        if not isinstance(values, (list, tuple)):
            raise self.error(key, f"must be a list, got {type(values).__name__}")
        if len(values) != num_layers:
            raise self.error(
                key, f"has {len(values)} entries, expected {num_layers} (one per layer: num_hidden_layers)")
        out = []
        for i, value in enumerate(values):
            entry = int(value) if isinstance(value, numbers.Integral) else value  # bool counts as 0 / 1
            if not isinstance(entry, (str, int)) or entry not in meaning:
                raise self.error(f"{key}[{i}]", f"{show_value(value)} is not one of {sorted(meaning, key=str)}")
            out.append(meaning[entry])
        return tuple(out)
