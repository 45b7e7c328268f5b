"""``triton_op``: how mtl.models defines its Triton-backed operators (``mtl::swiglu_backward``,
``mtl::rope_qkv_backward``).

``torch.library.triton_op`` lets a compiled graph trace through the operator, so inductor's code
launches the Triton kernels itself. Defining one looks for the Triton kernels the function calls,
and where Triton is not installed (CPU-only installs, whose operators run their PyTorch formula)
torch logs a warning about it on every import. There is nothing to find there, so that lookup's
logger is quietened while the operator is defined, and only then.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterable

from torch.library import triton_op as _torch_triton_op

_LOOKUP_LOGGER = logging.getLogger("torch._library.triton")


def triton_op(name: str, *, mutates_args: str | Iterable[str]) -> Callable:
    """``torch.library.triton_op(name, mutates_args=...)``, without the missing-Triton warning."""
    define = _torch_triton_op(name, mutates_args=mutates_args)
    if importlib.util.find_spec("triton") is not None:
        return define

    def quietly(fn: Callable) -> Callable:
        level = _LOOKUP_LOGGER.level
        _LOOKUP_LOGGER.setLevel(logging.ERROR)
        try:
            return define(fn)
        finally:
            _LOOKUP_LOGGER.setLevel(level)

    return quietly
