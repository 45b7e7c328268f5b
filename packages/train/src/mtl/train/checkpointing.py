"""Training state <-> sharded checkpoints (mtl.ckpt): what is saved and loaded.

Every tensor is stored in its layout-independent global shape (``mtl.models.param_layout``):
model parameters and both AdamW moments alike, so a checkpoint saved at any (tp, pp, vpp, cp,
dp, distributed optimizer on or off) resumes at any other valid layout, each rank reading only
the slices it holds. Vocabulary padding is not stored. Each tensor is written once: the
data/context-parallel replicas take turns by parameter (so all of them write), TP replicas and
tied copies leave it to the owner. Experts are global tensors ``[num_experts, ...]`` of which
each expert-parallel rank holds its block, written by one of the ranks holding it, so a save at
one ep loads at any other. Iteration, data position, loss scale, the resolved config and
versions go to the metadata. RNG states are stored per rank and restored where the layout and
device type match (elsewhere re-derived from the seed and iteration), and so are modules' extra
states (``extra_state.py``: Transformer Engine's FP8 amax histories; elsewhere they start
afresh); ``layout_change.py`` says where the layout matches. Which checkpoint and iteration a
run starts from, and what it checks first, is ``resume.py``."""

from __future__ import annotations

import contextlib

import importlib.metadata
from typing import Any

import torch

from mtl.ckpt import latest_iteration, read_metadata
from mtl.ckpt.flat_range import flat_range_shards
from mtl.ckpt.sharded import ShardedTensor
from mtl.core.config import RunConfig
from mtl.core.log import get_logger
from mtl.core.plugins import registry
from mtl.models.param_layout import ParamEntry, parameter_entries
from mtl.parallel.ddp.reduce_group import is_expert_param
from mtl.parallel.optimizer.adamw_shell import MAIN_PARAM
from mtl.parallel.param_layout import param_layout
from mtl.parallel.random import get_rng_tracker
from mtl.parallel.topology import Topology
from mtl.train import extra_state
from mtl.train.finetune_heads import leave_fresh_heads
from mtl.train.layout_change import extra_state_layout_change, same_rng_layout
from mtl.train.seeding import resume_seed, seed_everything

log = get_logger(__name__)


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


def _entries(chunks: list, topology: Topology) -> list[ParamEntry]:
    """This rank's parameters in model order (the same order on every data-parallel replica)."""
    return [entry for chunk in chunks for entry in parameter_entries(_unwrap(chunk), topology)]


def _replica_id(topology: Topology, entry: ParamEntry, index: int) -> int:
    """0 on the one rank that writes this tensor, 1 on the ranks that hold a copy of it.

    Data/context-parallel replicas take turns by parameter index, so a save writes in
    parallel over every rank; an expert parameter's replicas are only the ranks holding the
    same experts (expert-dp x cp: each ep rank's block has its own writer); of the
    tensor-parallel replicas of a parameter TP does not split (norms, row-parallel biases)
    rank 0 writes; the last pipeline stage's copy of a tied embedding is never written."""
    if is_expert_param(entry.param):
        replicas, replica = topology.expert_dp * topology.cp, topology.expert_dp_rank * topology.cp + topology.cp_rank
    else:
        replicas, replica = topology.dp * topology.cp, topology.dp_rank * topology.cp + topology.cp_rank
    turn = index % replicas == replica
    tp_copy = topology.tp > 1 and param_layout(entry.param).tp_split_dim is None and topology.tp_rank != 0
    return int(not turn or tp_copy or entry.is_tied_copy)


def model_sharded_state(chunks: list, topology: Topology, copy: bool = False) -> dict[str, ShardedTensor]:
    """The weights as global tensors; ``copy``: of the tensors this rank writes (the gathered
    weights of ``sharding = "parameters"`` are freed after the save takes them)."""
    state: dict[str, ShardedTensor] = {}
    for index, entry in enumerate(_entries(chunks, topology)):
        key = f"model.{entry.global_name}"
        data, replica_id = entry.view(entry.param.data), _replica_id(topology, entry, index)
        if copy:
            data = data.clone() if replica_id == 0 else torch.zeros((), dtype=data.dtype).expand(data.shape)
        state[key] = ShardedTensor(key, data, entry.global_shape, entry.global_offset, replica_id)
    return state


def _shards_params(chunks: list) -> bool:
    return any(getattr(chunk, "layer_gather", None) is not None for chunk in chunks)


@contextlib.contextmanager
def whole_parameters(chunks: list, write_back: bool = False):
    """Every chunk's parameters whole inside the block (``DataParallel.whole_parameters``)."""
    with contextlib.ExitStack() as stack:
        for chunk in chunks:
            if hasattr(chunk, "whole_parameters"):
                stack.enter_context(chunk.whole_parameters(write_back))
        yield


def _state_key(entry: ParamEntry, name: str) -> str:
    """Moments are ``optimizer.<param>.<moment>``; fp32 main weights (bf16/fp16 weights) are
    stored as the model's weights themselves, so every precision layout reads every checkpoint."""
    return f"model.{entry.global_name}" if name == MAIN_PARAM else f"optimizer.{entry.global_name}.{name}"


def optimizer_save_state(optimizer, topology: Topology, chunks: list) -> dict[str, ShardedTensor]:
    """Both AdamW moments of every parameter, whole and in the parameter's global shape, and
    the fp32 main weights where the optimizer keeps them (under the model's keys: they replace
    the lower-precision copy ``model_sharded_state`` describes).

    A collective under the distributed optimizer (it gathers each bucket's moments over the
    bucket's group: dp x cp, or expert-dp x cp for expert parameters); a rank keeps a copy only of the tensors it writes and describes the rest by shape."""
    entries = _entries(chunks, topology)
    index_of = {id(entry.param): index for index, entry in enumerate(entries)}
    state: dict[str, ShardedTensor] = {}
    for param, moments in optimizer.full_moments():
        index = index_of[id(param)]
        entry, replica_id = entries[index], _replica_id(topology, entries[index], index)
        for moment, tensor in moments.items():
            data = entry.view(tensor)
            if optimizer.is_dp_sharded:  # views of a gathered bucket, gone after this step
                data = data.clone() if replica_id == 0 else torch.zeros((), dtype=data.dtype).expand(data.shape)
            key = _state_key(entry, moment)
            state[key] = ShardedTensor(key, data, entry.global_shape, entry.global_offset, replica_id)
    return state


def optimizer_load_template(optimizer, topology: Topology, chunks: list,
                            names: tuple[str, ...] | None = None) -> dict[str, list[ShardedTensor]]:
    """The live moments this rank updates (and fp32 main weights, read from the model's
    keys), as boxes of the stored global tensors: loading fills the optimizer state in place,
    reading only this rank's elements (its flat shard under the distributed optimizer, split
    into boxes by ``mtl.ckpt.flat_range``). ``names`` limits it to some of them."""
    entries = {id(entry.param): entry for entry in _entries(chunks, topology)}
    template: dict[str, list[ShardedTensor]] = {}
    for piece in optimizer.state_pieces():
        entry = entries[id(piece.source)]
        for moment, flat in piece.moments.items():
            if names is not None and moment not in names:
                continue
            key = _state_key(entry, moment)
            template.setdefault(key, []).extend(flat_range_shards(
                key, flat, entry.local_shape, entry.global_offset, entry.global_shape, piece.first,
                limit_rows=entry.valid_rows,
            ))
    return template


def _rng_states() -> dict[str, torch.Tensor]:
    """The default generators and every stream of the tensor-parallel tracker, as uint8."""
    states = {"rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["rng.cuda"] = torch.cuda.get_rng_state()
    for name, state in get_rng_tracker().get_states().items():
        states[f"rng.tracker.{name}"] = state.cpu()
    return states


def _restore_rng_states(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states.pop("rng.cpu"))
    if "rng.cuda" in states:
        torch.cuda.set_rng_state(states.pop("rng.cuda"))
    tracker = get_rng_tracker()
    tracker.set_states({key.removeprefix("rng.tracker."): value for key, value in states.items()})


def rng_sharded_state(topology: Topology) -> dict[str, ShardedTensor]:
    """Per-rank RNG states, as rows of a [world_size, n] uint8 array."""
    states = _rng_states()
    out = {}
    for key, value in states.items():
        out[key] = extra_state.per_rank_row(key, value.view(1, -1), topology)
    return out


def checkpoint_format(config: RunConfig):
    """The registered format ``ckpt.format`` names (``zarr`` is mtl.ckpt's). A format keeps
    mtl.ckpt's directory layout (``latest``, ``iter_NNNNNNN`` with its metadata), which
    resume reads to find the iteration."""
    return registry("checkpoint format").get(config.ckpt.format)


def software_versions() -> dict[str, str]:
    versions = {"torch": torch.__version__}
    for dist in ("mtl-core", "mtl-parallel", "mtl-models", "mtl-data", "mtl-ckpt", "mtl-train"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def save_checkpoint(config: RunConfig, topology: Topology, chunks: list, optimizer, *, iteration: int,
                    consumed_samples: int, scaler_state: dict, saver=None) -> None:
    for chunk in chunks:  # parallel.overlap_param_gather: wait for the step's parameter all-gathers
        chunk.finish_param_sync()
    with whole_parameters(chunks):  # sharding = "parameters": gathered, copied out, freed again
        state: dict[str, Any] = {**model_sharded_state(chunks, topology, copy=_shards_params(chunks))}
    state.update({**optimizer_save_state(optimizer, topology, chunks), **rng_sharded_state(topology)})
    # modules' own state outside their parameters (Transformer Engine's FP8 amax histories)
    extra, extra_bytes = extra_state.save_state([_unwrap(c) for c in chunks], topology, _device(chunks))
    state.update(extra)
    metadata = {
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "loss_scaler": scaler_state,
        "optimizer_common": optimizer.common_state(),
        "config": config.to_dict(),
        "versions": software_versions(),
        "world_size": topology.world_size,
        "device_type": _device_type(chunks),
        **({extra_state.METADATA_KEY: extra_bytes} if extra_bytes else {}),
    }
    if saver is not None:
        saver.save(state, config.ckpt.save, iteration, metadata)
    else:
        checkpoint_format(config).save(state, config.ckpt.save, iteration, metadata)


def _device_type(chunks: list) -> str:
    return _device(chunks).type


def load_checkpoint(config: RunConfig, topology: Topology, chunks: list, optimizer, directory: str,
                    load_optimizer: bool = True, iteration: int | None = None, fresh_heads: bool = False) -> dict:
    """Load ``iteration`` of ``directory`` (its latest by default) in place, from any layout;
    returns the metadata (iteration, consumed_samples, loss_scaler, ...). ``load_optimizer=False``
    reads the weights only (a fine-tuning start: the caller starts the iteration, schedule and
    optimizer afresh). RNG states come back where the layout is the saved one; elsewhere the
    streams are re-seeded from ``(train.seed, iteration)`` (``layout_change`` says which).
    ``fresh_heads`` (a ``ckpt.finetune_from`` start): the model's new head weights the
    checkpoint cannot fill keep their initialisation (``finetune_heads.leave_fresh_heads``)."""
    fmt = checkpoint_format(config)
    iteration = latest_iteration(directory) if iteration is None else iteration
    metadata = read_metadata(directory, iteration)
    if metadata.get("model_only"):  # a converted checkpoint: weights only, training starts anew
        load_optimizer = False
    template: dict[str, Any] = dict(model_sharded_state(chunks, topology))
    same_rng = load_optimizer and same_rng_layout(metadata, config, topology, _device_type(chunks))
    if load_optimizer:
        template.update(optimizer_load_template(optimizer, topology, chunks))
    elif optimizer.has_main_params:  # weights only: straight into the fp32 main weights
        template.update(optimizer_load_template(optimizer, topology, chunks, names=(MAIN_PARAM,)))
    if fresh_heads:
        leave_fresh_heads(template, chunks, directory, iteration)
    if same_rng:
        template.update(rng_sharded_state(topology))
    extra_bytes = metadata.get(extra_state.METADATA_KEY, 0)
    extra_layout = extra_state_layout_change(metadata, config, topology)
    if extra_bytes and not extra_layout:
        template.update(extra_state.load_template(topology, extra_bytes))
    with whole_parameters(chunks, write_back=True):  # sharding = "parameters": each rank keeps its shard
        fmt.load(template, directory, iteration)
    if optimizer.has_main_params:  # the model's bf16/fp16 weights from the loaded main weights
        optimizer.publish_main_weights()
    if same_rng:
        _restore_rng_states({key: value.data.view(-1).clone() for key, value in template.items()
                             if key.startswith("rng.")})
    elif load_optimizer:
        seed_everything(resume_seed(config.train.seed, iteration), topology, _device(chunks))
    # weights-only loads too: FP8 scales belong to the weights (Megatron restores TE's on --finetune)
    _restore_extra_state(chunks, template.get(extra_state.KEY), extra_bytes, extra_layout)
    if load_optimizer:
        optimizer.load_common_state(metadata["optimizer_common"])
    return metadata


def _restore_extra_state(chunks: list, loaded: ShardedTensor | None, saved_bytes: int, layout_change: str) -> None:
    """Modules' extra state from this rank's loaded row, where the layout is the one saved;
    modules left out keep their fresh state and are named in one log line."""
    models = [_unwrap(c) for c in chunks]
    if loaded is not None:
        fresh, why = extra_state.restore(models, loaded.data)
    else:
        fresh = list(extra_state.modules_with_extra_state(models))
        why = (f"it was saved at another layout ({layout_change}) and cannot be resharded" if saved_bytes
               else "the checkpoint holds none")
    if fresh:
        log.info("extra state of %d module(s) (e.g. FP8 amax histories) starts afresh, %s: %s", len(fresh), why,
                 ", ".join(fresh[:4]) + (" ..." if len(fresh) > 4 else ""))


def _device(chunks: list) -> torch.device:
    return next(_unwrap(chunks[0]).parameters()).device
