"""ZeRO-1: AdamW state and update for this rank's shard of the parameters only.

``DataParallel(use_distributed_optimizer=True)`` lays parameters and gradients out in flat
buffers whose buckets are padded to a multiple of the dp x cp size N, and reduce-scatters
each bucket, so rank r holds the averaged gradient of the r-th 1/N of every bucket. Expert
parameters sit in buffers of their own, sharded the same way over the N/ep ranks that hold
the same experts (``edp_cp``): each expert's state is split over its replicas only. Here:

    piece (this rank's part of one parameter) = bucket.param_shard[a:b]  (a view: updating it
                                                updates the parameter, or under ZeRO-3 its shard)
    piece.grad                                = bucket.grad_shard[a:b]
    AdamW(pieces)                               state: 2 x (1/N of the model) per rank
                                                (with bf16/fp16 weights on CUDA: the one-pass
                                                Triton AdamW, which writes the model shard too)
    all-gather each bucket's param shard        every rank has full parameters again

The weight-decay rule is decided per whole parameter (``param_groups.py``), as the
replicated path does, so both give the same update.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from mtl.core.errors import ParallelError
from mtl.parallel.ddp import DataParallel
from mtl.parallel.flat_collectives import all_gather_flat
from mtl.parallel.optimizer.adamw_shell import AdamWShell, StateEntry, main_copy
from mtl.parallel.topology import Topology


def _shard_entries(chunks: list[DataParallel]) -> list[StateEntry]:
    entries: list[StateEntry] = []
    for c, chunk in enumerate(chunks):
        for buf in chunk.buffers_by_dtype:
            for slot, first, last, bucket, at in buf.owned_pieces(buf.reduce_group.rank):
                # the bucket's shards: views of the flat buffers (ZeRO-1), or tensors of their own (ZeRO-2/3)
                params = bucket.param_shard[at : at + last - first]
                grads = bucket.grad_shard[at : at + last - first]
                name = slot.name if len(chunks) == 1 else f"chunk{c}.{slot.name}"
                if buf.uses_main_grad:  # bf16/fp16 weights: AdamW updates an fp32 main shard
                    entries.append(StateEntry(main_copy(params, grads), slot.param, name, first, model_view=params))
                else:
                    piece = nn.Parameter(params)
                    piece.grad = grads
                    entries.append(StateEntry(piece, slot.param, name, first))
    return entries


class DistributedOptimizer(AdamWShell):
    is_dp_sharded = True

    def __init__(self, ddp_model: DataParallel | list[DataParallel], topology: Topology, *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        chunks = list(ddp_model) if isinstance(ddp_model, (list, tuple)) else [ddp_model]
        for i, chunk in enumerate(chunks):
            if not isinstance(chunk, DataParallel) or not chunk.use_distributed_optimizer:
                raise ParallelError(
                    f"DistributedOptimizer needs every model chunk wrapped as DataParallel(..., "
                    f"use_distributed_optimizer=True); chunk {i} is a {type(chunk).__name__}"
                    + ("" if not isinstance(chunk, DataParallel) else " without it")
                )
        self.chunks = chunks
        # hybrid sharding: the shards (and their squares in the norm) repeat over the replicas
        self.shard_group = chunks[0].reduce_groups["dp_cp"].group if chunks[0].reduce_groups["dp_cp"].replicate_group \
            is not None else "dp_cp"
        super().__init__(_shard_entries(chunks), topology, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def step(self) -> None:
        for chunk in self.chunks:
            chunk.finish_grad_sync()  # a no-op when the training loop already did it
            # With overlap_param_gather a bucket no forward touched may still be gathering
            # last step's update into the shard this step writes.
            chunk.finish_param_sync()
        self.update_weights()  # this rank's shard: AdamW and main -> model weights (see AdamWShell)
        self._gather_params()

    def publish_main_weights(self) -> None:
        """This rank's updated shard into the weights, then the all-gather that spreads every
        shard (returns at once with overlap_param_gather: forwards wait)."""
        self.copy_main_to_model()
        self._gather_params()

    def _gather_params(self) -> None:
        for chunk in self.chunks:
            chunk.gather_params()  # returns at once with overlap_param_gather: forwards wait

    def full_moments(self) -> Iterator[tuple[nn.Parameter, dict[str, torch.Tensor]]]:
        """Every parameter's whole moments, all-gathered over each buffer's group (dp x cp;
        edp x cp for experts) one bucket at a time (a collective: every rank iterates to the end). Each bucket's
        moments are gathered like its parameters after a step; the tensors yielded are views
        of that bucket's gathered copy, valid until the next bucket: clone what you keep."""
        pieces = {id(p.source): p for p in self.state_pieces()}
        for chunk in self.chunks:
            for buf in chunk.buffers_by_dtype:
                group = buf.reduce_group.group  # dp x cp, or edp x cp for expert parameters
                for bucket in buf.buckets:
                    lo, hi = bucket.shard_range(buf.reduce_group.rank)
                    gathered = {}
                    for moment in self.state_names:
                        shard = torch.zeros(hi - lo, dtype=buf.dtype, device=buf.device)
                        for slot in bucket.slots:  # this rank's piece of each parameter it owns
                            piece = pieces.get(id(slot.param))
                            if piece is not None:
                                at = slot.start + piece.first - (bucket.start + lo)
                                shard[at : at + piece.moments[moment].numel()] = piece.moments[moment]
                        if group is None:
                            gathered[moment] = shard
                        else:
                            gathered[moment] = torch.empty(bucket.numel, dtype=buf.dtype, device=buf.device)
                            all_gather_flat(gathered[moment], shard, group=group)
                    for slot in bucket.slots:
                        start, end = slot.start - bucket.start, slot.end - bucket.start
                        yield slot.param, {m: t[start:end].view_as(slot.param) for m, t in gathered.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for chunk in self.chunks:
            chunk.zero_grad()
