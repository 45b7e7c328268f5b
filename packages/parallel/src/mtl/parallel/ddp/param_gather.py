"""ZeRO-3 (``sharding = "parameters"``): parameters gathered per unit just before use.

The model's gather units (``mtl.core.model_protocol.gather_units_of``: GPT's embedding, its
transformer layers and final norm, its output layer; a model without the methods has none) are
gathered one at a time, and one root unit holds every parameter outside them. Each unit's
parameters sit in buckets of their own (``GradBuffer(unit_of=...)``):

- forward pre-hook of unit i: wait for its all-gather (or run it), then launch unit i+1's;
- forward post-hook: free unit i's full parameters (not while backward recomputes it, nor the
  last unit's when a backward will follow: without pipelining and on 1F1B's last stage that
  backward comes next, and freeing the head would only gather it again at once; elsewhere it
  stays whole until its backward, one unit's weights);
- when the first gradient of unit i's output arrives: gather it again, launch unit i-1's;
- once a bucket's gradients all arrived (``DataParallel``): free its parameters again.

A parameter in two units (an output layer tied to the embedding: the first and the last use of
one table) has its buckets in the first; the later unit gathers them too, and frees them once
its backward has produced its inputs' gradients, before the first unit's backward gathers them
again (their gradient, the sum of both uses, arrives only after that one).

The output layer under the fused loss (``linear_cross_entropy.py``) is not called as a module:
its forward hooks here are flagged ``WEIGHTS_ONLY_HOOK`` so that the fused path runs them on the
loss instead of falling back to whole logits.

The root unit is gathered by the model's forward pre-hook and kept until ``release_all``
(the end of the step's gradient sync, or ``zero_grad``). All-gathers run over each bucket's
shard group, in the same order on every rank (autograd's order is the same on every
data-parallel replica).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from mtl.parallel.ddp import sharded_grads
from mtl.parallel.ddp.bucket_storage import HeldBytes, allocate, free, is_allocated
from mtl.parallel.ddp.grad_buffer import Bucket
from mtl.core.model_protocol import gather_units_of
from mtl.parallel.flat_collectives import all_gather_flat
from mtl.parallel.tensor_parallel.linear_cross_entropy import WEIGHTS_ONLY_HOOK

ROOT = -1  # the unit of every parameter outside the model's layers


def gather_units(module: nn.Module) -> tuple[list[nn.Module], dict[int, int]]:
    """(the unit modules in forward order, ``id(param)`` -> unit index) with ``ROOT`` for the
    rest; a parameter in several units (a tied table) belongs to the first."""
    units = gather_units_of(module)
    unit_of = {id(p): ROOT for p in module.parameters()}
    for index, unit in reversed(list(enumerate(units))):
        for param in unit.parameters():
            unit_of[id(param)] = index
    return units, unit_of


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class LayerGather:
    """The hooks and the gather/free bookkeeping of one ``DataParallel``'s ZeRO-3 buckets."""

    def __init__(self, module: nn.Module, units: list[nn.Module], unit_of: dict[int, int],
                 buckets: list[Bucket], held: HeldBytes) -> None:
        self.held = held
        self.num_units = len(units)
        self.buckets_of: dict[int, list[Bucket]] = {}
        self._unit_of_bucket: dict[int, int] = {}
        bucket_of_param = {}
        for bucket in buckets:
            if bucket.shards_params:
                unit = unit_of[id(bucket.slots[0].param)]
                self.buckets_of.setdefault(unit, []).append(bucket)
                self._unit_of_bucket[id(bucket)] = unit
                bucket_of_param.update((id(slot.param), bucket) for slot in bucket.slots)
        # units that also use an earlier unit's parameter (a tied output layer): they gather its
        # buckets as well, and free them after their own backward
        self.borrowing_units: set[int] = set()
        for index, unit in enumerate(units):
            for param in unit.parameters():
                bucket = bucket_of_param.get(id(param))
                if bucket is not None and unit_of[id(param)] != index and \
                        all(bucket is not b for b in self.buckets_of.setdefault(index, [])):
                    self.buckets_of[index].append(bucket)
                    self.borrowing_units.add(index)
        self.num_gathers = 0  # all-gathers launched since construction; tests read it
        self.handles = [module.register_forward_pre_hook(lambda _m, _a: self.gather(ROOT))]
        for index, unit in enumerate(units):
            self.handles.append(unit.register_forward_pre_hook(self._pre_forward(index)))
            self.handles.append(unit.register_forward_hook(self._post_forward(index)))

    def unit_of_bucket(self, bucket: Bucket) -> int:
        return self._unit_of_bucket[id(bucket)]

    # ---- hooks -------------------------------------------------------------------------
    def _pre_forward(self, index: int):
        @torch._dynamo.disable
        def hook(_module, _args):
            self.gather(index)
            if not _in_backward():  # a recompute in backward runs backward's order instead
                self.gather(index + 1, wait=False)
        return hook

    def _post_forward(self, index: int):
        @torch._dynamo.disable
        def hook(_module, args, output):
            if _in_backward():  # recompute: the backward that follows needs the weights
                return output
            needing_grad = [t for t in _tensors(output) if t.requires_grad]
            if not (needing_grad and index == self.num_units - 1):  # the last unit: see the module docstring
                self.release(index)
            if needing_grad:
                torch.autograd.graph.register_multi_grad_hook(
                    needing_grad, lambda _grads: self._pre_backward(index), mode="any")
            inputs_needing_grad = [t for t in _tensors(args) if t.requires_grad]
            if index in self.borrowing_units and inputs_needing_grad:
                # the inputs' gradients exist once this unit's backward ran: the borrowed weights
                # are not needed again until the unit owning them runs its backward
                torch.autograd.graph.register_multi_grad_hook(
                    inputs_needing_grad, lambda _grads: self.release(index), mode="all")
            return output
        setattr(hook, WEIGHTS_ONLY_HOOK, True)  # reads the output only for its gradient: the fused loss may pass the loss
        return hook

    @torch._dynamo.disable
    def _pre_backward(self, index: int) -> None:
        self.gather(index)
        self.gather(index - 1, wait=False)

    # ---- gather and free ---------------------------------------------------------------
    # Under train.compile the hooks run in the compiled layer's call: never traced (a storage
    # resize and an async collective are eager work), so the layer's body stays one graph.
    @torch._dynamo.disable
    @torch.no_grad()
    def gather(self, unit: int, wait: bool = True) -> None:
        """All-gather ``unit``'s buckets unless gathered or gathering; ``wait``: until done."""
        if unit != ROOT and not 0 <= unit < self.num_units:
            return
        for bucket in self.buckets_of.get(unit, []):
            if not is_allocated(bucket.param_view):
                allocate(bucket.param_view, self.held)
                self.num_gathers += 1
                group = bucket.reduce_group.group
                if group is None:
                    bucket.param_view.copy_(bucket.param_shard)
                else:
                    bucket.gather_handle = all_gather_flat(bucket.param_view, bucket.param_shard, group=group,
                                                           async_op=True)
            if wait and bucket.gather_handle is not None:
                bucket.gather_handle.wait()
                bucket.gather_handle = None

    @torch._dynamo.disable
    def release(self, unit: int) -> None:
        for bucket in self.buckets_of.get(unit, []):
            self.release_bucket(bucket)

    def release_bucket(self, bucket: Bucket) -> None:
        """Free a bucket's full parameters (after waiting for a gather still in flight)."""
        if bucket.gather_handle is not None:
            bucket.gather_handle.wait()
            bucket.gather_handle = None
        free(bucket.param_view, self.held)

    def release_all(self) -> None:
        for unit in list(self.buckets_of):
            self.release(unit)

    @contextlib.contextmanager
    def all_gathered(self, write_back: bool):
        """Every parameter whole for the block's duration (a checkpoint's save or load); with
        ``write_back`` each bucket's shard is then refreshed from what the block left there."""
        for unit in self.buckets_of:
            self.gather(unit)
        try:
            yield
        finally:
            # each bucket once: a tied table's is in two units
            unique = {id(bucket): bucket for buckets in self.buckets_of.values() for bucket in buckets}
            for bucket in unique.values():
                if write_back:
                    lo, hi = bucket.shard_range(bucket.reduce_group.rank)
                    with torch.no_grad():
                        bucket.param_shard.copy_(bucket.param_view[lo:hi])
                self.release_bucket(bucket)


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []


def register_wait_hooks(module: nn.Module, buckets: list[Bucket], wait) -> list:
    """``parallel.overlap_param_gather`` (ZeRO-1/2): a forward pre-hook on each submodule that
    directly owns parameters in ``buckets`` calls ``wait(index)`` for the buckets holding them
    (a module's parameters may span several buckets, a bucket several modules).

    The optimizer's step launches one all-gather per bucket and returns. Buckets follow the
    reverse parameter order, so the first layers' buckets are the last ones: they are launched
    first, and the gathers of later layers' buckets run while the first layers compute. A
    handle is waited once and then dropped: later forwards of the same step (micro-batches,
    recompute) do not wait again."""
    bucket_of = {id(slot.param): index for index, bucket in enumerate(buckets) for slot in bucket.slots}
    handles = []
    for submodule in module.modules():
        indices = sorted({bucket_of[id(p)] for p in submodule.parameters(recurse=False) if id(p) in bucket_of})
        if not indices:
            continue

        def pre_hook(_module, _args, indices=tuple(indices)):
            for index in indices:
                wait(index)

        handles.append(submodule.register_forward_pre_hook(pre_hook))
    return handles


def shard_buffers(module: nn.Module, sharding: str, units, unit_of, buffers, buckets: list[Bucket],
                  held_bytes: HeldBytes) -> LayerGather | None:
    """ZeRO-2/3 on built buffers: keep only this rank's shards; under "parameters" also the
    per-layer gather hooks, which it returns (None otherwise)."""
    layer_gather = None
    if sharding == "parameters":
        for buf in buffers:
            buf.keep_param_shards_only()
        layer_gather = LayerGather(module, units, unit_of, buckets, held_bytes)
    if sharding in ("gradients", "parameters"):
        sharded_grads.attach_owned_grads(buffers)
    return layer_gather
