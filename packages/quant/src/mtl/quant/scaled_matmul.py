"""``a @ bᵀ`` of two FP8 operands through ``torch._scaled_mm``, whatever their shapes.

Both operands are row-major ``[rows, K]`` and quantized along K (the contraction), with a
scalar scale each or one per row (``[rows, 1]``). On CPU ``torch._scaled_mm`` (torch 2.13)
takes any shape. On CUDA it wants every dimension a multiple of 16 and the second operand
column-major; short operands (a decode step's handful of tokens) are zero-padded, which adds
nothing to the product, and the result is cut back. CUDA's row-wise scaling writes bf16
only, so its result is cast to the asked dtype afterwards.

Two ops: ``scaled_mm`` (``mtl::fp8_gemm``) returns the product; ``scaled_mm_accumulate``
(``mtl::fp8_gemm_accumulate``) adds it into an fp32 tensor, the weight gradient into
``main_grad``, through cuBLASLt's epilogue where it can (``cublaslt.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mtl.core.torch_release import torch_release
from mtl.quant import cublaslt
from mtl.quant.cublaslt import CUDA_MULTIPLE


def _round_up(n: int) -> int:
    return -(-n // CUDA_MULTIPLE) * CUDA_MULTIPLE


# Defined on a torch.library.Library rather than with torch.library.custom_op: the op runs
# three times per linear per micro-batch, and custom_op's Python wrapper (autograd and
# aliasing checks the op does not need: FP8 operands never require grad, the output is new)
# costs the host more per call (an empty op: 6.7 against 2.4 us on a CPU), which a host-bound
# FP8 step pays in full.
_LIB = torch.library.Library("mtl", "FRAGMENT")
# torch._scaled_mm takes row-wise scales on CPU from torch 2.13 on; 2.11's asserts inside oneDNN
CPU_ROWWISE = torch_release() >= (2, 13)
_LIB.define("fp8_gemm(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, ScalarType out_dtype, "
            "bool fast_accum=False) -> Tensor")
_LIB.define("fp8_gemm_accumulate(Tensor(a!) out, Tensor a, Tensor a_scale, Tensor b, Tensor b_scale) -> ()")


def _fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """a ``[M, K]`` and b ``[N, K]`` FP8 (contiguous), scales scalar or ``[M, 1]`` / ``[N, 1]``
    -> ``(a * a_scale) @ (b * b_scale)ᵀ`` ``[M, N]`` in ``out_dtype``. ``fast_accum``: Hopper's
    faster FP8 accumulation, without its periodic promotion to fp32 (``train.fp8_fast_accumulation``;
    CPU has one mode).

    The op ``mtl::fp8_gemm`` (``scaled_mm`` below): ``torch.compile`` keeps it whole, operand
    layout and padding included, instead of lowering ``torch._scaled_mm`` itself. With
    inductor's own lowering on an H100 (torch 2.11) the FP8 layers stopped learning; with this
    op, compiled training follows eager and bf16 (``tests/gpu/test_fp8.py``,
    benchmarks/log)."""
    rowwise = a_scale.dim() > 0
    if not a.is_cuda:
        if rowwise and not CPU_ROWWISE:
            raise RuntimeError(
                f"train.fp8 = 'rowwise' on CPU needs torch >= 2.13 (this is {torch.__version__}, whose "
                "torch._scaled_mm takes per-tensor scales only on CPU); use train.fp8 = 'current' or a CUDA device")
        return torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale.t() if rowwise else b_scale,
                                out_dtype=out_dtype)
    (m, k), n = a.shape, b.shape[0]
    if (not rowwise and a.is_contiguous() and b.is_contiguous()
            and not (m % CUDA_MULTIPLE or n % CUDA_MULTIPLE or k % CUDA_MULTIPLE)):
        # training's shapes: the one cuBLAS call and nothing around it (this op runs three times
        # per linear per micro-batch, and every extra tensor op costs the host a dispatch)
        return torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    a, b = a.contiguous(), b.contiguous()  # row-major both: bᵀ is then the column-major operand cuBLAS wants
    m_pad, n_pad, k_pad = _round_up(m), _round_up(n), _round_up(k)
    a, b = _pad(a, m_pad, k_pad), _pad(b, n_pad, k_pad)  # zeros along K add nothing
    if rowwise:  # padded rows get scale 1 (their values are zero)
        a_scale = F.pad(a_scale, (0, 0, 0, m_pad - m), value=1.0)
        b_scale = F.pad(b_scale, (0, 0, 0, n_pad - n), value=1.0)
    mm_dtype = torch.bfloat16 if rowwise else out_dtype
    out = torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale.t() if rowwise else b_scale,
                           out_dtype=mm_dtype, use_fast_accum=fast_accum)
    return out[:m, :n].to(out_dtype).contiguous()  # as the fake kernel says: a cut-back result is a view


_LIB.impl("fp8_gemm", _fp8_gemm, "CompositeExplicitAutograd")


@torch.library.register_fake("mtl::fp8_gemm")
def _(a, a_scale, b, b_scale, out_dtype, fast_accum=False):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


scaled_mm = torch.ops.mtl.fp8_gemm.default


def _fp8_gemm_accumulate(out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                         b_scale: torch.Tensor) -> None:
    """``out += (a * a_scale) @ (b * b_scale)ᵀ``, ``out`` an fp32 ``[M, N]`` (an FP8 linear's
    ``main_grad``). On CUDA with per-tensor scales: one cuBLASLt GEMM whose epilogue adds, in
    fp32 (``cublaslt.py``). Otherwise the product, then an add: in fp32 on CPU; on CUDA in
    bf16 for row-wise scales (torch's row-wise FP8 kernel writes bf16 only, and Hopper's cuBLASLt
    has no per-row scaling), so a row-wise weight gradient is rounded to bf16 per micro-batch
    as without the fusion."""
    if cublaslt.accepts(out, a, a_scale, b, b_scale) and cublaslt.fp8_gemm_accumulate(out, a, a_scale, b, b_scale):
        return
    product_dtype = torch.bfloat16 if out.is_cuda and a_scale.dim() > 0 else out.dtype
    out.add_(_fp8_gemm(a, a_scale, b, b_scale, product_dtype))  # the add promotes a bf16 product


_LIB.impl("fp8_gemm_accumulate", _fp8_gemm_accumulate, "CompositeExplicitAutograd")


@torch.library.register_fake("mtl::fp8_gemm_accumulate")
def _(out, a, a_scale, b, b_scale) -> None:
    return None


scaled_mm_accumulate = torch.ops.mtl.fp8_gemm_accumulate.default


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` in the top-left corner of a zero ``[rows, cols]`` tensor (``t`` itself if it fits)."""
    if tuple(t.shape) == (rows, cols):
        return t
    padded = torch.zeros(rows, cols, dtype=t.dtype, device=t.device)
    padded[: t.shape[0], : t.shape[1]] = t
    return padded
