"""Where each rank's parameter shard sits inside the layout-independent global tensor.

The global tensor of a parameter is the same whatever the TP degree; each rank holds one
contiguous box of it. Checkpoints, the HF converters and the initializer all use this map,
computed from each parameter's ``ParamLayout`` record (``mtl.parallel.param_layout``):

- a TP parameter's record has a ``tp_split_dim``; its box is ``tp_rank``'s equal slice of it;
- fused QKV rows are ordered group-major (``[g0: its q heads, k, v][g1: ...]``), so a split
  over query groups is already a contiguous slice of dim 0;
- a fused SwiGLU fc1 (recorded ``tp_stride = 2``) holds ``[gate_local; up_local]``, i.e.
  ``[2 * ffn_local, h]``; it is presented as ``[2, ffn, h]`` split on dim 1, so that its
  global tensor does not depend on TP (in general: dim ``tp_split_dim`` of size
  ``stride * n_local`` is presented as ``[stride, n_local]``, split on the second);
- an expert tensor (recorded ``expert_split_dim = 0``, ``mtl.models.moe.experts``) holds the
  ``E / ep`` experts of this rank's ``topology.ep_rank``: its box on dim 0 starts at
  ``ep_rank * E / ep`` of the global ``[E, ...]`` tensor (inside each expert, TP splits as above);
- a weight that is a pipeline stage's copy of another stage's parameter (a last-stage output
  weight tied to the word embedding) names that parameter in its ``tied_global_name`` and is
  listed under it: the same global tensor, whatever the family calls either module;
- a vocabulary table (the word embedding, the output layer) recorded with ``vocab_rows``
  is padded to a multiple of 128·tp rows so every TP rank holds an equal slice, but its
  global tensor has only the true vocabulary's ``vocab_rows`` rows: a rank's box is the part
  of its slice below that row (empty on a rank holding only padding). The padding is thus
  invisible to checkpoints, exports and initialization, and one global tensor serves every tp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mtl.core.errors import ParallelError
from mtl.parallel.param_layout import param_layout, set_param_layout

WORD_EMBEDDING = "embedding.word_embeddings.weight"  # gpt's word embedding (its tied output's global name)

Layout = dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]


def mark_vocab_rows(param: nn.Parameter, vocab_size: int) -> None:
    """Record a vocabulary-split table: rows at or past ``vocab_size`` (global) are padding."""
    set_param_layout(param, vocab_rows=vocab_size)


def mark_tied_copy(first_stage_param: nn.Parameter | None, last_stage_param: nn.Parameter | None,
                   global_name: str) -> None:
    """Record a tied table split over pipeline stages: each stage's copy (``None`` where this
    stage holds no copy) is summed with the other's by the pipeline, and the last stage's is
    listed under the first's global name (one global tensor in checkpoints)."""
    set_param_layout(first_stage_param, shared_embedding=True)
    set_param_layout(last_stage_param, shared_embedding=True, tied_global_name=global_name)


@dataclass(frozen=True)
class ParamEntry:
    """Where one parameter of this rank sits in its layout-independent global tensor."""

    global_name: str
    name: str  # the local name (differs only for a last-stage output weight tied to the embedding)
    param: nn.Parameter
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's box of the global tensor in ``tensor`` (the parameter's data, its
        gradient, or optimizer state of its shape): reshaped to the global tensor's rank and
        cut to the rows below the true vocabulary; writing the view writes ``tensor``."""
        local = _global_view(self.name, self.param, tensor)
        rows = self.valid_rows
        return local if rows is None else local[:rows]

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The parameter's shape with the global tensor's rank, padding rows included."""
        return tuple(_global_view(self.name, self.param, self.param.data).shape)

    @property
    def valid_rows(self) -> int | None:
        """How many leading rows of ``local_shape`` belong to the global tensor (None: all)."""
        return _valid_rows(self.param, self.local_shape[0], self.global_offset[0]) if self.local_shape else None

    @property
    def is_tied_copy(self) -> bool:
        return self.global_name != self.name


def global_layout(model: nn.Module, topology) -> Layout:
    """``{global name: (local_view, global_shape, global_offset)}`` for every parameter of
    ``model`` on this rank; ``local_view`` shares storage with the parameter (writing it
    writes the parameter) and has the rank of the global tensor."""
    return {e.global_name: (e.view(e.param.data), e.global_shape, e.global_offset)
            for e in parameter_entries(model, topology)}


def parameter_entries(model: nn.Module, topology) -> list[ParamEntry]:
    """One ``ParamEntry`` per parameter of ``model`` on this rank, in module order."""
    tp, tp_rank = topology.tp, topology.tp_rank
    ep, ep_rank = getattr(topology, "ep", 1), getattr(topology, "ep_rank", 0)
    seen: dict[str, str] = {}
    entries = []
    for name, param in model.named_parameters():
        local = _global_view(name, param, param.data)
        split_dim = _split_dim(param)
        global_shape = list(local.shape)
        global_offset = [0] * local.dim()
        if split_dim is not None and tp > 1:
            global_shape[split_dim] = local.shape[split_dim] * tp
            global_offset[split_dim] = local.shape[split_dim] * tp_rank
        layout = param_layout(param)
        expert_dim = layout.expert_split_dim
        if expert_dim is not None and ep > 1:
            global_shape[expert_dim] = local.shape[expert_dim] * ep
            global_offset[expert_dim] = local.shape[expert_dim] * ep_rank
        vocab_rows = layout.vocab_rows
        if vocab_rows is not None:
            if split_dim not in (0, None) or vocab_rows > global_shape[0]:
                raise ParallelError(
                    f"parameter {name}: vocab_rows = {vocab_rows} needs a table split on dim 0 with at "
                    f"least that many rows (it has {global_shape[0]})"
                )
            global_shape[0] = vocab_rows
            global_offset[0] = min(global_offset[0], vocab_rows)
        global_name = layout.tied_global_name or name
        if global_name in seen:
            raise ParallelError(f"parameters {seen[global_name]} and {name} map to one global tensor {global_name}")
        seen[global_name] = name
        entries.append(ParamEntry(global_name, name, param, tuple(global_shape), tuple(global_offset)))
    return entries


def _valid_rows(param: torch.Tensor, local_rows: int, row_offset: int) -> int | None:
    """How many of this rank's rows of a vocabulary table are real (None: not a vocab table)."""
    vocab_rows = param_layout(param).vocab_rows
    if vocab_rows is None:
        return None
    return max(0, min(local_rows, vocab_rows - row_offset))


def _split_dim(param: torch.Tensor) -> int | None:
    """The TP-split dimension in the global view (the second of a strided dim's two)."""
    layout = param_layout(param)
    return layout.tp_split_dim + 1 if layout.tp_stride != 1 else layout.tp_split_dim


def _global_view(name: str, param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (shaped like the parameter) with the rank of the global tensor."""
    layout = param_layout(param)
    stride, dim = layout.tp_stride, layout.tp_split_dim
    if stride == 1:
        return tensor
    expert_dim = layout.expert_split_dim
    if dim is None or tensor.shape[dim] % stride or (expert_dim is not None and expert_dim > dim):
        raise ParallelError(
            f"parameter {name}: tp_stride = {stride} needs a tp_split_dim (have {dim}) whose size is "
            "divisible by the stride, after any expert_split_dim"
        )
    # [..., stride * n_local, ...] -> [..., stride, n_local, ...]; TP splits the second
    shape = tensor.shape
    return tensor.view(*shape[:dim], stride, shape[dim] // stride, *shape[dim + 1:])


def box(global_tensor: torch.Tensor, local_shape: torch.Size, global_offset: tuple[int, ...]) -> torch.Tensor:
    """The slice of ``global_tensor`` that a rank with this shape and offset holds."""
    index = tuple(slice(o, o + n) for o, n in zip(global_offset, local_shape))
    return global_tensor[index]


def load_global_state(model: nn.Module, topology, state: dict[str, torch.Tensor]) -> None:
    """Copy each rank's box of full global tensors (e.g. from an HF converter) into ``model``.

    Every parameter must be present with its global shape; extra names are refused too, so a
    mismatch between a converter and the model's layout cannot pass silently."""
    layout = global_layout(model, topology)
    missing = sorted(set(layout) - set(state))
    unexpected = sorted(set(state) - set(layout))
    if missing or unexpected:
        raise ParallelError(
            f"state does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            " (was it converted for another model config?)"
        )
    with torch.no_grad():
        for name, (local, global_shape, global_offset) in layout.items():
            full = state[name]
            if tuple(full.shape) != global_shape:
                raise ParallelError(
                    f"{name}: state has shape {tuple(full.shape)}, the model expects {global_shape}"
                )
            local.copy_(box(full, local.shape, global_offset))


def gather_global_state(model: nn.Module, topology, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The full global tensors of ``model``'s parameters (or, with ``grads``, of their
    gradients), assembled from every TP rank and, for expert tensors, every EP rank: a
    collective over the TP and EP groups; for a single process, a copy. Used by tests and
    exporters."""
    group = topology.tp_group
    state = {}
    for entry in parameter_entries(model, topology):
        if grads and not entry.param.requires_grad:  # a backend's state (an FP8 amax history)
            continue
        # bf16/fp16 weights accumulate their gradients in fp32 ``main_grad`` (DataParallel)
        grad = getattr(entry.param, "main_grad", None)
        grad = grad if grad is not None else entry.param.grad
        source = grad if grads else entry.param.data
        if source is None:
            raise ParallelError(f"parameter {entry.name} has no gradient; run backward first")
        source = source.detach()
        if group is None or _split_dim(entry.param) is None:
            full = entry.view(source).clone()
        else:
            # gather whole slices (padding included: every rank's is the same size), then cut
            local = _global_view(entry.name, entry.param, source).contiguous()
            full = _all_gather_cat(local, _split_dim(entry.param), topology.tp, group)
            full = full[: entry.global_shape[0]] if param_layout(entry.param).vocab_rows is not None else full
        expert_dim = param_layout(entry.param).expert_split_dim
        ep_group = topology.group("ep") if expert_dim is not None and getattr(topology, "ep", 1) > 1 else None
        if ep_group is not None:  # each EP rank holds its own experts
            full = _all_gather_cat(full.contiguous(), expert_dim, topology.ep, ep_group)
        state[entry.global_name] = full
    return state


def _all_gather_cat(local: torch.Tensor, dim: int, size: int, group) -> torch.Tensor:
    import torch.distributed as dist

    pieces = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(pieces, local, group=group)
    return torch.cat(pieces, dim=dim)
