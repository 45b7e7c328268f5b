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

Every bucket names this rank's shard of it twice, ``grad_shard`` and ``param_shard``: what the
distributed optimizer updates. Under ZeRO-1 they are views of the flat buffers. Under ZeRO-2
(``shard_grads``) there is no flat gradient buffer: each bucket's full gradient is a tensor of
its own, allocated when its first gradient of a micro-batch arrives and freed once it is
reduce-scattered into ``grad_shard``, a tensor of its own that accumulates the micro-batches.
Under ZeRO-3 (``shard_params``) each bucket's full parameters are likewise a tensor of their own
(the parameters' ``.data`` are views of it), allocated only while gathered, and ``param_shard``
is the only copy kept (``bucket_storage.py``). Under both, buckets also end where a layer
ends (``unit_of``), so a gather or a filling gradient never holds another layer's. A bucket with a
tied embedding shared across pipeline stages keeps full gradients and parameters (the pipeline
sums its whole gradient over the embedding group).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtl.core.errors import ParallelError
from mtl.parallel.ddp.bucket_storage import HeldBytes, free, new_held
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
    grad_view: torch.Tensor | None  # grad_data[start:end], or the bucket's own (ZeRO-2/3)
    param_view: torch.Tensor | None  # param_data[start:end] (or its own, ZeRO-3) with the distributed optimizer
    num_shards: int
    reduce_group: object | None = None  # the ddp.ReduceGroup its gradients are reduced over
    ready: set[int] = field(default_factory=set)  # id(param) of gradients complete this step
    handle: object | None = None  # the async collective in flight
    launched: bool = False
    grad_shard: torch.Tensor | None = None  # this rank's reduced gradient (distributed optimizer)
    param_shard: torch.Tensor | None = None  # this rank's parameters (distributed optimizer)
    shards_grads: bool = False  # ZeRO-2/3: grad_view allocated per micro-batch, freed after its reduce-scatter
    shards_params: bool = False  # ZeRO-3: param_view allocated only while gathered
    pending_shard: torch.Tensor | None = None  # ZeRO-2/3: the reduce-scatter's output in flight
    gather_handle: object | None = None  # ZeRO-3: the all-gather in flight into param_view

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
        shard_grads: bool = False,
        shard_params: bool = False,
        unit_of: dict[int, int] | None = None,
        held: HeldBytes | None = None,
    ) -> None:
        """``reduce_group`` (a ``ddp.ReduceGroup``, kept for the caller) names the ranks the
        buffer's gradients are reduced over; ``num_shards`` is its size. ``shard_grads`` and
        ``shard_params`` (ZeRO-2/3, with ``with_param_buffer``) are described above;
        ``unit_of`` maps ``id(param)`` to its gather unit; ``held`` counts the bytes allocated."""
        if (shard_grads or shard_params) and not with_param_buffer:
            raise ParallelError("GradBuffer(shard_grads/shard_params) needs with_param_buffer=True")
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
        self.shard_rank = reduce_group.rank if reduce_group is not None else 0
        self.held = held if held is not None else HeldBytes()
        # Padding only matters when buckets are sharded over ranks (the distributed optimizer).
        pad_multiple = num_shards * SHARD_ALIGNMENT if with_param_buffer else 1

        slots: list[ParamSlot] = []
        bucket_bounds: list[tuple[int, int, list[ParamSlot]]] = []
        offset = bucket_start = 0
        current: list[ParamSlot] = []
        unit = None
        for name, param in reversed(named_params):  # backward produces gradients last-to-first
            if unit_of is not None and current and unit_of.get(id(param)) != unit:  # one gather unit per bucket
                offset = bucket_start + _round_up(offset - bucket_start, pad_multiple)
                bucket_bounds.append((bucket_start, offset, current))
                bucket_start, current = offset, []
            unit = unit_of.get(id(param)) if unit_of is not None else None
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

        self.grad_data = None if shard_grads else new_held(self.numel, self.dtype, self.device, self.held)
        if not with_param_buffer:  # the parameters stay the module's own tensors: count them too
            self.held.add(sum(s.param.numel() for s in slots) * torch.empty((), dtype=self.param_dtype).element_size())
        self.param_data: torch.Tensor | None = None
        if with_param_buffer and not shard_params:
            # Parameters become views of one flat tensor so a rank's shard of the update can be
            # all-gathered straight into every parameter.
            self.param_data = new_held(self.numel, self.param_dtype, self.device, self.held)
            self._move_params_into(self.param_data, slots, 0)
        self.buckets = [self._bucket(i, start, end, bucket_slots, with_param_buffer)
                        for i, (start, end, bucket_slots) in enumerate(bucket_bounds)]
        self.attach_grads()

    @staticmethod
    @torch.no_grad()
    def _move_params_into(storage: torch.Tensor, slots: list[ParamSlot], base: int) -> None:
        for s in slots:
            view = storage[s.start - base : s.end - base].view_as(s.param)
            view.copy_(s.param.data)
            s.param.data = view

    def _bucket(self, index: int, start: int, end: int, slots: list[ParamSlot], sharded: bool) -> Bucket:
        bucket = Bucket(index=index, start=start, end=end, slots=slots, grad_view=None, param_view=None,
                        num_shards=self.num_shards, reduce_group=self.reduce_group)
        shared = bucket.has_shared_embedding
        bucket.shards_grads = self.grad_data is None and not shared
        bucket.shards_params = self.param_data is None and sharded and not shared
        lo, hi = bucket.shard_range(self.shard_rank)
        if self.grad_data is not None:
            bucket.grad_view = self.grad_data[start:end]
        else:  # ZeRO-2/3: the bucket's own full gradient, held only while its micro-batch's backward fills it
            bucket.grad_view = new_held(end - start, self.dtype, self.device, self.held)
            if bucket.shards_grads:
                free(bucket.grad_view, self.held)
        if self.param_data is not None:
            bucket.param_view = self.param_data[start:end]
        elif sharded:  # ZeRO-3: gathered until DataParallel has broadcast them and kept its shard
            bucket.param_view = new_held(end - start, self.param_dtype, self.device, self.held)
            self._move_params_into(bucket.param_view, slots, start)
        if sharded:
            bucket.grad_shard = (new_held(hi - lo, self.dtype, self.device, self.held) if bucket.shards_grads
                                 else bucket.grad_view[lo:hi])
            bucket.param_shard = bucket.param_view[lo:hi]
        return bucket

    @torch.no_grad()
    def keep_param_shards_only(self) -> None:
        """ZeRO-3: copy this rank's shard of every bucket's parameters out and free the rest."""
        for bucket in self.buckets:
            if bucket.shards_params:
                lo, hi = bucket.shard_range(self.shard_rank)
                bucket.param_shard = new_held(hi - lo, self.param_dtype, self.device, self.held)
                bucket.param_shard.copy_(bucket.param_view[lo:hi])
                free(bucket.param_view, self.held)

    def param_storages(self) -> list[torch.Tensor]:
        """The flat tensors holding every parameter (broadcast at the start)."""
        return [self.param_data] if self.param_data is not None else [b.param_view for b in self.buckets]

    def zero_grads(self) -> None:
        """Zero every gradient this buffer keeps (ZeRO-2/3: the shards; full gradients are freed)."""
        if self.grad_data is not None:
            self.grad_data.zero_()
        for bucket in self.buckets:
            if bucket.shards_grads:
                bucket.pending_shard = None
                free(bucket.grad_view, self.held)
                bucket.grad_shard.zero_()
            elif self.grad_data is None:
                bucket.grad_view.zero_()
        self.attach_grads()

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        bucket = self.buckets[slot.bucket_index]
        return bucket.grad_view[slot.start - bucket.start : slot.end - bucket.start].view_as(slot.param)

    def attach_grads(self) -> None:
        """Point every ``param.grad`` (``param.main_grad`` with a wider gradient dtype) at its
        slice of the buffer (again, if someone replaced it). Not under ZeRO-2/3: there each
        micro-batch's ``param.grad`` is added into the bucket by ``DataParallel`` and dropped."""
        for s in self.slots:
            if self.buckets[s.bucket_index].shards_grads:
                continue
            if self.uses_main_grad:
                s.param.main_grad = self.grad_view(s)
                s.param.grad = None
            else:
                s.param.grad = self.grad_view(s)

    def grad_is_attached(self, slot: ParamSlot) -> bool:
        grad = slot.param.main_grad if self.uses_main_grad else slot.param.grad
        bucket = self.buckets[slot.bucket_index]
        # the address compared by arithmetic: a slice would build a tensor per parameter and micro-batch
        expected = bucket.grad_view.data_ptr() + (slot.start - bucket.start) * bucket.grad_view.element_size()
        return grad is not None and grad.data_ptr() == expected

    def mark_owned_grad_ranges(self) -> None:
        """``param.dp_owned_grad_range``: each parameter's range of this rank's shard ((0, 0):
        none), the distributed optimizer's view of the buffer."""
        for slot in self.slots:
            slot.param.dp_owned_grad_range = (0, 0)
        for slot, first, last in self.owned_ranges(self.reduce_group.rank):
            slot.param.dp_owned_grad_range = (first, last)

    def owned_ranges(self, shard_rank: int) -> list[tuple[ParamSlot, int, int]]:
        """This rank's part of every parameter: (slot, first, last) as flat indices into the
        parameter (``param.view(-1)[first:last]``), skipping parameters it owns nothing of."""
        return [(slot, first, last) for slot, first, last, _, _ in self.owned_pieces(shard_rank)]

    def owned_pieces(self, shard_rank: int) -> list[tuple[ParamSlot, int, int, Bucket, int]]:
        """``owned_ranges`` with each piece's bucket and its offset in the bucket's shard
        (``bucket.grad_shard[at:at + last - first]`` is the piece's reduced gradient)."""
        owned = []
        for bucket in self.buckets:
            lo, hi = bucket.shard_range(shard_rank)
            lo += bucket.start
            hi += bucket.start
            for s in bucket.slots:
                first, last = max(s.start, lo), min(s.end, hi)
                if first < last:
                    owned.append((s, first - s.start, last - s.start, bucket, first - lo))
        return owned
