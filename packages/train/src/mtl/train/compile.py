"""``train.compile``: regional compilation, one ``torch.compile`` per transformer layer.

Why regional and not the whole model: every layer of a stack has the same code and shapes,
so dynamo traces one graph and inductor compiles it once for all of them (a whole-model
compile traces every layer again and grows with depth); the pipeline schedule, the
data-parallel hooks and the checkpoint code stay eager Python around the compiled layers;
and parameter names do not change (``nn.Module.compile`` compiles in place, no
``_orig_mod.`` prefix), so checkpoints are the same with compile on or off.

A family says which of its modules are the repeated units by a ``compile_units()`` method
on the module it builds; a model without one is compiled whole.
"""

from __future__ import annotations

from torch import nn

from mtl.core.log import get_logger

log = get_logger(__name__)


def compile_units(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``train.compile`` compiles, each on its own."""
    units = getattr(model, "compile_units", None)
    return list(units()) if callable(units) else [model]


# ``parallel.overlap_layer_comm``: keep the order in which a layer's code starts its collectives
# and waits on them. By default inductor reorders the scheduled nodes to lower peak memory, which
# moves each collective's start next to its wait (a collective allocates its output), so nothing
# runs beside it. Without that pass the written order stands: the sequence-parallel backward's
# reduce-scatter before the weight-gradient GEMM (``gathered_linear``), the all-gathered cp
# attention's gather before the own block's pieces. (Inductor's raise_comms + sink_waits passes
# also reorder, but cost a tp=2 rank 15-37% more compute on one H100: benchmarks/RESULTS.md.)
OVERLAP_LAYER_COMM = {"reorder_for_peak_memory": False}


def compile_regions(chunks: list[nn.Module], overlap_comm: bool = False) -> int:
    """Compile every unit of every model chunk in place; returns how many were compiled.
    ``overlap_comm``: keep the units' collectives where their code starts and waits on them
    (``OVERLAP_LAYER_COMM``, this compile's inductor options only).

    The first step pays the compilation (once per distinct layer shape: the units of a stack
    share one graph); later steps reuse it. Inductor caches compiled graphs on disk, so a
    restarted run compiles faster."""
    options = dict(OVERLAP_LAYER_COMM) if overlap_comm else None
    count = 0
    for chunk in chunks:
        for unit in compile_units(chunk):
            unit.compile(fullgraph=False, dynamic=False, options=options)
            count += 1
    log.info("train.compile: %d regions compiled with torch.compile (the first step includes compilation)", count)
    return count


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph-break reasons counted since start (what the no-graph-break test reads)."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])

