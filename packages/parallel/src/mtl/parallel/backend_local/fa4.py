"""``train.attention_kernel = "fa4"``: FlashAttention-4 as the kernel behind SDPA.

mtl's core attention calls ``F.scaled_dot_product_attention``, which on Hopper picks cuDNN's fused
attention. FlashAttention-4 (the ``flash-attn-4`` package, ``flash_attn.cute``: kernels written in
NVIDIA's CuTe DSL and compiled on first use; its Hopper path follows FA3) spends 12% less device
time on the reference model's attention (benchmarks/log). PyTorch (2.11 and later) can
route SDPA's flash operators (``aten::_scaled_dot_product_flash_attention`` and its backward) to
FA4 through ``torch.nn.attention._fa4``. ``activate_fa4`` does that and turns SDPA's cuDNN and
memory-efficient backends off, so the flash backend, now FA4, is SDPA's first choice, in eager
code and in compiled graphs (inductor calls the aten operator) alike.

Everything here is process-wide, as PyTorch's SDPA backend switches are: a training process
activates it once, in ``mtl.train.setup``.

torch's registration expects the interface of the FA4 it was written against, whose
``_flash_attn_fwd`` returned ``(out, lse)``; the 4.0 betas return more (``(out, lse, p, ...)``).
This module is the interface torch is given: the two functions below adapt the installed one.

FA4's kernels run from Python (a few hundred microseconds of host time per forward and backward
at the reference shape), which a GPU-bound step hides and a host-bound one (a tensor-parallel
rank of a small model) does not.
"""

from __future__ import annotations

import functools
import importlib

import torch

from mtl.core.errors import ConfigError

_INSTALL = "pip install flash-attn-4 (with nvidia-cutlass-dsl[cu13] on CUDA 13)"


@functools.cache  # looked up on every attention call; a failed import raises, and is not cached
def _interface():
    try:
        return importlib.import_module("flash_attn.cute.interface")
    except ImportError as exc:
        raise ConfigError(
            f"train.attention_kernel = 'fa4' needs FlashAttention-4, which does not import here ({exc}): "
            f"{_INSTALL}, or set train.attention_kernel = 'sdpa'"
        ) from exc


def _flash_attn_fwd(*args, **kwargs):
    """The installed FA4 forward, returning ``(out, lse)`` as torch's registration unpacks it."""
    out, lse, *_ = _interface()._flash_attn_fwd(*args, **kwargs)
    return out, lse


def _flash_attn_bwd(*args, **kwargs):
    """The installed FA4 backward: ``(dq, dk, dv)``."""
    dq, dk, dv, *_ = _interface()._flash_attn_bwd(*args, **kwargs)
    return dq, dk, dv


def activate_fa4(device: torch.device) -> None:
    """Route SDPA to FA4 on ``device`` for the rest of the process; a clear ConfigError, before any
    work, where that cannot be done (no CUDA, a GPU FA4 has no kernels for, a torch without the
    registration, the package missing)."""
    if device.type != "cuda":
        raise ConfigError(f"train.attention_kernel = 'fa4' needs a CUDA device; this run uses {device}: "
                          "set train.attention_kernel = 'sdpa'")
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        raise ConfigError(f"train.attention_kernel = 'fa4' runs on Hopper (sm90) and Blackwell (sm100); "
                          f"{torch.cuda.get_device_name(device)} is sm{major}{minor}: set train.attention_kernel = 'sdpa'")
    try:
        from torch.nn.attention import _fa4 as torch_fa4  # noqa: PLC0415
        from torch.nn.attention import activate_flash_attention_impl, register_flash_attention_impl  # noqa: PLC0415
    except ImportError as exc:
        raise ConfigError(f"train.attention_kernel = 'fa4' needs torch >= 2.11 (SDPA's FA4 registration); "
                          f"this is torch {torch.__version__}: set train.attention_kernel = 'sdpa'") from exc
    _interface()
    register_flash_attention_impl(
        "mtl-FA4", register_fn=lambda: torch_fa4.register_flash_attention_fa4(module_path=__name__))
    activate_flash_attention_impl("mtl-FA4")
    # SDPA tries cuDNN, then flash, then memory-efficient on Hopper: leave flash (FA4) first
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    # SDPA's switches pick the attention operator while AOTAutograd traces, and are not part of
    # its cache key: a layer compiled by an earlier run on cuDNN would come from the cache and
    # FA4 would never run (seen: compiled graphs kept cuDNN's kernels), and a graph of this run,
    # cached, would run FA2 in a later run without FA4. So FA4 runs trace afresh and save nothing.
    _saved.setdefault("enable_autograd_cache", torch._functorch.config.enable_autograd_cache)
    torch._functorch.config.enable_autograd_cache = False


_saved: dict[str, bool] = {}


def deactivate_fa4() -> None:
    """SDPA's own kernels again (tests that activate FA4 in a shared process)."""
    from torch.nn.attention import restore_flash_attention_impl  # noqa: PLC0415

    restore_flash_attention_impl()
    torch.backends.cuda.enable_cudnn_sdp(True)
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    if "enable_autograd_cache" in _saved:
        torch._functorch.config.enable_autograd_cache = _saved.pop("enable_autograd_cache")
