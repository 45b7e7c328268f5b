"""Keep the word embedding (first stage) and the tied output weight (last stage) equal.

With pp > 1 the two copies of a tied weight live on different ranks. Both start equal; summing
their gradients over the ``embedding`` group (first and last stage of each pipeline) gives
both the full gradient of the shared weight, so identical optimizer steps keep them equal.
"""

from __future__ import annotations

from torch import nn

from mtl.parallel.flat_collectives import sum_param_grads
from mtl.parallel.param_layout import param_layout


def shared_embedding_params(model_chunks: list[nn.Module]) -> list[nn.Parameter]:
    """Parameters flagged ``param.shared_embedding = True``, in chunk then registration order."""
    return [p for chunk in model_chunks for p in chunk.parameters() if param_layout(p).shared_embedding]


def allreduce_shared_embedding_grads(model_chunks: list[nn.Module], topology) -> None:
    """Sum the gradients of flagged parameters over ``topology.group("embedding")``.

    A no-op with pp = 1 (the weight is one tensor) and on ranks outside the group. The
    first and last stage must flag matching parameters in the same order. A data-parallel
    wrapper's ``main_grad`` is reduced when present, else ``.grad``; a flagged parameter that
    received no gradient takes part with zeros."""
    group = topology.group("embedding")
    if topology.pp == 1 or group is None:
        return
    params = shared_embedding_params(model_chunks)
    if not params:
        return
    sum_param_grads(params, group)
