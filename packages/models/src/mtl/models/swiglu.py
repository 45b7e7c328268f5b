"""SwiGLU on fc1's fused output, ``silu(gate) * up`` with ``[gate | up] = fc1_out``, whose backward
reads each input once.

Autograd's backward of ``F.silu(gate) * up`` over ``fc1_out.chunk(2, -1)`` writes the gradient of
``fc1_out`` through a concatenation. Inductor turns that into one kernel over the concatenated
output that computes each half from masked loads, so ``gate`` and the incoming gradient are read
once per half: 0.21 ms per call on the H100 reference layer (8192 tokens, ffn 5440), about 1.4x
the time its necessary bytes take (benchmarks/log). Here the backward is one Triton kernel
over ``[tokens, ffn]`` that loads gate, up and the gradient once and stores both halves (0.155 ms
per call there). The dense MLP and the MoE experts both use it.

The forward stays in the compiled graph (inductor's kernel for it already moves the least bytes).
The backward is the ``mtl::swiglu_backward`` operator (a ``torch.library.triton_op``): Triton on CUDA,
the same fp32 formula in PyTorch elsewhere. A compiled graph traces through it: on CUDA inductor
launches the Triton kernel from its own code, on the CPU it compiles the formula.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.library import wrap_triton

from mtl.models.triton_ops import triton_op

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch formula serves every device
    triton = None


def _backward_reference(fc1_out: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """d(silu(g) * u) / d[g | u] in fp32, rounded to the input's dtype once."""
    gate, up = fc1_out.float().chunk(2, dim=-1)
    dy = grad.float()
    sig = torch.sigmoid(gate)
    d_gate = dy * up * sig * (1 + gate * (1 - sig))  # silu'(g) = sig(g) (1 + g (1 - sig(g)))
    d_up = dy * gate * sig
    return torch.cat([d_gate, d_up], dim=-1).to(fc1_out.dtype)


if triton is not None:

    @triton.jit
    def _swiglu_backward_kernel(x_ptr, dy_ptr, dx_ptr, ffn, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < ffn
        gate_at = row * 2 * ffn + cols
        gate = tl.load(x_ptr + gate_at, mask=mask).to(tl.float32)
        up = tl.load(x_ptr + gate_at + ffn, mask=mask).to(tl.float32)
        dy = tl.load(dy_ptr + row * ffn + cols, mask=mask).to(tl.float32)
        sig = tl.sigmoid(gate)
        d_gate = dy * up * sig * (1 + gate * (1 - sig))
        d_up = dy * gate * sig
        tl.store(dx_ptr + gate_at, d_gate.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + gate_at + ffn, d_up.to(dx_ptr.dtype.element_ty), mask=mask)


def _backward_triton(fc1_out: torch.Tensor, grad: torch.Tensor, traced: bool = False) -> torch.Tensor:
    """The Triton launch (no device guard, so the interpreter can run it on CPU tensors). ``traced``:
    inside the triton_op, where a compiled graph records the launch for inductor."""
    fc1_out, grad = fc1_out.contiguous(), grad.contiguous()
    ffn = grad.shape[-1]
    rows = grad.numel() // ffn
    out = torch.empty_like(fc1_out)
    if rows == 0:  # an expert that received no tokens
        return out
    block = 1024
    kernel = wrap_triton(_swiglu_backward_kernel) if traced else _swiglu_backward_kernel
    kernel[(rows, triton.cdiv(ffn, block))](fc1_out, grad, out, ffn, BLOCK=block, num_warps=4)
    return out


def _swiglu_backward(fc1_out: torch.Tensor, grad: torch.Tensor, traced: bool) -> torch.Tensor:
    if triton is None or not fc1_out.is_cuda:
        return _backward_reference(fc1_out, grad)
    with torch.cuda.device(fc1_out.device):
        return _backward_triton(fc1_out, grad, traced)


# A triton_op, so that inside a compiled layer inductor's code launches the kernel, as it launches its
# own, instead of calling an opaque op that dispatches and then launches through Triton's JIT. On the
# H100 machine a compiled call took 52 against 131 us of host time (benchmarks/log, eleventh session), and
# a tensor-parallel rank bound by its host (tp = 2 + sp, alone) 0.64-0.68 against 0.76-0.81 s per
# step with mtl::rope_qkv_backward likewise (benchmarks/log).
@triton_op("mtl::swiglu_backward", mutates_args=())
def swiglu_backward(fc1_out: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``fc1_out [..., 2 * ffn]`` from the gradient of ``silu(gate) * up [..., ffn]``."""
    return _swiglu_backward(fc1_out, grad, traced=True)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fc1_out):
        ctx.save_for_backward(fc1_out)
        gate, up = fc1_out.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        (fc1_out,) = ctx.saved_tensors
        if torch.compiler.is_compiling():
            return swiglu_backward(fc1_out, grad)
        # eager (train.compile off, or an eager region such as the MoE experts' loop): the same
        # function without the op's dispatch, which as a custom_op costs ~40 us per call
        return _swiglu_backward(fc1_out, grad, traced=False)


def swiglu(fc1_out: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``[gate | up] = fc1_out`` (the last dimension's halves)."""
    return _SwiGLU.apply(fc1_out)
