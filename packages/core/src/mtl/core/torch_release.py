"""The installed torch's release, for the few behaviours that differ between the torch versions
mtl supports (e.g. FP8 row-wise scales on CPU)."""

from __future__ import annotations


def torch_release() -> tuple[int, int]:
    """``(major, minor)`` of ``torch.__version__`` (``"2.13.0+cpu"`` -> ``(2, 13)``)."""
    import torch  # noqa: PLC0415 (mtl.core imports torch only where it needs it)

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)
