"""Rotary embeddings applied to query and key straight from the fused QKV output, with a
backward that writes the QKV gradient in one pass.

``SelfAttention`` views the QKV GEMM's output as ``[s, b, groups, heads_per_group + 2, d]``,
slices query, key and value out of it, makes them batch-first ``[b, s, heads, d]`` and rotates
query and key (``rope.apply_rotary``). Compiled by inductor, autograd's backward of that is two
kernels: one computes key's rotation gradient and writes it out, a second reads it back with dq
and dv and writes the concatenated QKV gradient: 108 µs per layer call on an H100 for 8192
tokens x 16 heads x 128, about 4.7 ms per training step of extra memory traffic. Here the
backward is one kernel that reads dq, dk and dv once (in whatever strides the attention
backward returns them) and writes the gradient of the fused QKV tensor in its own layout.

``rotary_qkv`` gives the numbers of the slices + ``apply_rotary`` path (its forward is those
very ops, left in the compiled graph for inductor to fuse; value stays a view). Its backward is
the ``mtl::rope_qkv_backward`` operator (a ``torch.library.triton_op``, which compiled graphs trace
through, as ``mtl.models.swiglu``'s): per position, the transposed rotation
``dx = dy * cos + rotate_half_T(dy * sin)`` with ``rotate_half_T([a, b]) = [b, -a]`` for dq and
dk, dv copied; in fp32 from the incoming gradients, with cos/sin first rounded to the
activations' dtype as the forward rounds them, and the result rounded once. Triton on CUDA, the
same formula in PyTorch elsewhere (as ``mtl.models.swiglu``).
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from mtl.models.gpt.rope import apply_rotary
from mtl.models.triton_ops import triton_op

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch formula serves every device
    triton = None


def _split_qkv(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[s, b, groups, hpg + 2, d] -> query [b, s, groups * hpg, d], key and value [b, s, groups, d]."""
    s, b, groups, slots, d = qkv.shape
    hpg = slots - 2
    query = qkv[:, :, :, :hpg].reshape(s, b, groups * hpg, d)
    key, value = qkv[:, :, :, hpg], qkv[:, :, :, hpg + 1]
    return query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)


def _backward_reference(dq, dk, dv, cos, sin) -> torch.Tensor:
    """The kernel's formula in PyTorch: fp32, rounded once to the gradients' dtype."""
    dtype = dq.dtype
    # the forward rotated with the tables rounded to the activations' dtype
    cos, sin = cos.to(dtype).float(), sin.to(dtype).float()

    def unrotate(dy):  # the rotation's transpose
        dy = dy.float()
        first, second = (dy * sin).chunk(2, dim=-1)
        return dy * cos + torch.cat((second, -first), dim=-1)

    b, s, heads, d = dq.shape
    groups = dk.shape[2]
    dq = unrotate(dq).view(b, s, groups, heads // groups, d)
    dqkv = torch.cat((dq, unrotate(dk)[:, :, :, None], dv.float()[:, :, :, None]), dim=3)
    return dqkv.to(dtype).transpose(0, 1).contiguous()  # [s, b, groups, hpg + 2, d]


if triton is not None:

    @triton.jit
    def _rope_qkv_backward_kernel(
        dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, out_ptr,
        batch, groups, hpg, heads, half,
        dq_sb, dq_ss, dq_sn, dq_sd,
        dk_sb, dk_ss, dk_sn, dk_sd,
        dv_sb, dv_ss, dv_sn, dv_sd,
        cos_sb, cos_ss, cos_sd,
        sin_sb, sin_ss, sin_sd,
        HEADS: tl.constexpr, GROUPS: tl.constexpr, HALF: tl.constexpr,
    ):  # fmt: skip
        # One program per token, all its heads; programs in the output's [s, b] order so that
        # neighbours write neighbouring memory. Each head's d is loaded as its two halves,
        # the pairs the rotation mixes.
        token = tl.program_id(0).to(tl.int64)
        si, bi = token // batch, token % batch
        cols = tl.arange(0, HALF)
        col_ok = cols < half
        dtype = out_ptr.dtype.element_ty

        # cos/sin [b, s, 1, d] fp32, rounded to the activations' dtype as the forward does
        cos_at = cos_ptr + bi * cos_sb + si * cos_ss + cols * cos_sd
        sin_at = sin_ptr + bi * sin_sb + si * sin_ss + cols * sin_sd
        cos1 = tl.load(cos_at, mask=col_ok).to(dtype).to(tl.float32)
        cos2 = tl.load(cos_at + half * cos_sd, mask=col_ok).to(dtype).to(tl.float32)
        sin1 = tl.load(sin_at, mask=col_ok).to(dtype).to(tl.float32)
        sin2 = tl.load(sin_at + half * sin_sd, mask=col_ok).to(dtype).to(tl.float32)

        slots = hpg + 2
        out_token = out_ptr + token * groups * slots * 2 * half  # [groups, hpg + 2, d] of this token

        # query heads n = g * hpg + h go to slot h of group g
        n = tl.arange(0, HEADS)[:, None]
        q_ok = (n < heads) & col_ok[None, :]
        q_at = dq_ptr + bi * dq_sb + si * dq_ss + n * dq_sn + cols[None, :] * dq_sd
        dy1 = tl.load(q_at, mask=q_ok).to(tl.float32)
        dy2 = tl.load(q_at + half * dq_sd, mask=q_ok).to(tl.float32)
        dx1 = dy1 * cos1[None, :] + dy2 * sin2[None, :]
        dx2 = dy2 * cos2[None, :] - dy1 * sin1[None, :]
        q_out = out_token + ((n // hpg) * slots + n % hpg) * 2 * half + cols[None, :]
        tl.store(q_out, dx1.to(dtype), mask=q_ok)
        tl.store(q_out + half, dx2.to(dtype), mask=q_ok)

        # key of group g -> slot hpg, value -> slot hpg + 1
        g = tl.arange(0, GROUPS)[:, None]
        g_ok = (g < groups) & col_ok[None, :]
        k_at = dk_ptr + bi * dk_sb + si * dk_ss + g * dk_sn + cols[None, :] * dk_sd
        dy1 = tl.load(k_at, mask=g_ok).to(tl.float32)
        dy2 = tl.load(k_at + half * dk_sd, mask=g_ok).to(tl.float32)
        dx1 = dy1 * cos1[None, :] + dy2 * sin2[None, :]
        dx2 = dy2 * cos2[None, :] - dy1 * sin1[None, :]
        k_out = out_token + (g * slots + hpg) * 2 * half + cols[None, :]
        tl.store(k_out, dx1.to(dtype), mask=g_ok)
        tl.store(k_out + half, dx2.to(dtype), mask=g_ok)

        v_at = dv_ptr + bi * dv_sb + si * dv_ss + g * dv_sn + cols[None, :] * dv_sd
        v_out = k_out + 2 * half
        tl.store(v_out, tl.load(v_at, mask=g_ok).to(dtype), mask=g_ok)
        tl.store(v_out + half, tl.load(v_at + half * dv_sd, mask=g_ok).to(dtype), mask=g_ok)


def _backward_triton(dq, dk, dv, cos, sin, traced: bool = False) -> torch.Tensor:
    """The Triton launch (no device guard, so the interpreter can run it on CPU tensors). ``traced``:
    inside the triton_op, where a compiled graph records the launch for inductor."""
    b, s, heads, d = dq.shape
    groups = dk.shape[2]
    hpg = heads // groups
    out = torch.empty(s, b, groups, hpg + 2, d, dtype=dq.dtype, device=dq.device)
    if out.numel() == 0:
        return out
    # tables of one row of positions broadcast over the batch (stride 0, no copy)
    cos, sin = cos.expand(b, s, 1, d), sin.expand(b, s, 1, d)
    half = d // 2
    block = triton.next_power_of_2(heads) * triton.next_power_of_2(half)
    kernel = wrap_triton(_rope_qkv_backward_kernel) if traced else _rope_qkv_backward_kernel
    kernel[(s * b,)](
        dq, dk, dv, cos, sin, out,
        b, groups, hpg, heads, half,
        *dq.stride(), *dk.stride(), *dv.stride(),
        cos.stride(0), cos.stride(1), cos.stride(3),
        sin.stride(0), sin.stride(1), sin.stride(3),
        HEADS=triton.next_power_of_2(heads),
        GROUPS=triton.next_power_of_2(groups),
        HALF=triton.next_power_of_2(half),
        num_warps=4 if block >= 1024 else 1,
    )  # fmt: skip
    return out


# A triton_op, as mtl.models.swiglu's: inside a compiled layer inductor's code launches the kernel (a
# compiled call took 85 against 208 us of host time on the H100 machine, benchmarks/log, eleventh session).
@triton_op("mtl::rope_qkv_backward", mutates_args=())
def rope_qkv_backward(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The gradient of the fused ``qkv [s, b, groups, hpg + 2, d]`` (contiguous, dq's dtype) from
    those of the rotated query ``[b, s, heads, d]``, key and value ``[b, s, groups, d]`` (any
    strides); cos, sin: the forward's fp32 tables ``[b, s, 1, d]``."""
    return _rope_qkv_backward(dq, dk, dv, cos, sin, traced=True)


def _rope_qkv_backward(dq, dk, dv, cos, sin, traced: bool) -> torch.Tensor:
    if triton is None or not dq.is_cuda:
        return _backward_reference(dq, dk, dv, cos, sin)
    with torch.cuda.device(dq.device):
        return _backward_triton(dq, dk, dv, cos, sin, traced)


class _RotaryQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin):
        ctx.save_for_backward(cos, sin)
        query, key, value = _split_qkv(qkv)
        return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        # autograd hands each gradient in its output's dtype, qkv's; the tables are position
        # functions without a gradient
        if torch.compiler.is_compiling():
            return rope_qkv_backward(dq, dk, dv, cos, sin), None, None
        # eager: the same function without the op's dispatch (as mtl.models.swiglu)
        return _rope_qkv_backward(dq, dk, dv, cos, sin, traced=False), None, None


def rotary_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [s, b, groups, hpg + 2, d] (the fused QKV output's view), cos/sin fp32 [b, s, 1, d]
    -> rotated query [b, s, groups * hpg, d], rotated key and value (a view) [b, s, groups, d]."""
    return _RotaryQKV.apply(qkv, cos, sin)
