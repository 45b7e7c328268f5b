"""Which kernel runs the SSD scan: the PyTorch chunked scan (``ssd.py``) everywhere, unless a CUDA
kernel was registered and the tensors are on a GPU.

A kernel has the chunked scan's signature: ``kernel(x, dt, A, B, C, *, chunk_size,
initial_state) -> (y, final_state)`` with mamba-ssm's layouts (``ssd.py``). ``mamba_ssm_kernel``
adapts mamba-ssm's Triton SSD (``mamba_chunk_scan_combined``), which installs without a CUDA
build (``MAMBA_SKIP_CUDA_BUILD=TRUE``); the mixer registers it on first use when the package
is importable (see the mamba README for why this kernel and how it is installed).
"""

from __future__ import annotations

from typing import Callable

import torch

from mtl.models.mamba.ssd import ssd_chunked

ScanKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]

_cuda_kernel: ScanKernel | None = None
_probed = False


def register_cuda_scan(kernel: ScanKernel | None) -> None:
    """Use ``kernel`` for CUDA tensors from now on (None: back to the PyTorch scan)."""
    global _cuda_kernel, _probed
    _cuda_kernel, _probed = kernel, True


def mamba_ssm_kernel() -> ScanKernel | None:
    """mamba-ssm's Triton SSD behind our signature, or None where mamba-ssm is not installed."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined  # noqa: PLC0415
    except ImportError:
        return None

    def kernel(x, dt, A, B, C, *, chunk_size, initial_state=None):
        return mamba_chunk_scan_combined(
            x, dt, A, B, C, chunk_size, initial_states=initial_state, return_final_states=True
        )

    return kernel


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan on the fastest kernel for these tensors: ``(y [b, l, h, p], state [b, h, p, n])``."""
    global _cuda_kernel, _probed
    if x.is_cuda:
        if not _probed:
            _cuda_kernel, _probed = mamba_ssm_kernel(), True
        if _cuda_kernel is not None:
            return _cuda_kernel(x, dt, A, B, C, chunk_size=chunk_size, initial_state=initial_state)
    return ssd_chunked(x, dt, A, B, C, chunk_size=chunk_size, initial_state=initial_state)
