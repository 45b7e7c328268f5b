"""The FP8 copy of a weight, quantized once per optimizer step instead of once per micro-batch.

A weight changes only at the optimizer step, yet every micro-batch of gradient accumulation
took its amax, quantized it and (in the backward) transposed the FP8 copy. ``WeightCache``
keeps both FP8 operands (the forward's and the input-gradient GEMM's) and their scales, and
refreshes them on the first call after the weight may have changed (Transformer Engine's
"first micro-batch" weight cache, but without the trainer telling the layer which micro-batch
is the first).

When is a cache stale? Not ``weight._version``: mtl's optimizers write the updated weights
through other tensors sharing the storage (the gradient buffer's flat ``param_data``, or
``param.data``), which do not bump the parameter's version counter, and dynamo cannot branch
on it without a graph break. Instead every cache is marked stale by

- every torch optimizer step (``register_optimizer_step_pre_hook``, process-wide: the FP8
  copies are freed before the update runs); the update and whatever follows it (main -> model
  copy, the distributed optimizer's all-gather) happen before the next forward, which refreshes;
- ``load_state_dict`` on the layer or a module holding it, and ``module.to(...)`` (the
  layer's hooks);
- outside torch.compile, also a change of the weight's version counter or storage (an
  in-place edit under ``no_grad``, ``param.data = ...``);
- ``invalidate_weight_caches()``: for a write that none of these sees, e.g. a checkpoint
  loaded straight into ``param.data`` in a process whose model already ran forwards (mtl's
  resume loads before the first forward, so it needs nothing).

Under torch.compile the refresh is a Python branch on ``cache.stale``: dynamo guards on the
flag and compiles two variants of the layer (refresh, reuse), both without graph breaks and
without a recompile per call or per step.

Under ``train.cuda_graphs`` the layer's captured forward reads the cached tensors' addresses
and runs no Python, so the cache is switched to ``keep_in_place()``: marking it stale keeps the
tensors, and the refresh (``before_graph_replay`` of the layer, before each replay) writes the
new FP8 copy into them.

Inside ``weight_caching(False)`` layers are built without the cache: the tests compare the
two paths through it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_caching = True  # changed only by ``weight_caching``


def caching_enabled() -> bool:
    """Read when a layer is built: whether its FP8 weight gets a cache."""
    return _caching


@contextlib.contextmanager
def weight_caching(enabled: bool):
    """Layers built inside get the cache (``enabled``) or quantize their weight on every call."""
    global _caching
    previous, _caching = _caching, enabled
    try:
        yield
    finally:
        _caching = previous


@dataclass
class QuantizedWeight:
    """A weight W ``[N, K]`` in FP8 for both GEMMs that read it: ``forward`` (q ``[N, K]``,
    scale) for ``y = x Wᵀ`` and ``backward`` (q ``[K, N]``, scale) for ``dx = dy W``."""

    forward: tuple[torch.Tensor, torch.Tensor]
    backward: tuple[torch.Tensor, torch.Tensor]


class WeightCache:
    """One layer's ``QuantizedWeight``, rebuilt by ``get`` when stale (see the module docstring)."""

    def __init__(self) -> None:
        self.stale = True
        self.value: QuantizedWeight | None = None
        self._key: tuple | None = None  # eager only: (version, storage) the value was built from
        self.in_place = False  # refresh into the same tensors (a captured CUDA graph reads them)
        _CACHES.add(self)

    def keep_in_place(self) -> None:
        """From now on keep the FP8 tensors and refresh them in place (see the module docstring)."""
        self.in_place = True

    def invalidate(self) -> None:
        """Mark the FP8 copy stale; its memory is freed until the next forward rebuilds it,
        unless the cache refreshes in place."""
        self.stale = True
        if not self.in_place:
            self.value = None

    def get(self, weight: torch.Tensor, quantize: Callable[[torch.Tensor], QuantizedWeight]) -> QuantizedWeight:
        """The cached FP8 weight, rebuilt with ``quantize(weight.detach())`` when stale. Every
        rank of a TP group calls this at the same calls, so a refresh's amax all-reduce is
        joined by all of them."""
        if not torch.compiler.is_compiling():  # dynamo would graph-break on these; eager checks them too
            if torch.is_inference_mode_enabled():  # its tensors cannot be saved for a later backward
                return quantize(weight.detach())
            key = (weight._version, weight.data_ptr(), weight.dtype, weight.device)
            if key != self._key:
                self._key, self.stale = key, True
        if self.stale:
            fresh = quantize(weight.detach())
            if self.in_place and self.value is not None:
                _copy_into(self.value, fresh)
            else:
                self.value = fresh
            self.stale = False
        return self.value


def _copy_into(target: QuantizedWeight, source: QuantizedWeight) -> None:
    for (q, scale), (new_q, new_scale) in ((target.forward, source.forward), (target.backward, source.backward)):
        q.copy_(new_q)
        scale.copy_(new_scale)


_CACHES: weakref.WeakSet[WeightCache] = weakref.WeakSet()


def invalidate_weight_caches() -> None:
    """Mark every FP8 weight cache of this process stale: the next forward re-quantizes."""
    for cache in list(_CACHES):
        cache.invalidate()


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    # The optimizer updates fp32 main copies or flat buffers, never recognisably "this weight":
    # all caches go stale (one extra refresh for a model another optimizer does not touch).
    invalidate_weight_caches()


# Before the step, not after: the refresh happens only in a forward, which comes after the
# update either way, and the FP8 copies are not held through the optimizer's own memory peak.
_STEP_HOOK = register_optimizer_step_pre_hook(_before_optimizer_step)
