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

import logging
import warnings

import torch
from torch import nn

from mtl.core.log import get_logger

log = get_logger(__name__)


def compile_units(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``train.compile`` compiles, each on its own."""
    units = getattr(model, "compile_units", None)
    return list(units()) if callable(units) else [model]


# A norm's weight gradient sums dy * x_hat over every token of the layer call. Inductor computes
# it in the kernel that computes the input gradient (a "mix order reduction"): each program
# sums a split of rows into an fp32 workspace [splits, hidden], and an eager ``sum(dim=0)`` over
# the splits finishes it. Its default split is sized for 8 programs per SM (16 rows at 8192
# tokens on an H100: 512 splits), and that final sum then costs more than the kernel saved: on
# the reference layer (8192 tokens, hidden 2048, one H100) kernel + sum per layer call take
# 0.117 ms at 16 rows, 0.093 at 32, 0.096 at 64 and 0.113 at 128 (benchmarks/log).
# About one split per SM is the best: the largest power of two <= tokens / SMs, within [16, 128].
def norm_grad_split_rows(tokens_per_call: int, sm_count: int) -> int:
    """Rows per split of a norm weight gradient's first stage (``mix_order_reduction_split_size``)."""
    per_sm = max(tokens_per_call // max(sm_count, 1), 1)
    return min(max(1 << (per_sm.bit_length() - 1), 16), 128)


def inductor_options(*, tokens_per_call: int, device: torch.device) -> dict | None:
    """This run's inductor options for every compiled region (None: inductor's defaults)."""
    options = {}
    if device.type == "cuda":
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        options["triton.mix_order_reduction_split_size"] = norm_grad_split_rows(tokens_per_call, sm_count)
    return options or None


def set_async_tp(tp_group) -> None:
    """``parallel.async_tp`` for this process: inductor's micro-pipeline TP pass (a global setting,
    not a per-compile option, so the layers' backward, compiled at the first backward, follows it too)
    over the TP group's symmetric memory, which the fused ops exchange their pieces through.
    ``tp_group`` None turns it off; every run sets its own."""
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = tp_group is not None
    if tp_group is not None:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        # torch 2.11 marks this call deprecated ("no need to call"), yet its pass still fuses only
        # the collectives of groups registered here (is_symm_mem_enabled_for_group): keep the call,
        # drop the misleading warning
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable_symm_mem_for_group(tp_group.group_name)
        # the pass warns for every graph without a sequence-parallel collective, as the final
        # norm's: expected, not a fault of the run
        pass_log = logging.getLogger("torch._inductor.fx_passes.micro_pipeline_tp")
        if _no_patterns_is_expected not in pass_log.filters:
            pass_log.addFilter(_no_patterns_is_expected)


def _no_patterns_is_expected(record: logging.LogRecord) -> bool:
    return "found no matching" not in record.getMessage()


def compile_regions(chunks: list[nn.Module], options: dict | None = None) -> int:
    """Compile every unit of every model chunk in place; returns how many were compiled.
    ``options``: inductor options for these compiles only (``inductor_options``).

    The first step pays the compilation (once per distinct layer shape: the units of a stack
    share one graph); later steps reuse it. Inductor caches compiled graphs on disk, so a
    restarted run compiles faster."""
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

