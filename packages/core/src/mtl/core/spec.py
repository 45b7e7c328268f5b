"""``ModuleSpec``: a module class plus the arguments and submodule specs to build it with.

A model family describes its layer as a tree of specs; a backend fills in the leaves. One
level of indirection, no more: ``build_module(spec, **kwargs)`` builds the class with the
spec's params, the given kwargs and ``submodules`` (if any).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


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
    return spec.module(*args, **call_kwargs)
