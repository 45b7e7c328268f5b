"""Training state <-> sharded checkpoints (mtl.ckpt).

Model parameters are stored under their global names and global shapes, so any rank layout
can read them; optimizer moments are stored flat per parameter, readable at any dp, pp, vpp
and cp but only at the tp they were saved with; iteration, data position, loss scale, the
resolved config and versions go to the metadata; RNG states are stored per rank."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch

from mtl.ckpt import latest_iteration, read_metadata
from mtl.ckpt.sharded import ShardedTensor
from mtl.core.config import RunConfig
from mtl.core.config_io import config_diff, config_from_dict
from mtl.core.errors import CheckpointError
from mtl.core.log import get_logger
from mtl.core.plugins import registry
from mtl.models.param_layout import global_layout, parameter_entries
from mtl.parallel.random import get_rng_tracker
from mtl.parallel.topology import Topology

log = get_logger(__name__)

# Keys that may change between a save and a resume without changing the model's numbers.
RESUMABLE_CHANGES = ("train.iters", "train.exit_interval", "train.eval_interval", "train.eval_iters",
                     "ckpt", "logging", "train.lr_decay_iters", "data.num_workers", "train.device")


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


def _replica_id(topology: Topology, param: torch.nn.Parameter, tied_copy: bool, dp_sharded: bool = False) -> int:
    """0 on the one rank that writes this tensor, 1 on the ranks that hold a copy of it.

    Copies are: data/context-parallel replicas (unless the state is sharded over dp x cp, as
    the distributed optimizer's is), tensor-parallel replicas of parameters TP does not split
    (norms, row-parallel biases), and the last pipeline stage's copy of a tied embedding."""
    coordinates = [] if dp_sharded else [topology.dp_rank, topology.cp_rank]
    if topology.tp > 1 and getattr(param, "tp_split_dim", None) is None:
        coordinates.append(topology.tp_rank)
    return int(any(coordinates) or tied_copy)


def _parameters_by_global_name(chunks: list, topology: Topology) -> dict[str, tuple[torch.nn.Parameter, bool]]:
    """Global name -> (this rank's parameter, whether it is a tied copy of another stage's)."""
    return {
        global_name: (param, global_name != local_name)
        for chunk in chunks
        for global_name, local_name, param, _, _ in parameter_entries(_unwrap(chunk), topology)
    }


def model_sharded_state(chunks: list, topology: Topology) -> dict[str, ShardedTensor]:
    params = _parameters_by_global_name(chunks, topology)
    state: dict[str, ShardedTensor] = {}
    for chunk in chunks:
        for name, (local, global_shape, offset) in global_layout(_unwrap(chunk), topology).items():
            state[f"model.{name}"] = ShardedTensor(
                key=f"model.{name}", data=local, global_shape=tuple(global_shape), global_offset=tuple(offset),
                replica_id=_replica_id(topology, *params[name]),
            )
    return state


def optimizer_sharded_state(optimizer, topology: Topology, chunks: list) -> dict[str, ShardedTensor]:
    # The distributed optimizer shards over the whole dp x cp group, so every rank of it writes
    # its own piece; TP and tied-embedding copies follow the parameter's own replication.
    params = _parameters_by_global_name(chunks, topology)
    global_names = {param: name for name, (param, _) in params.items()}
    state = {}
    for key, (tensor, global_shape, offset) in optimizer.sharded_state("optimizer", global_names).items():
        param, tied_copy = params[key.removeprefix("optimizer.").rsplit(".", 1)[0]]
        state[key] = ShardedTensor(key=key, data=tensor, global_shape=tuple(global_shape), global_offset=tuple(offset),
                                   replica_id=_replica_id(topology, param, tied_copy, optimizer.is_dp_sharded))
    return state


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
        row = value.view(1, -1)
        out[key] = ShardedTensor(key=key, data=row, global_shape=(topology.world_size, row.shape[1]),
                                 global_offset=(topology.rank, 0), replica_id=0)
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
        **optimizer_sharded_state(optimizer, topology, chunks),
        **rng_sharded_state(topology),
    }
    metadata = {
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "loss_scaler": scaler_state,
        "optimizer_common": optimizer.common_state(),
        "config": config.to_dict(),
        "versions": software_versions(),
        "world_size": topology.world_size,
        "device_type": _device_type(chunks),
    }
    if saver is not None:
        saver.save(state, config.ckpt.save, iteration, metadata)
    else:
        checkpoint_format(config).save(state, config.ckpt.save, iteration, metadata)


def _device_type(chunks: list) -> str:
    return next(_unwrap(chunks[0]).parameters()).device.type


def check_compatible(saved: dict, config: RunConfig, directory: str) -> None:
    """Name every difference between the saved and the current config; refuse the ones that
    change the model's shape or the parallel layout of optimizer state we cannot reshard."""
    saved_cfg = config_from_dict(saved)
    saved_cfg.resolved = True
    differences = config_diff(saved_cfg, config)
    if not differences:
        return
    fatal = [d for d in differences if d.startswith("model.") and not d.startswith("model.backend")]
    for line in differences:
        if not line.startswith(RESUMABLE_CHANGES):  # those change on every resume: not news
            log.warning("resuming %s with a changed setting: %s", directory, line)
    if fatal:
        raise CheckpointError(
            f"checkpoint {directory} was saved from a different model:\n  " + "\n  ".join(fatal)
            + "\nuse the same model settings, or start a new run without ckpt.load"
        )


def load_checkpoint(config: RunConfig, topology: Topology, chunks: list, optimizer, directory: str,
                    load_optimizer: bool = True) -> dict:
    """Load in place; returns the metadata (iteration, consumed_samples, loss_scaler, ...)."""
    iteration = latest_iteration(directory)
    metadata = read_metadata(directory, iteration)
    check_compatible(metadata["config"], config, directory)
    if metadata.get("model_only"):  # a converted checkpoint: weights only, training starts anew
        load_optimizer = False
    saved_tp = metadata["config"]["parallel"].get("tp")
    if load_optimizer and saved_tp != config.parallel.tp:
        # The flat moments of a row-parallel weight interleave differently at another tp: loading
        # them would silently pair each moment with the wrong element.
        raise CheckpointError(
            f"checkpoint {directory} holds optimizer state saved at parallel.tp = {saved_tp}; resuming "
            f"at parallel.tp = {config.parallel.tp} needs the same tp (dp, pp, vpp and cp may change)"
        )
    template: dict[str, Any] = dict(model_sharded_state(chunks, topology))
    # RNG streams are per rank and per device type: restored only where both match (and
    # where the checkpoint has them: older ones lack the device type).
    same_layout = (
        not metadata.get("model_only")
        and metadata.get("world_size") == topology.world_size
        and metadata.get("device_type") == _device_type(chunks)
        and all(metadata["config"]["parallel"].get(k) == getattr(config.parallel, k)
                for k in ("tp", "pp", "vpp", "cp", "distributed_optimizer"))
    )
    if load_optimizer:
        template.update(optimizer_sharded_state(optimizer, topology, chunks))
    if same_layout:
        template.update(rng_sharded_state(topology))
    checkpoint_format(config).load(template, directory, iteration)
    if same_layout:
        _restore_rng_states({key: value.data.view(-1).clone() for key, value in template.items()
                             if key.startswith("rng.")})
    if load_optimizer:
        optimizer.load_common_state(metadata["optimizer_common"])
    return metadata
