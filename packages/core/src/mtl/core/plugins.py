"""The plugin manager and the registries built from its hooks.

``plugin_manager()`` loads the ``mtl`` entry-point group once. Tests and applications may
``register_plugin(obj)`` in-process; doing so resets the registries so the next lookup sees it.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Any

import pluggy

from mtl.core import hookspecs
from mtl.core.errors import NotInstalledError, PluginError
from mtl.core.log import get_logger

log = get_logger(__name__)

# Which distribution provides the names users are most likely to ask for, so that a missing
# one is answered with the command that installs it.
KNOWN_PROVIDERS: dict[str, dict[str, str]] = {
    "backend": {"local": "mtl-parallel", "te": "mtl-te", "fp8": "mtl-quant"},
    "model family": {"gpt": "mtl-models"},
    "tokenizer": {n: "mtl-data" for n in ("byte", "hf", "gpt2-bpe", "sentencepiece", "tiktoken")},
    "dataset": {"gpt": "mtl-data", "mock": "mtl-data"},
    "checkpoint format": {"zarr": "mtl-ckpt"},
    "train callback": {"jsonl": "mtl-train", "tensorboard": "mtl-train"},
    "cli command": {},
}

# kind -> the hook that fills it
KIND_HOOKS: dict[str, str] = {
    "backend": "mtl_backends",
    "model family": "mtl_model_families",
    "tokenizer": "mtl_tokenizers",
    "dataset": "mtl_datasets",
    "checkpoint format": "mtl_checkpoint_formats",
    "train callback": "mtl_train_callbacks",
    "cli command": "mtl_cli_commands",
}

_manager: pluggy.PluginManager | None = None
_registries: dict[str, "Registry"] = {}
_plugin_dists: dict[str, str] = {}  # plugin name -> distribution that provided it
load_failures: list[str] = []  # entry points that raised on import, reported on lookups


def plugins_loaded() -> bool:
    """Whether the entry-point group has been loaded in this process (loading it imports every
    installed plugin, torch among them: ``mtl --help`` lists plugin commands only if it has)."""
    return _manager is not None


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with the ``mtl`` entry points loaded on first use."""
    global _manager
    if _manager is None:
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        _load_entry_points(pm)
        _manager = pm
    return _manager


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """What pluggy's ``load_setuptools_entrypoints`` does, but a broken plugin is named."""
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group != hookspecs.PROJECT or pm.get_plugin(ep.name) or pm.is_blocked(ep.name):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # one broken plugin must not take the others down
                message = (
                    f"plugin '{ep.name}' of distribution {dist.metadata['name']} failed to load "
                    f"({ep.value}): {exc!r}; reinstall or uninstall that distribution"
                )
                load_failures.append(message)
                log.warning(message)
                continue
            pm.register(plugin, name=ep.name)
            _plugin_dists[ep.name] = dist.metadata["name"]


def register_plugin(plugin: Any, name: str | None = None) -> None:
    """Register an in-process plugin (a module or object with ``@hookimpl`` functions). Registering
    the same object again does nothing, so each spawned test process may call it unguarded."""
    if plugin_manager().is_registered(plugin):
        return
    plugin_manager().register(plugin, name=name)
    _registries.clear()


def unregister_plugin(plugin: Any) -> None:
    """Take an in-process plugin out again (a test that registered one cleans up with this)."""
    plugin_manager().unregister(plugin)
    _registries.clear()


def plugin_distribution(plugin: Any) -> str:
    """The distribution a plugin was loaded from, or its module name for in-process ones."""
    name = plugin_manager().get_name(plugin)
    if name in _plugin_dists:
        return _plugin_dists[name]
    return name or getattr(plugin, "__name__", type(plugin).__name__)


@dataclass(frozen=True)
class Entry:
    value: Any
    distribution: str


class Registry:
    """Records of one kind, by name, each with the distribution that registered it."""

    def __init__(self, kind: str, entries: dict[str, Entry]):
        self.kind = kind
        self._entries = entries

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> dict[str, Entry]:
        return dict(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> Any:
        if name not in self._entries:
            have = ", ".join(self.names()) or "none"
            message = f"{self.kind} '{name}' is not installed (installed: {have})"
            provider = KNOWN_PROVIDERS.get(self.kind, {}).get(name)
            if provider:
                message += f": pip install {provider}"
            if load_failures:
                message += "\n(some plugins failed to load: " + "; ".join(load_failures) + ")"
            raise NotInstalledError(message)
        return self._entries[name].value


def registry(kind: str) -> Registry:
    """Gather every plugin's records of ``kind``, refusing duplicate names."""
    if kind not in KIND_HOOKS:
        raise PluginError(f"unknown registry kind '{kind}' (known: {', '.join(KIND_HOOKS)})")
    if kind in _registries:
        return _registries[kind]
    pm = plugin_manager()
    hook_name = KIND_HOOKS[kind]
    entries: dict[str, Entry] = {}
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        dist = plugin_distribution(impl.plugin)
        for record in impl.function() or []:
            if record.name in entries:
                other = entries[record.name].distribution
                raise PluginError(
                    f"{kind} '{record.name}' is registered twice: by {other} and by {dist}; "
                    f"uninstall one of them or rename the {kind}"
                )
            entries[record.name] = Entry(record, dist)
    _registries[kind] = Registry(kind, entries)
    return _registries[kind]


def installed_distributions() -> list[tuple[str, str, dict[str, list[str]]]]:
    """(distribution, version, {kind: [names]}) for every distribution that registers something."""
    by_dist: dict[str, dict[str, list[str]]] = {}
    for kind in KIND_HOOKS:
        for name, entry in registry(kind).entries().items():
            by_dist.setdefault(entry.distribution, {}).setdefault(kind, []).append(name)
    rows = []
    for dist, kinds in sorted(by_dist.items()):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "in-process"
        rows.append((dist, version, {k: sorted(v) for k, v in kinds.items()}))
    return rows
