"""Which device a run uses, asked of torch only where a config key depends on it
(``train.device = "auto"``: CUDA where torch sees a GPU)."""

from __future__ import annotations


def runs_on_cuda(device: str) -> bool:
    """``train.device`` is "cuda", or "auto" on a machine where torch sees a GPU."""
    import torch  # noqa: PLC0415 (mtl.core imports torch only where it needs it)

    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def runs_on_cpu(device: str) -> bool:
    """``train.device`` is "cpu", or "auto" on a machine where torch sees no GPU."""
    import torch  # noqa: PLC0415 (mtl.core imports torch only where it needs it)

    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())
