"""Whether Transformer Engine can be used here, and the one line that says what to install."""

from __future__ import annotations

import functools

from mtl.core.errors import NotInstalledError

INSTALL_HINT = (
    "backend 'te' needs Transformer Engine for PyTorch (import transformer_engine.pytorch failed: {reason}); "
    "install it on a CUDA machine with: pip install 'mtl-te[te]' (transformer-engine[pytorch]), "
    "or stage it offline with scripts/gpu/te_stage.sh"
)


@functools.cache
def te_import_error() -> str | None:
    """None when ``transformer_engine.pytorch`` imports and sees a GPU, else why not."""
    try:
        import transformer_engine.pytorch  # noqa: F401, PLC0415
    except Exception as exc:  # ImportError, or TE's own error for a missing CUDA library
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        return "no CUDA device (Transformer Engine runs on NVIDIA GPUs only)"
    return None


def require_te() -> None:
    """Raise ``NotInstalledError`` with one line naming what to install, unless TE is usable."""
    reason = te_import_error()
    if reason is not None:
        raise NotInstalledError(INSTALL_HINT.format(reason=reason))
