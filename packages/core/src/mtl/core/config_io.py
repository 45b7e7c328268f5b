"""Reading a RunConfig from TOML and ``--set section.key=value`` overrides, and diffing two."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Iterable

from mtl.core.config import SECTIONS, RunConfig
from mtl.core.config_values import section_from_dict
from mtl.core.errors import ConfigError


def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> RunConfig:
    """Read ``path`` (TOML) if given, apply dotted overrides, and return an unresolved config."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    overrides = list(overrides)
    if overrides:  # checked on their own first, so a misspelt key is blamed on --set, not the file
        override_data: dict[str, Any] = {}
        for item in overrides:
            apply_override(override_data, item)
        config_from_dict(override_data, source="--set")
    for item in overrides:
        apply_override(data, item)
    return config_from_dict(data, source=str(path) if path else "--set")


def parse_override_value(text: str) -> Any:
    """A TOML value (``3``, ``1e-3``, ``true``, ``[1, 2]``, ``"s"``), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    dotted, value = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2:
        raise ConfigError(f"override key {dotted!r} must be section.key (e.g. model.num_layers)")
    section, key = parts
    data.setdefault(section, {})[key] = parse_override_value(value.strip())


def config_from_dict(data: dict[str, Any], source: str = "config") -> RunConfig:
    """Build a RunConfig, rejecting unknown sections and keys with a suggestion."""
    sections = {name: section_from_dict(name, values, source) for name, values in data.items() if name != "resolved"}
    return RunConfig(**sections)


def config_diff(a: RunConfig, b: RunConfig, ignore: Iterable[str] = ()) -> list[str]:
    """Every ``section.key`` whose value differs, as ``key: a -> b`` lines."""
    skip = set(ignore)
    da, db = a.to_dict(), b.to_dict()
    lines = []
    for section in SECTIONS:
        for key in da[section]:
            dotted = f"{section}.{key}"
            if dotted in skip or section in skip:
                continue
            if da[section][key] != db[section][key]:
                lines.append(f"{dotted}: {da[section][key]!r} -> {db[section][key]!r}")
    return lines


def format_config(cfg: RunConfig) -> str:
    """The config as TOML text (None values shown as comments, since TOML has no null)."""
    out = []
    for section, values in cfg.to_dict().items():
        out.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                out.append(f"# {key} = (unset)")
            else:
                out.append(f"{key} = {_toml_value(value)}")
        out.append("")
    return "\n".join(out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)
