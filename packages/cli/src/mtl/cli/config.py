"""Reading the run config for a command: the TOML file plus ``--set`` overrides."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mtl.core.config import RunConfig
from mtl.core.config_io import apply_override, config_from_dict, load_config


def load_run_config(path: str | None, overrides: Iterable[str] = ()) -> RunConfig:
    """``load_config`` after checking the overrides on their own, so that a misspelt
    ``--set`` key is reported as coming from ``--set``, not from the TOML file."""
    overrides = list(overrides)
    if overrides:
        data: dict[str, Any] = {}
        for item in overrides:
            apply_override(data, item)
        config_from_dict(data, source="--set")
    return load_config(path, overrides)
