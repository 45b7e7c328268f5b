"""Contiguous gradient (and parameter) storage for one dtype, cut into communication buckets.

Layout: parameters are placed in *reverse* registration order, the order backward produces
their gradients, so the first bucket fills first and its collective can start while backward
still runs. Each ``param.grad`` is a view into ``grad_data`` (set before the first backward,
so autograd accumulates in place).

With a ``grad_dtype`` wider than the parameters' (bf16/fp16 weights, fp32 gradients:
Megatron's precision layout) the view is ``param.main_grad`` instead: autograd leaves each
micro-batch's gradient in ``param.grad`` in the weights' dtype, and ``DataParallel`` adds it
into ``main_grad`` and frees it, so gradients accumulate over micro-batches in fp32.

With the distributed optimizer every bucket is padded to a multiple of the shard count (the
data-parallel x context-parallel size): a bucket of ``n`` elements is reduce-scattered so
that shard rank ``r`` holds the averaged gradient of ``[r*n/N, (r+1)*n/N)`` of that bucket,
and the parameters are views into ``param_data`` with the same layout, so the updated shard
can be all-gathered in place.

    grad_data   [ bucket 0 (last params) | bucket 1 | ... ]        numel = sum(padded buckets)
    bucket b    [ shard 0 | shard 1 | ... | shard N-1 ]             each numel(b) / N
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtl.core.errors import ParallelError
from mtl.parallel.param_layout import param_layout

# Shards start on a 16-element boundary (64 bytes in fp32) so fused kernels and NCCL see
# aligned pointers.
SHARD_ALIGNMENT = 16


@dataclass(eq=False)
class ParamSlot:
    """Where one parameter lives in its buffer: ``[start, end)`` of the flat storage."""

    param: torch.nn.Parameter
    name: str
    start: int
    end: int
    bucket_index: int


@dataclass(eq=False)
class Bucket:
    """A contiguous range of one buffer that is reduced by one collective."""

    index: int
    start: int
    end: int
    slots: list[ParamSlot]
    grad_view: torch.Tensor  # grad_data[start:end]
    param_view: torch.Tensor | None  # param_data[start:end] with the distributed optimizer
    num_shards: int
    reduce_group: object | None = None  # the ddp.ReduceGroup its gradients are reduced over
    ready: set[int] = field(default_factory=set)  # id(param) of gradients complete this step
    handle: object | None = None  # the async collective in flight
    launched: bool = False

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, shard_rank: int) -> tuple[int, int]:
        """``[start, end)`` of this rank's shard, relative to the bucket start."""
        size = self.numel // self.num_shards
        return shard_rank * size, (shard_rank + 1) * size

    @property
    def has_shared_embedding(self) -> bool:
        return any(param_layout(s.param).shared_embedding for s in self.slots)

    @property
    def all_ready(self) -> bool:
        return len(self.ready) == len(self.slots)

    def reset(self) -> None:
        self.ready.clear()
        self.handle = None
        self.launched = False


def accumulated_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient an optimizer, clipping or unscaling works on: ``param.main_grad`` where a
    ``GradBuffer`` accumulates in a wider dtype than the weights, else ``param.grad``."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class GradBuffer:
    """Flat gradient storage of every parameter of one dtype, split into buckets."""

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        *,
        bucket_size_numel: int,
        num_shards: int,
        with_param_buffer: bool,
        grad_dtype: torch.dtype | None = None,
        reduce_group=None,
    ) -> None:
        """``reduce_group`` (a ``ddp.ReduceGroup``, kept for the caller) names the ranks the
        buffer's gradients are reduced over; ``num_shards`` is its size."""
        if not named_params:
            raise ParallelError("GradBuffer needs at least one parameter that requires grad")
        dtypes = {p.dtype for _, p in named_params}
        devices = {p.device for _, p in named_params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ParallelError(
                f"one GradBuffer holds one dtype on one device, got dtypes {sorted(map(str, dtypes))} "
                f"on devices {sorted(map(str, devices))}; move the module to one device first"
            )
        self.param_dtype = dtypes.pop()
        self.dtype = grad_dtype if grad_dtype is not None else self.param_dtype  # of the gradients
        self.uses_main_grad = self.dtype != self.param_dtype
        self.device = devices.pop()
        self.num_shards = num_shards
        self.reduce_group = reduce_group
        # Padding only matters when buckets are sharded over ranks (the distributed optimizer).
        pad_multiple = num_shards * SHARD_ALIGNMENT if with_param_buffer else 1

        slots: list[ParamSlot] = []
        bucket_bounds: list[tuple[int, int, list[ParamSlot]]] = []
        offset = bucket_start = 0
        current: list[ParamSlot] = []
        for name, param in reversed(named_params):  # backward produces gradients last-to-first
            slot = ParamSlot(param, name, offset, offset + param.numel(), len(bucket_bounds))
            slots.append(slot)
            current.append(slot)
            offset += param.numel()
            if offset - bucket_start >= bucket_size_numel:
                offset = bucket_start + _round_up(offset - bucket_start, pad_multiple)
                bucket_bounds.append((bucket_start, offset, current))
                bucket_start, current = offset, []
        if current:
            offset = bucket_start + _round_up(offset - bucket_start, pad_multiple)
            bucket_bounds.append((bucket_start, offset, current))
        self.numel = offset
        self.slots = slots
        self.slot_of = {id(s.param): s for s in slots}

        self.grad_data = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self.param_data: torch.Tensor | None = None
        if with_param_buffer:
            # Parameters become views of one flat tensor so a rank's shard of the update can be
            # all-gathered straight into every parameter.
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=self.device)
            with torch.no_grad():
                for s in slots:
                    view = self.param_data[s.start : s.end].view_as(s.param)
                    view.copy_(s.param.data)
                    s.param.data = view
        self.buckets = [
            Bucket(
                index=i,
                start=start,
                end=end,
                slots=bucket_slots,
                grad_view=self.grad_data[start:end],
                param_view=None if self.param_data is None else self.param_data[start:end],
                num_shards=num_shards,
                reduce_group=reduce_group,
            )
            for i, (start, end, bucket_slots) in enumerate(bucket_bounds)
        ]
        self.attach_grads()

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        return self.grad_data[slot.start : slot.end].view_as(slot.param)

    def attach_grads(self) -> None:
        """Point every ``param.grad`` (``param.main_grad`` with a wider gradient dtype) at its
        slice of the buffer (again, if someone replaced it)."""
        for s in self.slots:
            if self.uses_main_grad:
                s.param.main_grad = self.grad_view(s)
                s.param.grad = None
            else:
                s.param.grad = self.grad_view(s)

    def grad_is_attached(self, slot: ParamSlot) -> bool:
        grad = slot.param.main_grad if self.uses_main_grad else slot.param.grad
        # the address compared by arithmetic: a slice would build a tensor per parameter and micro-batch
        expected = self.grad_data.data_ptr() + slot.start * self.grad_data.element_size()
        return grad is not None and grad.data_ptr() == expected

    def owned_ranges(self, shard_rank: int) -> list[tuple[ParamSlot, int, int]]:
        """This rank's part of every parameter: (slot, first, last) as flat indices into the
        parameter (``param.view(-1)[first:last]``), skipping parameters it owns nothing of."""
        owned = []
        for bucket in self.buckets:
            lo, hi = bucket.shard_range(shard_rank)
            lo += bucket.start
            hi += bucket.start
            for s in bucket.slots:
                first, last = max(s.start, lo), min(s.end, hi)
                if first < last:
                    owned.append((s, first - s.start, last - s.start))
        return owned
