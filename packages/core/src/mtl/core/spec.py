"""``ModuleSpec``: a module class plus the arguments and submodule specs to build it with.

A model family describes its layer as a tree of specs; a backend fills in the leaves. One
level of indirection, no more: ``build_module(spec, **kwargs)`` builds the class with the
spec's params, the given kwargs and ``submodules`` (if any).

Those keywords are a contract between the family that writes the spec and the plugin whose
class it names (docs/plugin-guide.md). Before calling, ``build_module`` checks them against
the class's signature: a keyword the class does not accept is a one-line ``PluginError``
naming the class, the keyword and who supplied it; a keyword renamed within the last release
(``mtl.core.contract_changes``) reaches a class that still takes the old name under that name,
and a spec still passing the old name reaches a class that takes the new one, each with a
deprecation warning.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable

from mtl.core.contract_changes import RENAMED_KEYWORDS, ContractDeprecationWarning, RenamedKeyword
from mtl.core.errors import PluginError

PLUGIN_GUIDE = "docs/plugin-guide.md"


@dataclass(frozen=True)
class ModuleSpec:
    module: Callable[..., Any]
    params: dict[str, Any] = field(default_factory=dict)
    submodules: Any = None


def build_module(spec: ModuleSpec | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Instantiate a spec (or a plain class/factory) with the spec's params overridden by kwargs."""
    if not isinstance(spec, ModuleSpec):
        return spec(*args, **kwargs)
    call_kwargs = {**spec.params, **kwargs}
    if spec.submodules is not None:
        call_kwargs["submodules"] = spec.submodules
    call_kwargs = fit_keywords(spec, call_kwargs, build_keywords=set(kwargs))
    return spec.module(*args, **call_kwargs)


def accepted_keywords(module: Callable[..., Any]) -> set[str] | None:
    """The keyword names ``module(...)`` accepts; None when it takes any (``**kwargs``) or its
    signature cannot be read (a builtin): then nothing is checked."""
    try:
        parameters = inspect.signature(module).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters if p.kind in keyword_kinds}


def fit_keywords(spec: ModuleSpec, call_kwargs: dict[str, Any], build_keywords: set[str]) -> dict[str, Any]:
    """``call_kwargs`` as ``spec.module`` accepts them: renamed keywords passed under the old
    name the module still takes (warned), any other keyword it does not take refused."""
    accepted = accepted_keywords(spec.module)
    if accepted is None:
        return call_kwargs
    fitted, refused = {}, []
    for name, value in call_kwargs.items():
        renamed = RENAMED_KEYWORDS.get(name)
        old_name_of = next((r for r in RENAMED_KEYWORDS.values() if r.old == name), None)
        if name in accepted:
            fitted[name] = value
        elif renamed is not None and renamed.old in accepted:  # a module written before the rename
            warnings.warn(deprecated_message(spec.module, renamed), ContractDeprecationWarning, stacklevel=3)
            fitted[renamed.old] = value
        elif old_name_of is not None and old_name_of.new in accepted:  # a spec written before it
            warnings.warn(old_spec_message(spec.module, old_name_of), ContractDeprecationWarning, stacklevel=3)
            fitted[old_name_of.new] = value
        else:
            refused.append(name)
    if refused:
        raise PluginError(refused_message(spec.module, refused, build_keywords))
    return fitted


def module_name(module: Callable[..., Any]) -> str:
    qualname = getattr(module, "__qualname__", None) or type(module).__qualname__
    return f"{getattr(module, '__module__', '?')}.{qualname}"


def source_of(name: str, build_keywords: set[str]) -> str:
    if name == "submodules":
        return "the spec's submodules"
    return "build_module's keywords" if name in build_keywords else "the spec's params"


def refused_message(module: Callable[..., Any], refused: list[str], build_keywords: set[str]) -> str:
    given = ", ".join(f"'{name}' (from {source_of(name, build_keywords)})" for name in refused)
    return (
        f"{module_name(module)} does not accept {given}: the keyword is part of the layer-spec "
        f"contract of {installed('mtl-models')}; accept it in {module_name(module)}'s signature "
        f"(or **kwargs), or build from a spec of the version it was written for ({PLUGIN_GUIDE})"
    )


def deprecated_message(module: Callable[..., Any], renamed: RenamedKeyword) -> str:
    return (
        f"{module_name(module)} takes '{renamed.old}', which {renamed.renamed_in} renamed to "
        f"'{renamed.new}'; it receives the value as '{renamed.old}' until {renamed.removed_in}: "
        f"rename the parameter ({PLUGIN_GUIDE})"
    )


def old_spec_message(module: Callable[..., Any], renamed: RenamedKeyword) -> str:
    return (
        f"a spec passes '{renamed.old}' to {module_name(module)}, which {renamed.renamed_in} renamed to "
        f"'{renamed.new}'; it is passed on as '{renamed.new}' until {renamed.removed_in}: rename it in the "
        f"spec's params ({PLUGIN_GUIDE})"
    )


def installed(distribution: str) -> str:
    try:
        return f"{distribution} {metadata.version(distribution)}"
    except metadata.PackageNotFoundError:
        return f"{distribution} (not installed)"
