"""Training state <-> sharded checkpoints (mtl.ckpt).

Every tensor is stored in its layout-independent global shape (``mtl.models.param_layout``):
model parameters and both AdamW moments alike, so a checkpoint saved at any (tp, pp, vpp,
cp, dp, distributed optimizer on or off) resumes at any other valid layout, each rank reading
only the slices it holds. Vocabulary padding is not stored. Each tensor is written once: the
data/context-parallel replicas take turns by parameter (so all of them write), TP replicas
and tied copies leave it to the owner. Iteration, data position, loss scale, the resolved
config and versions go to the metadata; experts are global tensors ``[num_experts, ...]`` of
which each expert-parallel rank holds its block (``param_layout``), written by one of the
ranks holding that block, so a save at one ep loads at any other; RNG states are stored per rank and restored where
the layout and device type match (elsewhere re-derived from the seed and iteration), and so are
modules' extra states (``extra_state.py``: Transformer Engine's FP8 amax histories; elsewhere
they start afresh)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from dataclasses import dataclass
from typing import Any

import torch

from mtl.ckpt import latest_iteration, read_metadata
from mtl.ckpt.directory import LATEST_FILE, committed_iterations
from mtl.ckpt.flat_range import flat_range_shards
from mtl.ckpt.sharded import ShardedTensor
from mtl.core.config import ParallelConfig, RunConfig, pipeline_layer_split
from mtl.core.config_io import config_diff, config_from_dict
from mtl.core.errors import CheckpointError
from mtl.core.log import get_logger
from mtl.core.plugins import registry
from mtl.models.param_layout import ParamEntry, parameter_entries
from mtl.parallel.ddp.reduce_group import is_expert_param
from mtl.parallel.optimizer.adamw_shell import MAIN_PARAM
from mtl.parallel.param_layout import param_layout
from mtl.parallel.random import get_rng_tracker
from mtl.parallel.topology import Topology
from mtl.train import extra_state

log = get_logger(__name__)

# Keys that may change between a save and a resume without changing the model's numbers.
RESUMABLE_CHANGES = ("train.iters", "train.exit_interval", "train.eval_interval", "train.eval_iters",
                     "ckpt", "logging", "train.lr_decay_iters", "data.num_workers", "train.device")
# Derived from the layout (the padding of the vocabulary for tp): never stored, never compared.
LAYOUT_DERIVED = ("model.padded_vocab_size", "model.make_vocab_size_divisible_by")
RNG_LAYOUT_KEYS = ("tp", "pp", "vpp", "cp", "ep", "distributed_optimizer")
# What places a module on a rank: its per-rank extra state is restored only where these match.
EXTRA_STATE_LAYOUT_KEYS = ("tp", "pp", "vpp", "cp", "ep")
# the saved keys that sized the pipeline stages (resolved: a split by FLOPs is saved as its counts)
STAGE_SIZE_KEYS = ("first_stage_layers", "last_stage_layers", "virtual_stage_layers")
# The data a run trains on: a ckpt.save directory holding another value belongs to another run.
RUN_DATA_KEYS = ("data.paths", "data.split", "data.tokenizer", "data.tokenizer_model", "data.dataset",
                 "data.mock_num_samples")
# The schedule's length: may change on resume (one warning line names it).
SCHEDULE_KEYS = ("train.iters", "train.lr_decay_iters")


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


def model_sharded_state(chunks: list, topology: Topology) -> dict[str, ShardedTensor]:
    state: dict[str, ShardedTensor] = {}
    for index, entry in enumerate(_entries(chunks, topology)):
        key = f"model.{entry.global_name}"
        state[key] = ShardedTensor(key, entry.view(entry.param.data), entry.global_shape, entry.global_offset,
                                   _replica_id(topology, entry, index))
    return state


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
    state: dict[str, Any] = {
        **model_sharded_state(chunks, topology),
        **optimizer_save_state(optimizer, topology, chunks),
        **rng_sharded_state(topology),
    }
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


def model_differences(saved: dict, config: RunConfig) -> list[str]:
    """``model.*`` settings that differ between a saved config and ``config`` (the ones that
    change the model's numbers: not the backend, not the layout-derived padding)."""
    saved_cfg = config_from_dict(saved)
    saved_cfg.resolved = True
    return [d for d in config_diff(saved_cfg, config, ignore=LAYOUT_DERIVED)
            if d.startswith("model.") and not d.startswith("model.backend")]


def run_differences(saved: dict, config: RunConfig) -> list[str]:
    """What makes a saved config another run: a different model (``model_differences``) or
    different data (``RUN_DATA_KEYS``). A ``ckpt.save`` directory holds one run."""
    saved_cfg = config_from_dict(saved)
    saved_cfg.resolved = True
    data = [d for d in config_diff(saved_cfg, config) if d.split(":")[0] in RUN_DATA_KEYS]
    return model_differences(saved, config) + data


def check_compatible(saved: dict, config: RunConfig, directory: str, iteration: int = 0) -> None:
    """Name every difference between the saved and the current config; refuse the ones that
    change the model. Parallel layout changes are fine: every state reshards. A changed
    schedule length is one warning line."""
    saved_cfg = config_from_dict(saved)
    saved_cfg.resolved = True
    schedule = []
    for line in config_diff(saved_cfg, config, ignore=LAYOUT_DERIVED):
        if line.split(":")[0] in SCHEDULE_KEYS:
            schedule.append(line)
        elif not line.startswith(RESUMABLE_CHANGES) and not line.startswith("model."):
            log.warning("resuming %s with a changed setting: %s", directory, line)
    if schedule and iteration:
        log.warning("the schedule changed since iteration %d was saved (%s): the learning rate follows the new "
                    "length from here on", iteration, "; ".join(schedule))
    fatal = model_differences(saved, config)
    if fatal:
        raise CheckpointError(
            f"checkpoint {directory} was saved from a different model:\n  " + "\n  ".join(fatal)
            + "\nuse the same model settings, or start a new run without ckpt.load"
        )


def has_checkpoint(directory: str | None) -> bool:
    return bool(directory) and os.path.isfile(os.path.join(directory, LATEST_FILE))


def holds_checkpoints(directory: str | None) -> bool:
    """A ``latest`` file or any committed ``iter_*`` directory (what a fresh start must not mix with)."""
    if not directory or not os.path.isdir(directory):
        return False
    return has_checkpoint(directory) or bool(committed_iterations(directory))


@dataclass(frozen=True)
class Start:
    """Where a run's state comes from: ``directory`` (None: fresh weights), the config key
    that named it, and whether the optimizer, iteration and data position come too."""

    directory: str | None
    key: str | None
    full_resume: bool


def starting_checkpoint(config: RunConfig) -> Start:
    """Where this run starts from, in order:

    1. ``ckpt.save`` holding a checkpoint, with ``ckpt.resume`` (the default): this run's own
       latest save, in full (what a rerun of the same command, or torchrun's restart, needs);
    2. ``ckpt.load`` holding a checkpoint: resumed (weights only with ``ckpt.load_optimizer =
       false``);
    3. ``ckpt.finetune_from``: its weights, iteration 0;
    4. nothing: fresh weights."""
    c = config.ckpt
    if c.resume and has_checkpoint(c.save):
        return Start(c.save, "ckpt.save", True)
    if c.load and (has_checkpoint(c.load) or not c.finetune_from):
        return Start(c.load, "ckpt.load", c.load_optimizer)
    if c.finetune_from:
        return Start(c.finetune_from, "ckpt.finetune_from", False)
    return Start(None, None, False)


def check_checkpoint_dirs(config: RunConfig) -> None:
    """Before any compute: the checkpoint a run starts from must hold this model, and the
    directory it saves into only this run (same model and data): another run's directory is
    refused with the differences named. ``ckpt.resume = false`` needs an empty ``ckpt.save``."""
    c = config.ckpt
    if not c.resume and holds_checkpoints(c.save):
        latest = f"latest iteration {latest_iteration(c.save)}" if has_checkpoint(c.save) else "no 'latest'"
        raise CheckpointError(
            f"ckpt.save = {c.save} already holds checkpoints ({latest}); ckpt.resume = false (mtl train --fresh) "
            f"starts over only into an empty directory: remove it, or set ckpt.save to a new directory "
            f"(without --fresh the run resumes from it)"
        )
    start = starting_checkpoint(config)
    if start.directory is not None and start.key != "ckpt.save" and not has_checkpoint(start.directory):
        latest_iteration(start.directory)  # raises, naming what the directory holds
    if start.directory is not None and start.key != "ckpt.save":
        differences = model_differences(read_metadata(start.directory)["config"], config)
        if differences:
            raise CheckpointError(
                f"{start.key} = {start.directory} holds checkpoints of a different model:\n  "
                + "\n  ".join(differences) + "\nuse the same model settings as the checkpoint")
    if has_checkpoint(c.save):
        differences = run_differences(read_metadata(c.save)["config"], config)
        if differences:
            raise CheckpointError(
                f"ckpt.save = {c.save} holds checkpoints of another run (a different model or data):\n  "
                + "\n  ".join(differences)
                + "\nsave into another directory (ckpt.save = NEW_DIR; ckpt.load = "
                f"{c.save} starts it from these weights), or remove {c.save}")


def _same_rng_layout(metadata: dict, config: RunConfig, topology: Topology, chunks: list) -> bool:
    return (metadata.get("world_size") == topology.world_size
            and metadata.get("device_type") == _device_type(chunks)
            and all(metadata["config"]["parallel"].get(k) == getattr(config.parallel, k) for k in RNG_LAYOUT_KEYS))


def resume_seed(seed: int, iteration: int) -> int:
    """A seed for the RNG streams of a run resumed at another layout: a function of the run's
    seed and the iteration, so the resumed run neither replays step 1's draws nor depends on
    anything but its config."""
    digest = hashlib.sha256(f"{seed}:resume:{iteration}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def load_checkpoint(config: RunConfig, topology: Topology, chunks: list, optimizer, directory: str,
                    load_optimizer: bool = True) -> dict:
    """Load in place from any layout; returns the metadata (iteration, consumed_samples,
    loss_scaler, ...). ``load_optimizer=False`` reads the weights only (a fine-tuning start:
    the caller starts the iteration, schedule and optimizer afresh)."""
    from mtl.train.setup import seed_everything  # noqa: PLC0415 (setup imports this module)

    iteration = latest_iteration(directory)
    metadata = read_metadata(directory, iteration)
    check_compatible(metadata["config"], config, directory, iteration)
    if metadata.get("model_only"):  # a converted checkpoint: weights only, training starts anew
        load_optimizer = False
    template: dict[str, Any] = dict(model_sharded_state(chunks, topology))
    same_rng = load_optimizer and _same_rng_layout(metadata, config, topology, chunks)
    if load_optimizer:
        template.update(optimizer_load_template(optimizer, topology, chunks))
    elif optimizer.has_main_params:  # weights only: straight into the fp32 main weights
        template.update(optimizer_load_template(optimizer, topology, chunks, names=(MAIN_PARAM,)))
    if same_rng:
        template.update(rng_sharded_state(topology))
    restaged = _stage_split_change(metadata, config)
    if restaged:  # e.g. an even split saved, stages sized by FLOPs now
        log.info("%s since the save (parallel.pipeline_split, virtual_stage_layers): the weights and optimizer "
                 "state reshard", restaged)
    extra_bytes = metadata.get(extra_state.METADATA_KEY, 0)
    extra_layout = _extra_state_layout_change(metadata, config, topology)
    if extra_bytes and not extra_layout:
        template.update(extra_state.load_template(topology, extra_bytes))
    checkpoint_format(config).load(template, directory, iteration)
    if optimizer.has_main_params:  # the model's bf16/fp16 weights from the loaded main weights
        optimizer.publish_main_weights()
    if same_rng:
        _restore_rng_states({key: value.data.view(-1).clone() for key, value in template.items()
                             if key.startswith("rng.")})
    elif load_optimizer:
        seed_everything(resume_seed(config.train.seed, iteration), topology, _device(chunks))
        saved = metadata["config"]["parallel"]
        log.info("RNG streams re-seeded from (train.seed, iteration %d): the checkpoint's are per rank of "
                 "another layout (world size %s, %s)", iteration, metadata.get("world_size"),
                 ", ".join(f"{k} {saved.get(k)}" for k in RNG_LAYOUT_KEYS))
    # weights-only loads too: FP8 scales belong to the weights (Megatron restores TE's on --finetune)
    _restore_extra_state(chunks, template.get(extra_state.KEY), extra_bytes, extra_layout)
    if load_optimizer:
        optimizer.load_common_state(metadata["optimizer_common"])
    return metadata


def _extra_state_layout_change(metadata: dict, config: RunConfig, topology: Topology) -> str:
    """What differs from the saved layout for modules' extra state, which is per rank and
    opaque ("" where nothing does): the world size, a split of the model, or which layers each
    pipeline stage holds (a chunk's modules are named by their place in it, so the same names
    would be other layers)."""
    if metadata.get("world_size") != topology.world_size:
        return f"world size {metadata.get('world_size')} -> {topology.world_size}"
    saved = metadata["config"]["parallel"]
    changed = [f"parallel.{k} {saved.get(k)} -> {getattr(config.parallel, k)}" for k in EXTRA_STATE_LAYOUT_KEYS
               if saved.get(k) != getattr(config.parallel, k)]
    return ", ".join(changed) or _stage_split_change(metadata, config)


def _stage_split_change(metadata: dict, config: RunConfig) -> str:
    """Where pp and vpp are the saved ones but the stages hold other layers, that change (e.g.
    'layers per pipeline stage [12, 12] -> [13, 11]'); "" where not."""
    saved, p = metadata["config"]["parallel"], config.parallel
    if (saved.get("pp"), saved.get("vpp")) != (p.pp, p.vpp):
        return ""
    num_layers = config.model.num_layers
    stages = ParallelConfig(pp=p.pp, vpp=p.vpp, **{k: saved.get(k) for k in STAGE_SIZE_KEYS})
    saved_split, split = pipeline_layer_split(num_layers, stages), pipeline_layer_split(num_layers, p)
    return f"layers per pipeline stage {saved_split} -> {split}" if saved_split != split else ""


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
