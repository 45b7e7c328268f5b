"""The word embedding's gradient accumulated straight into the fp32 ``main_grad``, row by
token id (the embedding's part in wgrad_fusion.py's gradient-accumulation fusion).

With bf16 weights and fp32 gradient buffers, ``F.embedding``'s backward writes a dense bf16
``[V, h]`` gradient (a memset of the whole table, a sort, a scatter) and the DataParallel
hook then adds all of it into ``main_grad``: on an H100 with a 50304 x 2048 table that is
about 5 ms of a 1.06 s step (8 micro-batches), and each micro-batch's gradient is rounded to
bf16 on the way. Here the backward adds ``grad_output`` into the rows of the tokens present,
in fp32, and returns an uninitialised tensor to autograd (which the hook drops, as for the
fused linears: ``param.wgrad_fused``).

Order of the sums: an id's gradient rows are summed in fp32 in token order, then added into
``main_grad[id]`` once. So the result is bitwise the same on every run, and the same whatever
the tensor-parallel layout (each rank sees every token, with the same gradient row, and only
skips the tokens it does not own). On CUDA it is a Triton kernel with no host synchronisation
(no data-dependent shapes); elsewhere the same formula in PyTorch (sum per id, then add).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # CPU installs have no Triton; CUDA ones do (it comes with torch)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


_LIB = torch.library.Library("mtl", "FRAGMENT")
# ids [T] int64 (negative: a token this rank does not own, which adds nothing); grad_output [T, h]
_LIB.define("accumulate_embedding_grad(Tensor(a!) main_grad, Tensor grad_output, Tensor ids) -> ()")


def _accumulate_torch(main_grad: torch.Tensor, grad_output: torch.Tensor, ids: torch.Tensor) -> None:
    """The reference formula: per id, the sum of its rows in token order, then one add.
    ``index_add_`` runs through its index in order on a CPU, so this is deterministic there."""
    keep = ids >= 0
    ids, grad = ids[keep], grad_output[keep]
    present, slot = torch.unique(ids, return_inverse=True)  # sorted ids; each token's position among them
    sums = torch.zeros(len(present), grad.shape[1], dtype=main_grad.dtype, device=main_grad.device)
    sums.index_add_(0, slot, grad.to(main_grad.dtype))
    main_grad.index_add_(0, present, sums)


if triton is not None:

    @triton.jit
    def _embedding_grad_kernel(main_grad_ptr, grad_ptr, sorted_ids_ptr, order_ptr, run_ends_ptr,
                               hidden, main_grad_row_stride,
                               BLOCK: tl.constexpr, UNROLL: tl.constexpr):
        # program (i, c): sorted position i, columns [c*BLOCK, (c+1)*BLOCK). Only the first
        # position of a run of equal ids works, so each main_grad row has one writer.
        i = tl.program_id(0)
        row = tl.load(sorted_ids_ptr + i)
        previous = tl.load(sorted_ids_ptr + i - 1, mask=i > 0, other=-1)
        if (row >= 0) & (row != previous):
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            in_row = cols < hidden
            end = tl.load(run_ends_ptr + i).to(tl.int32)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            # the run's rows in sorted (= token) order; unrolled so that the loads of UNROLL
            # rows are in flight together (a run may hold thousands of tokens). A while loop:
            # Triton's interpreter (the CPU tests) cannot take a loaded value as range()'s bound.
            start = i
            while start < end:
                for u in tl.static_range(UNROLL):
                    j = start + u
                    token = tl.load(order_ptr + j, mask=j < end, other=0)
                    acc += tl.load(grad_ptr + token * hidden + cols, mask=in_row & (j < end), other=0.0).to(tl.float32)
                start += UNROLL
            dst = main_grad_ptr + row * main_grad_row_stride + cols
            tl.store(dst, tl.load(dst, mask=in_row) + acc, mask=in_row)


def _accumulate_triton(main_grad: torch.Tensor, grad_output: torch.Tensor, ids: torch.Tensor) -> None:
    """The CUDA path (also runs under ``TRITON_INTERPRET=1`` on CPU tensors, for the tests)."""
    tokens, hidden = grad_output.shape
    if tokens == 0:
        return
    assert main_grad.stride(1) == 1, "main_grad rows must be contiguous"
    grad = grad_output.contiguous()
    sorted_ids, order = torch.sort(ids, stable=True)  # stable: equal ids stay in token order
    run_ends = torch.searchsorted(sorted_ids, sorted_ids, right=True)  # one past each run's last position
    block = min(1024, triton.next_power_of_2(hidden))
    grid = (tokens, triton.cdiv(hidden, block))
    _embedding_grad_kernel[grid](main_grad, grad, sorted_ids, order, run_ends, hidden, main_grad.stride(0),
                                 BLOCK=block, UNROLL=8, num_warps=4)


def _accumulate_embedding_grad(main_grad: torch.Tensor, grad_output: torch.Tensor, ids: torch.Tensor) -> None:
    """``main_grad[ids[t]] += grad_output[t]`` for every t with ``ids[t] >= 0``, in fp32."""
    if main_grad.is_cuda and triton is not None:
        _accumulate_triton(main_grad, grad_output, ids)
    else:  # CPU (deterministic); a CUDA install without Triton would get atomics and host syncs here
        _accumulate_torch(main_grad, grad_output, ids)


_LIB.impl("accumulate_embedding_grad", _accumulate_embedding_grad, "CompositeExplicitAutograd")


@torch.library.register_fake("mtl::accumulate_embedding_grad")
def _(main_grad, grad_output, ids) -> None:
    return None


accumulate_embedding_grad = torch.ops.mtl.accumulate_embedding_grad.default


class _EmbeddingAccumulatingMainGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose weight gradient goes into ``main_grad``."""

    @staticmethod
    def forward(ctx, ids, weight, main_grad, skip):
        # the ids the backward adds by: the tokens in ``skip`` (owned by another TP rank) as -1
        ctx.save_for_backward(ids if skip is None else ids.masked_fill(skip, -1), weight)
        # not saved_tensors: main_grad is a view of a buffer other weights' gradients write
        # to before this backward, which autograd's version check would refuse
        ctx.main_grad = main_grad
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        ids, weight = ctx.saved_tensors
        accumulate_embedding_grad(ctx.main_grad, grad_output.reshape(-1, grad_output.shape[-1]), ids.reshape(-1))
        # The DataParallel hook ignores this tensor (param.wgrad_fused); it only has to exist.
        return None, torch.empty_like(weight), None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, main_grad: torch.Tensor | None = None,
              skip: torch.Tensor | None = None) -> torch.Tensor:
    """``F.embedding(ids, weight)``; given ``main_grad``, the weight's gradient is added into it
    instead (fp32, only the rows of the ids present), the tokens where ``skip`` is True adding
    nothing (their output must be masked by the caller, as VocabParallelEmbedding does)."""
    if main_grad is None:
        return F.embedding(ids, weight)
    return _EmbeddingAccumulatingMainGrad.apply(ids, weight, main_grad, skip)
