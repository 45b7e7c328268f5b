"""Attention of one query block against one key/value block, with its log-sum-exp, and its backward.

Ring attention computes softmax attention piecewise: each (query block, key/value block) pair
yields a partial output normalised over that block's keys plus the log-sum-exp (lse) of its
scores, and the partials are merged exactly with :func:`merge_partial`. The backward pass
recomputes the probabilities of each pair from the *final* lse, which is what makes it exact.

Shapes: q ``[b, sq, heads, d]``, k/v ``[b, sk, groups, d]`` (grouped-query attention: query head
``h`` uses key/value group ``h // (heads // groups)``), lse ``[b, heads, sq]``.
Arithmetic runs in at least float32 (float64 stays float64), whatever the input dtype.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs (accumulation precision), else the input dtype."""
    return torch.promote_types(dtype, torch.float32)


def _grouped(q: torch.Tensor, groups: int) -> torch.Tensor:
    # [b, sq, heads, d] -> [b, sq, groups, heads/groups, d]
    b, sq, heads, d = q.shape
    return q.reshape(b, sq, groups, heads // groups, d)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask_offset: int | None) -> torch.Tensor:
    """Scaled scores ``[b, groups, heads/groups, sq, sk]`` in the compute dtype, causally masked if asked.

    ``mask_offset`` None: no mask. An int ``o``: key j is masked for query i when j > i + o, the
    causal mask of a query block that starts ``o`` tokens after the key block, both in
    increasing global order (0: a lower-triangular block on the diagonal)."""
    dtype = compute_dtype(q.dtype)
    qg = _grouped(q.to(dtype), k.size(2))
    scores = torch.einsum("bqgnd,bkgd->bgnqk", qg, k.to(dtype)) * scale
    if mask_offset is not None:
        sq, sk = scores.shape[-2:]
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1 + mask_offset)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask_offset: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[b, sq, heads, d]``, lse ``[b, heads, sq]``), both in the compute dtype.

    ``out`` is normalised over this block's keys only. Every query row must see at least one
    key (true for the block pairs ring attention computes)."""
    b, sq, heads, d = q.shape
    scores = _scores(q, k, scale, mask_offset)  # [b, g, n, sq, sk]
    lse = torch.logsumexp(scores, dim=-1)  # [b, g, n, sq]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("bgnqk,bkgd->bqgnd", probs, v.to(probs.dtype))
    return out.reshape(b, sq, heads, d), lse.reshape(b, heads, sq)


def block_backward(
    dout: torch.Tensor,
    delta: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    mask_offset: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of this block pair's share of the attention, in the compute dtype.

    dout ``[b, sq, heads, d]`` is the gradient of the final output; lse ``[b, heads, sq]`` the
    final log-sum-exp over *all* keys; delta ``[b, heads, sq]`` = rowsum(dout * out_final).
    With P = exp(S - lse): dV = P^T dO, dP = dO V^T, dS = P (dP - delta), dQ = scale dS K,
    dK = scale dS^T Q; dk/dv are summed over the query heads sharing a group."""
    b, sq, heads, d = q.shape
    groups = k.size(2)
    n = heads // groups
    scores = _scores(q, k, scale, mask_offset)  # [b, g, n, sq, sk]
    dtype = scores.dtype
    probs = torch.exp(scores - lse.reshape(b, groups, n, sq, 1))
    dout_g = _grouped(dout.to(dtype), groups)  # [b, sq, g, n, d]
    dv = torch.einsum("bgnqk,bqgnd->bkgd", probs, dout_g)
    dprobs = torch.einsum("bqgnd,bkgd->bgnqk", dout_g, v.to(dtype))
    dscores = probs * (dprobs - delta.reshape(b, groups, n, sq, 1))
    dq = torch.einsum("bgnqk,bkgd->bqgnd", dscores, k.to(dtype)) * scale
    dk = torch.einsum("bgnqk,bqgnd->bkgd", dscores, _grouped(q.to(dtype), groups)) * scale
    return dq.reshape(b, sq, heads, d), dk, dv


def merge_partial(
    out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a partial result into a running one (online softmax), numerically stable: new
    tensors in the wider dtype, differentiable (the reference form; the ring uses
    ``merge_partial_into``, which writes into its running tensors).

    out/part_out ``[b, sq, heads, d]``, lse/part_lse ``[b, heads, sq]``; a running lse of
    -inf (no keys seen yet) takes the partial as is."""
    new_lse = torch.logaddexp(lse, part_lse)
    # [b, heads, sq] -> [b, sq, heads, 1] to weight the outputs
    old_weight = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)
    part_weight = torch.exp(part_lse - new_lse).transpose(1, 2).unsqueeze(-1)
    return out * old_weight + part_out * part_weight, new_lse


def merge_partial_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """``merge_partial`` written into ``out`` and ``lse`` (views of the ring's running output and
    log-sum-exp), without the intermediate full-size results: the ring merges every piece of
    every step, and each pass over its fp32 output costs as much as a small attention block.
    ``part_out`` may be in a lower precision than ``out`` (it is promoted as it is read)."""
    new_lse = torch.logaddexp(lse, part_lse)
    old_weight = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)
    part_weight = torch.exp(part_lse - new_lse).transpose(1, 2).unsqueeze(-1)
    out.mul_(old_weight).addcmul_(part_out, part_weight)
    lse.copy_(new_lse)


def place_piece(out: torch.Tensor, lse: torch.Tensor, filled: int, rows: slice, part_out: torch.Tensor,
                part_lse: torch.Tensor) -> int:
    """Put one piece's result into the running ``out`` ``[b, s, heads, d]`` and ``lse``
    ``[b, heads, s]`` at query ``rows``, whose rows ``[0, filled)`` hold results so far (the
    pieces come in row order): copied in where nothing is there yet (a copy instead of a merge's
    kernels), merged otherwise. Returns the new ``filled``. (No ``slice.indices``: dynamo under
    torch 2.11 cannot trace it.)"""
    start = rows.start or 0
    if start >= filled:
        out[:, rows] = part_out
        lse[:, :, rows] = part_lse
        return out.size(1) if rows.stop is None else rows.stop
    merge_partial_into(out[:, rows], lse[:, :, rows], part_out, part_lse)
    return filled
