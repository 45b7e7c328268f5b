"""Cross-entropy over logits whose vocabulary is split across tensor-parallel ranks.

Full-vocabulary logits are never gathered: each rank reduces its slice to three numbers per
token (max, sum of exponentials, the target's logit when it owns the target) and the ranks
all-reduce those. The gradient ``softmax - onehot(target)`` is computed on the local slice.

Columns at or past ``vocab_size`` (the padding that makes the vocabulary divisible by 128·tp)
take no part: they are left out of the max and get probability exactly zero, so the loss and
every gradient are those of the true vocabulary, whatever the padding and hence whatever tp.
"""

from __future__ import annotations

import torch

from mtl.core.errors import ParallelError
from mtl.parallel.tensor_parallel import collectives as C
from mtl.parallel.tensor_parallel.sharding import tp_size_and_rank


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_local, target, group, vocab_start, num_real):
        # logits_local [..., V/tp] in any float dtype; the math runs in fp32 (fp64 stays fp64).
        # The first num_real columns are real vocabulary, the rest padding.
        logits = logits_local.to(torch.promote_types(logits_local.dtype, torch.float32))
        vocab_local = logits.shape[-1]
        if num_real > 0:
            local_max = logits[..., :num_real].max(dim=-1).values
        else:  # this rank holds only padding
            local_max = logits.new_full(logits.shape[:-1], float("-inf"))
        row_max = C.all_reduce_max_(local_max, group)  # [...]
        shifted = logits - row_max.unsqueeze(-1)  # [..., V/tp], fresh tensor
        if num_real < vocab_local:
            shifted[..., num_real:] = float("-inf")  # exp -> 0: no probability, no gradient

        not_mine = (target < vocab_start) | (target >= vocab_start + vocab_local)
        local_target = (target - vocab_start).masked_fill(not_mine, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = C.all_reduce_sum_(target_logit.masked_fill(not_mine, 0.0), group)  # [...]

        exp = shifted.exp_()  # reuse the buffer: [..., V/tp]
        sum_exp = C.all_reduce_sum_(exp.sum(dim=-1), group)  # [...]
        loss = torch.log(sum_exp) - target_logit  # [...] fp32

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, not_mine, local_target)
        ctx.logits_dtype = logits_local.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, not_mine, local_target = ctx.saved_tensors
        grad = softmax.clone()  # d loss / d logits = softmax - onehot(target)
        mine = (~not_mine).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -mine.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor, target: torch.Tensor, topology=None, vocab_size: int | None = None
) -> torch.Tensor:
    """Per-token loss (fp32, or fp64 for fp64 logits; shaped like ``target``) of logits split over TP.

    ``logits_local`` is ``[s, b, V/tp]`` or ``[b, s, V/tp]`` (any leading shape), ``target``
    the matching ``[s, b]`` / ``[b, s]`` int64 ids in ``[0, vocab_size)``. ``vocab_size`` is
    the true vocabulary when ``V`` is padded past it (None: no padding). ``topology=None``
    means one process (the logits are then the full vocabulary)."""
    if target.shape != logits_local.shape[:-1]:
        raise ParallelError(
            f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} must equal the logits' "
            f"leading shape {tuple(logits_local.shape[:-1])} (logits {tuple(logits_local.shape)}); "
            "transpose the labels to the logits' layout"
        )
    _, tp_rank, group = tp_size_and_rank(topology)
    vocab_local = logits_local.shape[-1]
    vocab_start = tp_rank * vocab_local
    num_real = vocab_local if vocab_size is None else max(0, min(vocab_local, vocab_size - vocab_start))
    return _VocabParallelCrossEntropy.apply(logits_local, target, group, vocab_start, num_real)
