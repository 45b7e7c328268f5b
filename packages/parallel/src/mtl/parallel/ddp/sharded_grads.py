"""ZeRO-2/3 gradients: each micro-batch's gradients fill their bucket's own full tensor, which
is reduce-scattered into this rank's ``grad_shard`` (accumulating over micro-batches) and
freed, so between buckets a rank holds only its shard of the reduced gradient.

    param.grad (this micro-batch, weights' dtype) --add--> bucket.grad_view (allocated on first use)
    bucket full  --reduce-scatter over the shard group--> pending_shard --add--> grad_shard
    bucket.grad_view freed once the reduce-scatter is done (``complete``)
"""

from __future__ import annotations

import torch

from mtl.parallel.ddp.bucket_storage import HeldBytes, allocate, free, is_allocated
from mtl.parallel.ddp.grad_buffer import Bucket, ParamSlot
from mtl.parallel.flat_collectives import reduce_scatter_flat


def add_grad(bucket: Bucket, slot: ParamSlot, param: torch.nn.Parameter, held: HeldBytes) -> None:
    """This micro-batch's ``param.grad`` into the bucket's full gradient, then drop it."""
    if bucket.pending_shard is not None:  # last micro-batch's reduce-scatter still owns the storage
        complete(bucket, held)
    if not is_allocated(bucket.grad_view):
        allocate(bucket.grad_view, held, zero=True)
    view = bucket.grad_view[slot.start - bucket.start : slot.end - bucket.start].view_as(param)
    view.add_(param.grad)
    param.grad = None


def attach_owned_grads(buffers: list) -> None:
    """``param.dp_owned_grad``: the piece of its bucket's ``grad_shard`` this rank keeps of each
    parameter (empty where it owns none of it), what the gradient norm reads."""
    for buf in buffers:
        for slot in buf.slots:
            slot.param.dp_owned_grad = buf.buckets[slot.bucket_index].grad_shard[:0]
        for slot, first, last, bucket, at in buf.owned_pieces(buf.reduce_group.rank):
            slot.param.dp_owned_grad = bucket.grad_shard[at : at + last - first]


def launch(bucket: Bucket, held: HeldBytes, in_flight: list[Bucket] | None = None) -> bool:
    """Start the bucket's reduce-scatter into a fresh shard (pre-scaled: gloo has no AVG);
    returns whether a collective was started. With ``in_flight`` (the caller's list of the
    bucket launched before) that earlier one is completed first, so one reduce-scatter runs
    while the next bucket fills and no other full gradient outlives its bucket. A bucket no gradient reached has nothing to add;
    one already launched (and not refilled since: ``add_grad`` completes it first) is in flight."""
    if bucket.pending_shard is not None or not is_allocated(bucket.grad_view):  # launched, or nothing came
        return False
    if in_flight is not None:
        for earlier in in_flight:
            complete(earlier, held)
        in_flight[:] = [bucket]
    reduce_group = bucket.reduce_group
    if reduce_group.grad_divisor != 1:
        bucket.grad_view.div_(reduce_group.grad_divisor)
    lo, hi = bucket.shard_range(reduce_group.rank)
    if reduce_group.group is None:  # one rank: the shard is the bucket
        bucket.pending_shard = bucket.grad_view[lo:hi]
        return False
    bucket.pending_shard = torch.empty(hi - lo, dtype=bucket.grad_view.dtype, device=bucket.grad_view.device)
    held.add(bucket.pending_shard.numel() * bucket.pending_shard.element_size())
    bucket.handle = reduce_scatter_flat(bucket.pending_shard, bucket.grad_view, group=reduce_group.group,
                                        async_op=True)
    return True


def complete(bucket: Bucket, held: HeldBytes) -> None:
    """Wait for the bucket's reduce-scatter, add its result into ``grad_shard``, free the full
    gradient and the result. Nothing to do when no reduce-scatter is pending."""
    if bucket.pending_shard is None:
        return
    if bucket.handle is not None:
        bucket.handle.wait()
        bucket.handle = None
    bucket.grad_shard.add_(bucket.pending_shard)
    if bucket.reduce_group.group is not None:
        held.add(-bucket.pending_shard.numel() * bucket.pending_shard.element_size())
    bucket.pending_shard = None
    free(bucket.grad_view, held)
