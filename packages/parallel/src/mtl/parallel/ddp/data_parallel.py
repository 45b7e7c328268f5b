"""Data parallelism with bucketed gradient reduction overlapped with backward.

    model = DataParallel(module, topology, bucket_size_mb=40.0)
    model.zero_grad()
    with model.no_sync():             # micro-batches 1..n-1: accumulate locally, no traffic
        loss_fn(model(x0)).backward()
    loss_fn(model(x1)).backward()     # last micro-batch: buckets reduce as they fill
    model.finish_grad_sync()          # wait; param.grad now holds the dp x cp average

Gradients are averaged over ``topology.group("dp_cp")``: context-parallel ranks see
different tokens of the same sequences, so they are data parallel for the gradient. Expert
parameters (``ParamLayout.expert_split_dim``, ``mtl.parallel.param_layout``) live in buffers of their own, reduced over the ranks
holding the same experts (``edp_cp``; see ``reduce_group.py`` for why the divisor stays the
dp x cp size). With ``use_distributed_optimizer`` the buckets are reduce-scattered instead
of all-reduced over their buffer's group: only this rank's shard of each bucket holds the
average afterwards (``param.dp_owned_grad_range`` says which flat part of each parameter),
and ``mtl.parallel.optimizer.DistributedOptimizer`` updates that shard and all-gathers the
parameters over the same group.

``sharding`` goes further (ZeRO-2: each micro-batch's buckets are reduce-scattered and freed,
``sharded_grads.py``; ZeRO-3: parameters too are kept as shards and gathered per layer,
``param_gather.py``); ``dp_replicate`` shards within blocks of the group (``hybrid.py``).

With ``overlap_param_gather`` (ZeRO-1/2) the optimizer's all-gathers are only launched and
each forward waits for its buckets (``param_gather.register_wait_hooks``). Whatever reads
parameters outside a forward must call ``finish_param_sync()`` first (``state_dict``,
``load_state_dict``, ``gather_params`` and the optimizer's step do).

Parameters marked ``mark_sequence_parallel_grad`` (norm weights, row biases under sequence
parallelism: each TP rank's gradient covers its own part of the sequence) are summed over
the TP group at the end of ``finish_grad_sync``, all of them in one all-reduce per dtype
(``mtl.parallel.sequence_parallel_grads``). With the distributed optimizer only this rank's
shard of them is then the full gradient, as for every other parameter.

Parameters whose layout says ``shared_embedding`` are averaged over data parallel like any other;
their sum over the pipeline's embedding group belongs to the pipeline code. That sum adds
whole gradients of two differently laid-out stages, so a bucket holding such a parameter is
all-reduced even with the distributed optimizer (every element valid, not just this rank's
shard).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from mtl.core.errors import ParallelError
from mtl.parallel.ddp import sharded_grads
from mtl.parallel.ddp.bucket_storage import HeldBytes
from mtl.parallel.ddp.grad_buffer import Bucket, GradBuffer
from mtl.parallel.ddp.hybrid import reduce_over_replicas, sum_sequence_parallel_shards
from mtl.parallel.ddp.param_gather import ROOT, gather_units, register_wait_hooks, shard_buffers
from mtl.parallel.ddp.reduce_group import DENSE, EXPERT, ReduceGroup, is_expert_param
from mtl.parallel.ddp.sharding_choice import checked_sharding
from mtl.parallel.flat_collectives import all_gather_flat, reduce_scatter_flat
from mtl.parallel.sequence_parallel_grads import allreduce_sequence_parallel_grads, has_sequence_parallel_grad
from mtl.parallel.topology import Topology



class DataParallel(nn.Module):
    def __init__(
        self,
        module: nn.Module,
        topology: Topology,
        *,
        bucket_size_mb: float = 40.0,
        overlap_grad_reduce: bool = True,
        use_distributed_optimizer: bool = False,
        overlap_param_gather: bool = False,
        grad_dtype: torch.dtype | None = None,
        sharding: str | None = None,
        dp_replicate: int = 1,
    ) -> None:
        """``grad_dtype`` (e.g. fp32 under bf16 weights) accumulates and reduces gradients in
        that dtype, in ``param.main_grad``; None keeps them in the parameters' dtype.
        ``sharding`` ("none", "optimizer", "gradients", "parameters"; None: "optimizer" with
        ``use_distributed_optimizer``, else "none") and ``dp_replicate`` are
        ``parallel.sharding`` and ``parallel.dp_replicate`` (the package README's "Sharded data parallelism")."""
        super().__init__()
        sharding = checked_sharding(sharding, use_distributed_optimizer, bucket_size_mb, overlap_param_gather)
        use_distributed_optimizer = sharding != "none"
        self.sharding = sharding
        self.module = module
        self.topology = topology
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_param_gather = overlap_param_gather
        # The dense parameters' group (dp x cp); expert buffers carry their own (edp x cp).
        self.reduce_groups = {name: ReduceGroup.of(topology, name, dp_replicate) for name in (DENSE, EXPERT)}
        dense = self.reduce_groups[DENSE]
        self.group, self.group_size, self.group_rank = dense.group, dense.size, dense.rank

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ParallelError(f"DataParallel got a {type(module).__name__} with no trainable parameters")
        self.held_bytes = HeldBytes()  # the buffers' storage: weights, gradients and their shards
        # ZeRO-2/3: a bucket holds one layer's parameters at most, so what is gathered or filled whole is a layer
        units, unit_of = gather_units(module) if sharding in ("gradients", "parameters") else ([], None)
        self.buffers_by_dtype = self._grad_buffers(named, bucket_size_mb, grad_dtype, unit_of)
        # One launch order for every rank (NCCL needs collectives in the same order everywhere).
        self.buckets: list[Bucket] = [b for buf in self.buffers_by_dtype for b in buf.buckets]
        self._owner = {id(p): (buf, buf.slot_of[id(p)]) for buf in self.buffers_by_dtype for _, p in named
                       if id(p) in buf.slot_of}
        if use_distributed_optimizer:
            for buf in self.buffers_by_dtype:
                buf.mark_owned_grad_ranges()

        # summed over TP by finish_grad_sync, in this order on every TP rank (the same module part)
        self._sequence_parallel_params = [p for _, p in named if has_sequence_parallel_grad(p)]
        self._in_flight: list[Bucket] = []  # ZeRO-2/3: the bucket whose reduce-scatter runs
        if sharding in ("gradients", "parameters"):  # a micro-batch's last bucket (the embedding's)
            # is completed when the next forward starts, not held at the next backward's peak
            module.register_forward_pre_hook(lambda _m, _a: self._complete_in_flight())
        self._sync_enabled = True  # False inside no_sync()
        self._synced = False  # finish_grad_sync() done since the last backward / zero_grad
        self._next_launch = 0  # index into self.buckets of the next collective to start
        self.num_collectives_launched = 0  # since zero_grad(); tests read it to see overlap
        self._hooks = [
            param.register_post_accumulate_grad_hook(self._on_grad_accumulated) for _, param in named
        ]
        # In-flight parameter all-gathers, one slot per entry of self.buckets (None: nothing
        # to wait for). Holding the handle keeps the collective and its tensors alive.
        self._param_gather_handles: list[object | None] = [None] * len(self.buckets)
        self.num_param_gathers_waited_in_forward = 0  # since construction; tests read it
        self._param_gather_hook_handles = (register_wait_hooks(module, self.buckets, self._on_param_gather_waited)
                                            if overlap_param_gather else [])
        self.broadcast_params()
        self.layer_gather = shard_buffers(module, sharding, units, unit_of, self.buffers_by_dtype, self.buckets,
                                          self.held_bytes)
        self.held_bytes.reset_peak()

    def _grad_buffers(self, named: list[tuple[str, nn.Parameter]], bucket_size_mb: float,
                      grad_dtype: torch.dtype | None, unit_of: dict[int, int] | None) -> list[GradBuffer]:
        """One buffer per (dtype, reduce group): a bucket is one collective over one group."""
        by_kind: dict[tuple[torch.dtype, str], list[tuple[str, nn.Parameter]]] = {}
        for name, param in named:
            by_kind.setdefault((param.dtype, EXPERT if is_expert_param(param) else DENSE), []).append((name, param))
        buffers = []
        for (dtype, group_name), params in by_kind.items():
            element_size = torch.empty((), dtype=dtype).element_size()
            reduce_group = self.reduce_groups[group_name]
            buffers.append(GradBuffer(
                params,
                bucket_size_numel=max(1, int(bucket_size_mb * 2**20 / element_size)),
                num_shards=reduce_group.size,
                with_param_buffer=self.use_distributed_optimizer,
                grad_dtype=grad_dtype,
                reduce_group=reduce_group,
                shard_grads=self.sharding in ("gradients", "parameters"),
                shard_params=self.sharding == "parameters",
                unit_of=unit_of,
                held=self.held_bytes,
            ))
        return buffers

    # ---- module plumbing -------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)  # e.g. set_input_tensor of a pipeline stage

    def state_dict(self, *args, **kwargs):
        if self.layer_gather is not None:
            raise ParallelError("DataParallel.state_dict() under sharding = 'parameters' would return freed "
                                "weights; read them inside `with model.whole_parameters():`")
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    @contextlib.contextmanager
    def whole_parameters(self, write_back: bool = False) -> Iterator[None]:
        """Every parameter whole inside the block (a checkpoint's save or load): a no-op but for
        ``sharding = "parameters"``, where they are gathered and freed again after it, and with
        ``write_back`` (a load) each rank's shard is taken from what was written into them."""
        self.finish_param_sync()
        if self.layer_gather is None:
            yield
            return
        with self.layer_gather.all_gathered(write_back):
            yield

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise ParallelError(
                "DataParallel.load_state_dict(assign=True) would detach parameters from the "
                "contiguous buffers; load with assign=False (copies in place)"
            )
        self.finish_param_sync()  # an in-flight gather would overwrite what is loaded
        with self.whole_parameters(write_back=True):
            return self.module.load_state_dict(state_dict, strict=strict)

    # ---- gradient accumulation -------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate into the buffer; no communication."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradient buffers (``set_to_none`` is ignored: grads are buffer views)."""
        for bucket in self.buckets:  # ZeRO-2/3: a reduce-scatter still in flight finishes first
            sharded_grads.complete(bucket, self.held_bytes)
        for buf in self.buffers_by_dtype:
            buf.zero_grads()
        if self.layer_gather is not None:
            self.layer_gather.release_all()
        self._reset_buckets()
        self.num_collectives_launched = 0
        self._synced = False

    def _reset_buckets(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._next_launch = 0

    def _on_grad_accumulated(self, param: nn.Parameter) -> None:
        buf, slot = self._owner[id(param)]
        bucket = buf.buckets[slot.bucket_index]
        if bucket.shards_grads:
            self._on_sharded_grad(bucket, slot, param)
            return
        if buf.uses_main_grad:  # this micro-batch's gradient, in the weights' dtype, into fp32
            if not getattr(param, "wgrad_fused", False):  # else the GEMM already added it (wgrad_fusion.py)
                param.main_grad.add_(param.grad)
            param.grad = None
        if not buf.grad_is_attached(slot):
            raise ParallelError(
                f"gradient of '{slot.name}' no longer lives in the DataParallel buffer (something set "
                "param.grad to None or a new tensor, e.g. module.zero_grad() or "
                "optimizer.zero_grad(set_to_none=True)); zero gradients with DataParallel.zero_grad()"
            )
        if self._synced:  # nn.Module's __setattr__ costs microseconds; this runs per parameter and micro-batch
            self._synced = False
        if not (self._sync_enabled and self.overlap_grad_reduce):
            return
        bucket = buf.buckets[slot.bucket_index]
        if id(param) in bucket.ready:
            raise ParallelError(
                f"gradient of '{slot.name}' arrived twice before finish_grad_sync(); run every "
                "micro-batch but the last inside model.no_sync(), and call finish_grad_sync() once per step"
            )
        bucket.ready.add(id(param))
        # Start buckets strictly in order so every rank issues the same collective sequence.
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].all_ready:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _complete_in_flight(self) -> None:
        for bucket in self._in_flight:
            sharded_grads.complete(bucket, self.held_bytes)
        self._in_flight.clear()

    def _on_sharded_grad(self, bucket: Bucket, slot, param: nn.Parameter) -> None:
        """ZeRO-2/3: every micro-batch reduce-scatters its buckets as they fill (no_sync does
        not hold them back: a full gradient is never kept past its bucket)."""
        if getattr(param, "wgrad_fused", False):
            raise ParallelError(f"'{slot.name}' accumulates its weight gradient in the GEMM (wgrad fusion), which "
                                f"sharding = '{self.sharding}' does not keep a main_grad for; build without it")
        sharded_grads.add_grad(bucket, slot, param, self.held_bytes)
        if self._synced:
            self._synced = False
        bucket.ready.add(id(param))  # a set: a parameter a micro-batch skipped may come twice
        if bucket.all_ready:  # this unit's backward is done: its weights go before the reduce-scatter's output comes
            if self.layer_gather is not None and bucket.shards_params and \
                    self.layer_gather.unit_of_bucket(bucket) != ROOT:
                self.layer_gather.release_bucket(bucket)
            self.num_collectives_launched += sharded_grads.launch(bucket, self.held_bytes, self._in_flight)
            bucket.ready.clear()

    # ---- communication ---------------------------------------------------------------------
    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        reduce_group = bucket.reduce_group
        # Pre-scale so the SUM collective yields the mean (gloo has no AVG); an expert bucket
        # is scaled even when no other rank holds its experts (reduce_group.py says why).
        if reduce_group.grad_divisor != 1:
            bucket.grad_view.div_(reduce_group.grad_divisor)
        if reduce_group.group is None:
            return
        self.num_collectives_launched += 1
        if self.use_distributed_optimizer and not bucket.has_shared_embedding:
            lo, hi = bucket.shard_range(reduce_group.rank)
            bucket.handle = reduce_scatter_flat(bucket.grad_view[lo:hi], bucket.grad_view,
                                                 group=reduce_group.group, async_op=True)
        else:
            bucket.handle = dist.all_reduce(bucket.grad_view, group=reduce_group.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's collective (launching those not started yet), then sum the
        sequence-parallel parameters' gradients over TP. Idempotent until the next backward."""
        if not self._sync_enabled:
            raise ParallelError("finish_grad_sync() was called inside model.no_sync(); call it after the last micro-batch")
        if self._synced:
            return
        for bucket in self.buckets:
            if bucket.shards_grads:  # ZeRO-2/3: what a micro-batch left partly filled, then every result
                self.num_collectives_launched += sharded_grads.launch(bucket, self.held_bytes)
            elif not bucket.launched:  # overlap off, or parameters that got no gradient
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.shards_grads:
                sharded_grads.complete(bucket, self.held_bytes)
            elif bucket.handle is not None:
                bucket.handle.wait()
        self._reset_buckets()
        reduce_over_replicas(self.buckets)
        if self.sharding in ("gradients", "parameters"):  # only the shards hold gradients
            sum_sequence_parallel_shards(self._sequence_parallel_params, self.topology.tp_group)
        else:
            allreduce_sequence_parallel_grads(self._sequence_parallel_params, self.topology.tp_group)
        if self.layer_gather is not None:
            self.layer_gather.release_all()
        self._synced = True

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather every bucket's updated parameter shard (distributed optimizer only).

        With ``overlap_param_gather`` the all-gathers are only launched: the forward pre-hooks
        (or ``finish_param_sync()``) wait for them."""
        if not self.use_distributed_optimizer:
            raise ParallelError("gather_params() needs DataParallel(use_distributed_optimizer=True)")
        self.finish_param_sync()  # never two gathers into one bucket at once
        # Launch the buckets of the first layers (the last buckets) first: the forward needs
        # them first. The order is the same on every rank.
        for index in reversed(range(len(self.buckets))):
            bucket = self.buckets[index]
            reduce_group = bucket.reduce_group
            if reduce_group.group is None or bucket.shards_params:  # ZeRO-3: gathered per layer when used
                continue
            lo, hi = bucket.shard_range(reduce_group.rank)
            self._param_gather_handles[index] = all_gather_flat(
                bucket.param_view, bucket.param_view[lo:hi], group=reduce_group.group, async_op=True
            )
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight; afterwards every parameter is
        complete. Cheap and idempotent (nothing to do without ``overlap_param_gather``)."""
        for index in range(len(self._param_gather_handles)):
            self._wait_param_gather(index)

    @property
    def param_gathers_in_flight(self) -> int:
        """How many buckets' parameter all-gathers have not been waited for yet."""
        return sum(h is not None for h in self._param_gather_handles)

    def _wait_param_gather(self, index: int) -> bool:
        handle = self._param_gather_handles[index]
        if handle is None:
            return False
        self._param_gather_handles[index] = None  # consumed: a later forward must not wait again
        handle.wait()
        return True

    def _on_param_gather_waited(self, index: int) -> None:
        if self._wait_param_gather(index):
            self.num_param_gathers_waited_in_forward += 1

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Copy the parameters of data-parallel rank 0 to every rank of the dp x cp group
        (expert parameters: of the first rank holding the same experts)."""
        for buf in self.buffers_by_dtype:
            reduce_group = buf.reduce_group
            if reduce_group.whole_group is None:
                continue
            storages = buf.param_storages() if self.use_distributed_optimizer else [s.param.data for s in buf.slots]
            for storage in storages:
                dist.broadcast(storage, src=reduce_group.src, group=reduce_group.whole_group)
