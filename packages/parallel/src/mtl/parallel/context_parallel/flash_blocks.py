"""The block attention of ring attention on fused CUDA kernels (bf16/fp16).

Same contract as ``block_attention.block_forward``/``block_backward`` for the two kinds of
block pair the ring computes, a full block (no mask) and a square diagonal block (causal),
but through PyTorch's flash-attention operators, which return the log-sum-exp and accept
the *final* output and log-sum-exp in backward, as ring attention needs. The einsum path
materialises fp32 score matrices; this one keeps attention on tensor cores at bf16.

Two kernels, both through ``torch.ops.aten``: cuDNN's fused attention (``"cudnn"``, what SDPA
picks on Hopper and the faster there: sm90 or later, head dim up to 128) and FlashAttention-2
(``"flash"``: sm80 or later, head dim up to 256), each only where SDPA's own switch for it
(``torch.backends.cuda.*_sdp_enabled``) is on. ``fused_kernel`` prefers cuDNN. The ring
decides once per call, in forward, and its backward uses the same kernel.

Grouped-query attention: key/value groups are repeated to the query heads for the kernel and
their gradients summed back over the heads that share a group.
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten
_HALF = (torch.bfloat16, torch.float16)


def _cudnn_ok(device: torch.device, head_dim: int) -> bool:
    # Hopper or later, SDPA's cuDNN backend switched on, a head dim cuDNN's fused attention takes
    return (torch.backends.cuda.cudnn_sdp_enabled() and torch.cuda.get_device_capability(device) >= (9, 0)
            and head_dim <= 128)


def _flash_ok(device: torch.device, head_dim: int) -> bool:
    # FlashAttention-2: Ampere or later, SDPA's flash backend switched on, head dim up to 256
    return (torch.backends.cuda.flash_sdp_enabled() and torch.cuda.get_device_capability(device) >= (8, 0)
            and head_dim <= 256)


def fused_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """The fused kernel for inputs of this device, dtype and head dim: "cudnn" where it applies
    (Hopper or later, SDPA's cuDNN backend on, head dim up to 128), else "flash" where
    FlashAttention-2 does, else None: not CUDA, not half precision, a head dim that is not a
    multiple of 8, or neither kernel allowed (the callers then take the einsum path)."""
    if device.type != "cuda" or dtype not in _HALF or head_dim % 8:
        return None
    if _cudnn_ok(device, head_dim):
        return "cudnn"
    return "flash" if _flash_ok(device, head_dim) else None


def _heads_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, s, groups, d] -> [b, heads, s, d], repeating each group for its query heads."""
    groups = x.size(2)
    if groups != heads:
        x = x.repeat_interleave(heads // groups, dim=2)
    return x.transpose(1, 2)


def flash_block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, kernel: str = "flash"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[b, sq, heads, d]`` in q's dtype, lse ``[b, heads, sq]`` fp32) of q against one k/v
    block. The out is a view of the kernel's ``[b, heads, sq, d]`` result: the merge reads it
    into its fp32 running output directly (no separate fp32 copy per piece)."""
    b, sq, heads, _ = q.shape
    qh, kh, vh = q.transpose(1, 2), _heads_first(k, heads), _heads_first(v, heads)
    if kernel == "cudnn":
        out, lse, *_ = _aten._scaled_dot_product_cudnn_attention(qh, kh, vh, None, True, 0.0, causal, False,
                                                                 scale=scale)
        return out.transpose(1, 2), lse.reshape(b, heads, sq).float()  # cuDNN's lse is [b, heads, sq, 1]
    out, lse, *_ = _aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, causal, False, scale=scale)
    return out.transpose(1, 2), lse.float()


def flash_block_backward(
    dout: torch.Tensor,
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool,
    kernel: str = "flash",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this block pair's share, in q's dtype (GQA's dk, dv: summed over the heads
    of a group in fp32), as views the ring adds into its accumulators (dq fp32; the travelling
    dK/dV in q's dtype, ring_attention.py); ``out`` and ``lse``
    are the final output and log-sum-exp over all keys (the kernel derives rowsum(dO * O) from
    them)."""
    b, sq, heads, d = q.shape
    groups, sk = k.size(2), k.size(1)
    no_rng = torch.empty((), dtype=torch.int64, device=q.device)  # dropout off: the seed is unused
    if kernel == "cudnn":
        dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
            dout.transpose(1, 2), q.transpose(1, 2), _heads_first(k, heads), _heads_first(v, heads),
            out.transpose(1, 2), lse.reshape(b, heads, sq, 1).contiguous(), no_rng, no_rng,
            None, None, None, sq, sk,  # no bias, no variable-length batch
            0.0, causal, scale=scale,
        )
    else:
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            dout.transpose(1, 2), q.transpose(1, 2), _heads_first(k, heads), _heads_first(v, heads),
            out.transpose(1, 2), lse.contiguous(),
            None, None, sq, sk,  # no variable-length batch: cumulative lengths undefined
            0.0, causal,
            torch.empty(2, dtype=torch.int64, device=q.device), no_rng,
            scale=scale,
        )
    dk, dv = dk.transpose(1, 2), dv.transpose(1, 2)  # [b, sk, heads, d]
    if groups != heads:
        dk = dk.reshape(b, sk, groups, heads // groups, d).sum(3, dtype=torch.float32)
        dv = dv.reshape(b, sk, groups, heads // groups, d).sum(3, dtype=torch.float32)
    return dq.transpose(1, 2), dk, dv
