"""One config section from a table of values: unknown and removed keys refused, each value checked
against its field's type (ints are accepted for floats)."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Iterable

from mtl.core.config_removed import refuse_removed_key
from mtl.core.config_sections import SECTIONS
from mtl.core.errors import ConfigError


def section_from_dict(name: str, values: Any, source: str = "config") -> Any:
    """The ``[name]`` section built from ``values``; ``source`` (a file, ``--set``) names where
    they came from in the errors."""
    if name not in SECTIONS:
        raise ConfigError(
            f"{source}: unknown section [{name}]{suggest(name, SECTIONS)}; sections are {', '.join(SECTIONS)}"
        )
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: [{name}] must be a table of keys")
    cls = SECTIONS[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            refuse_removed_key(f"{name}.{key}", source)
            raise ConfigError(f"{source}: unknown key {name}.{key}{suggest(key, fields)}")
        kwargs[key] = _coerce(f"{name}.{key}", value, fields[key].type)
    return cls(**kwargs)


def suggest(name: str, options: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest option, or nothing."""
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _coerce(dotted: str, value: Any, annotation: Any) -> Any:
    """Check a TOML value against a field's annotation; ints are accepted for floats."""
    hint = annotation
    if isinstance(hint, str):
        hint = eval(hint, {"list": list, "dict": dict})  # annotations are plain builtins
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    for option in options:
        if option is type(None):
            continue
        origin = typing.get_origin(option) or option
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if origin is bool and isinstance(value, bool):
            return value
        if origin in (str, list, dict) and isinstance(value, origin):
            return value
    wanted = " or ".join(getattr(o, "__name__", str(o)) for o in options if o is not type(None))
    raise ConfigError(f"{dotted} = {value!r} should be {wanted}")
