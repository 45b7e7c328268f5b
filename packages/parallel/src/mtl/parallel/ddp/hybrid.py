"""Sums that finish a sharded gradient: over hybrid sharding's replicas, and over TP for the
sequence-parallel parameters whose gradients only the shards hold (ZeRO-2/3)."""

from __future__ import annotations

import torch
from torch import nn

from mtl.parallel.ddp.grad_buffer import Bucket
from mtl.parallel.flat_collectives import all_reduce_as_one


def reduce_over_replicas(buckets: list[Bucket]) -> None:
    """Hybrid sharding: each block reduced its own ranks' gradients; summing the reduced shards
    over the blocks (the replicate group) completes the average over every dp x cp rank (the
    buckets were divided by that whole size). A bucket all-reduced whole (a tied embedding
    shared across pipeline stages) is summed whole. One all-reduce per (group, dtype)."""
    batches: dict[tuple[int, torch.dtype], tuple[object, list[torch.Tensor]]] = {}
    for bucket in buckets:
        group = bucket.reduce_group.replicate_group
        if group is None:
            continue
        tensor = bucket.grad_view if bucket.has_shared_embedding else bucket.grad_shard
        batches.setdefault((id(group), tensor.dtype), (group, []))[1].append(tensor)
    for group, tensors in batches.values():
        all_reduce_as_one(tensors, group)


def sum_sequence_parallel_shards(params: list[nn.Parameter], tp_group) -> None:
    """Under ZeRO-2/3 the gradient of a sequence-parallel parameter (each TP rank saw its own
    tokens) lives only in this rank's shards: sum those over TP. Every TP rank has the same
    buckets, so the same pieces, in the same order."""
    if tp_group is None:
        return
    pieces = [p.dp_owned_grad for p in params if p.dp_owned_grad.numel()]
    if pieces:
        all_reduce_as_one(pieces, tp_group)
