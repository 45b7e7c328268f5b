"""How a parameter is laid out across ranks: one frozen record per parameter.

The module that creates a parameter knows how it is split (a column-parallel weight over TP on
dim 0, an expert tensor over EP on dim 0, a padded vocabulary table); the code that later
shards checkpoints, reduces gradients or counts norms needs exactly that knowledge. Each
parameter carries it as one ``ParamLayout``, written through ``set_param_layout`` and read
through ``param_layout``, which gives the default (replicated everywhere) for a parameter
nobody annotated, e.g. a third party's module or a backend's replicated state.

Fields (all optional; a parameter sets only what applies to it):

- ``tp_split_dim``: the dimension split over tensor-parallel ranks, each holding an equal
  contiguous slice; None when every TP rank holds the whole tensor.
- ``tp_stride``: a split dimension of ``stride * n_local`` rows fusing ``stride`` parts, each
  split over TP on its own (SwiGLU's fc1 ``[gate_local; up_local]``: stride 2).
- ``expert_split_dim``: the dimension split over expert-parallel ranks (each holds its block of
  experts); its gradients reduce over the expert-data-parallel group.
- ``vocab_rows``: a vocabulary table padded for TP; rows at or past ``vocab_rows`` (global)
  are padding, invisible to checkpoints, initialization and exports.
- ``shared_embedding``: a copy of the word embedding held on more than one pipeline stage
  (the tied output layer); its gradients are summed over the stages holding it.
- ``tied_global_name``: the global name of the parameter this one is a stage's copy of.
- ``sequence_parallel_grad``: replicated over TP but each rank's gradient covers only its own
  tokens under sequence parallelism; summed over TP once per step
  (``mtl.parallel.sequence_parallel_grads``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mtl.core.errors import ParallelError

_ATTRIBUTE = "mtl_layout"  # the one attribute a parameter carries for its layout


@dataclass(frozen=True)
class ParamLayout:
    tp_split_dim: int | None = None
    tp_stride: int = 1
    expert_split_dim: int | None = None
    vocab_rows: int | None = None
    shared_embedding: bool = False
    tied_global_name: str | None = None
    sequence_parallel_grad: bool = False

    def __post_init__(self) -> None:
        if self.tp_stride < 1:
            raise ParallelError(f"ParamLayout: tp_stride = {self.tp_stride} must be at least 1")
        if self.tp_stride != 1 and self.tp_split_dim is None:
            raise ParallelError(f"ParamLayout: tp_stride = {self.tp_stride} needs a tp_split_dim to apply to")


REPLICATED = ParamLayout()  # the layout of a parameter nobody annotated


def param_layout(param: torch.Tensor) -> ParamLayout:
    """``param``'s layout record, or ``REPLICATED`` where no module annotated it."""
    return getattr(param, _ATTRIBUTE, REPLICATED)


def set_param_layout(param: torch.Tensor | None, **fields) -> None:
    """Record ``fields`` (names of ``ParamLayout``) in ``param``'s layout, keeping the fields
    set before (the module that splits a weight over TP and the model that ties it each say
    their part). ``None`` (a layer without bias) is left alone."""
    if param is None:
        return
    setattr(param, _ATTRIBUTE, replace(param_layout(param), **fields))
