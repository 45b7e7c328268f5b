"""How the parallel layout of a resumed run differs from the one a checkpoint was saved at.

Model weights and optimizer state are stored in global shapes and reshard to any layout; what
is stored per rank (RNG states, modules' extra state such as FP8 amax histories) is restored
only where the layout that placed it is the same, and these functions say whether it is."""

from __future__ import annotations

from mtl.core.config import ParallelConfig, RunConfig, pipeline_layer_split, pipeline_num_layers
from mtl.core.config_io import config_diff, config_from_dict
from mtl.parallel.topology import Topology

RNG_LAYOUT_KEYS = ("tp", "pp", "vpp", "cp", "ep", "distributed_optimizer")
# What places a module on a rank: its per-rank extra state is restored only where these match.
EXTRA_STATE_LAYOUT_KEYS = ("tp", "pp", "vpp", "cp", "ep")
# the saved keys that sized the pipeline stages (resolved: a split by FLOPs is saved as its counts)
STAGE_SIZE_KEYS = ("first_stage_layers", "last_stage_layers", "virtual_stage_layers")


def same_rng_layout(metadata: dict, config: RunConfig, topology: Topology, device_type: str) -> bool:
    """Whether every rank's saved RNG states belong to the rank of the same number now."""
    return (metadata.get("world_size") == topology.world_size
            and metadata.get("device_type") == device_type
            and all(metadata["config"]["parallel"].get(k) == getattr(config.parallel, k) for k in RNG_LAYOUT_KEYS))


def extra_state_layout_change(metadata: dict, config: RunConfig, topology: Topology) -> str:
    """What differs from the saved layout for modules' extra state, which is per rank and
    opaque ("" where nothing does): the world size, a split of the model, or which layers each
    pipeline stage holds (a chunk's modules are named by their place in it, so the same names
    would be other layers)."""
    if metadata.get("world_size") != topology.world_size:
        return f"world size {metadata.get('world_size')} -> {topology.world_size}"
    saved = metadata["config"]["parallel"]
    changed = [f"parallel.{k} {saved.get(k)} -> {getattr(config.parallel, k)}" for k in EXTRA_STATE_LAYOUT_KEYS
               if saved.get(k) != getattr(config.parallel, k)]
    return ", ".join(changed) or stage_split_change(metadata, config)


def stage_split_change(metadata: dict, config: RunConfig) -> str:
    """Where pp and vpp are the saved ones but the stages hold other layers, that change (e.g.
    'layers per pipeline stage [12, 12] -> [13, 11]'); "" where not."""
    saved, p = metadata["config"]["parallel"], config.parallel
    if (saved.get("pp"), saved.get("vpp")) != (p.pp, p.vpp):
        return ""
    num_layers = pipeline_num_layers(config.model)
    stages = ParallelConfig(pp=p.pp, vpp=p.vpp, **{k: saved.get(k) for k in STAGE_SIZE_KEYS})
    saved_split, split = pipeline_layer_split(num_layers, stages), pipeline_layer_split(num_layers, p)
    return f"layers per pipeline stage {saved_split} -> {split}" if saved_split != split else ""


def layout_change_note(metadata: dict, config: RunConfig, topology: Topology, device_type: str,
                       full_resume: bool) -> str:
    """The one line a resume at another layout than the saved one logs ("" at the same layout):
    what changed, and that the state reshards (an expected change, not a problem)."""
    saved = config_from_dict(metadata["config"])
    saved.resolved = True
    # parallel.world_size among them: the saved world size is the saved config's
    changes = [line for line in config_diff(saved, config) if line.startswith("parallel.")]
    if not changes and stage_split_change(metadata, config):
        changes.append(stage_split_change(metadata, config))
    if metadata.get("device_type") != device_type:
        changes.append(f"device {metadata.get('device_type')} -> {device_type}")
    if not changes:
        return ""
    state = "weights and optimizer state reshard" if full_resume else "the weights reshard"
    if full_resume and not same_rng_layout(metadata, config, topology, device_type):
        state += f"; RNG streams re-seeded from (train.seed, iteration {metadata['iteration']})"
    return f"resuming at another layout ({'; '.join(changes)}): {state}"
