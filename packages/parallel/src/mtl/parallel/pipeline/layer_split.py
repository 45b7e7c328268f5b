"""Which transformer layers a pipeline rank's model chunk holds.

Virtual stage ``v = vpp_chunk * pp + pp_rank``: with pp = 2, vpp = 2 and 8 layers, rank 0
holds layers 0-1 (chunk 0) and 4-5 (chunk 1), rank 1 holds 2-3 and 6-7. The sizes come from
``mtl.core.config.pipeline_layer_split``, the one place that decides them.
"""

from __future__ import annotations

from mtl.core.config import ParallelConfig, pipeline_layer_split
from mtl.core.errors import ParallelError


def stage_layer_range(
    num_layers: int,
    topology,
    vpp_chunk: int,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    virtual_stage_layers: list[int] | None = None,
) -> tuple[int, int]:
    """Global layer indices ``[start, end)`` of chunk ``vpp_chunk`` on this pipeline rank."""
    if not 0 <= vpp_chunk < topology.vpp:
        raise ParallelError(
            f"vpp_chunk = {vpp_chunk} is out of range for vpp = {topology.vpp}; chunks are 0..{topology.vpp - 1}"
        )
    split = pipeline_layer_split(
        num_layers,
        ParallelConfig(
            pp=topology.pp,
            vpp=topology.vpp,
            first_stage_layers=first_stage_layers,
            last_stage_layers=last_stage_layers,
            virtual_stage_layers=virtual_stage_layers,
        ),
    )
    virtual_stage = vpp_chunk * topology.pp + topology.pp_rank
    start = sum(split[:virtual_stage])
    return start, start + split[virtual_stage]
