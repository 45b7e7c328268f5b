"""How the pipeline stages are sized: the layers of every (virtual) stage, checked against the
layout and the model, from explicit counts, an even split, or the model family's FLOPs
(``parallel.pipeline_split``). ``pipeline_layer_split`` is the one place that decides them; the
functions taking ``cfg`` take a ``RunConfig``."""

from __future__ import annotations

from typing import Any

from mtl.core.config_sections import ModelConfig, ParallelConfig
from mtl.core.errors import ConfigError


def pipeline_layer_split(num_layers: int, p: ParallelConfig) -> list[int]:
    """Layers per virtual stage, in model order: ``pp * vpp`` entries summing to num_layers.

    ``virtual_stage_layers`` gives every size; otherwise the first and last stages may be given
    explicit sizes and the rest are split evenly."""
    if p.virtual_stage_layers is not None:
        return _explicit_layer_split(num_layers, p)
    stages = p.pp * p.vpp
    first, last = p.first_stage_layers, p.last_stage_layers
    if first is None and last is None:
        if num_layers % stages:
            raise ConfigError(
                f"model.num_layers = {num_layers} is not divisible by pp*vpp = {p.pp}*{p.vpp} = "
                f"{stages}; change num_layers, set parallel.pipeline_split = 'flops', or give the counts in "
                "parallel.virtual_stage_layers (or, at vpp = 1, parallel.first_stage_layers/last_stage_layers)"
            )
        return [num_layers // stages] * stages
    if p.vpp > 1:
        raise ConfigError("parallel.first_stage_layers/last_stage_layers need parallel.vpp = 1; at vpp > 1 "
                          "parallel.virtual_stage_layers gives every virtual stage's layers")
    if stages == 1:
        raise ConfigError("parallel.first_stage_layers/last_stage_layers need parallel.pp > 1")
    fixed = (first or 0) + (last or 0)
    free_stages = stages - (first is not None) - (last is not None)
    rest = num_layers - fixed
    if rest < 0 or (free_stages and rest % free_stages) or (not free_stages and rest):
        raise ConfigError(
            f"model.num_layers = {num_layers} minus first/last stage layers ({fixed}) does not "
            f"split evenly over the remaining {free_stages} pipeline stages"
        )
    even = rest // free_stages if free_stages else 0
    split = [even] * stages
    if first is not None:
        split[0] = first
    if last is not None:
        split[-1] = last
    return split


def pipeline_rank_layers(num_layers: int, p: ParallelConfig) -> list[list[int]]:
    """The global layer indices each pipeline rank holds, from ``pipeline_layer_split`` (virtual
    stage ``v`` runs on rank ``v % pp``)."""
    ranks: list[list[int]] = [[] for _ in range(p.pp)]
    start = 0
    for stage, count in enumerate(pipeline_layer_split(num_layers, p)):
        ranks[stage % p.pp].extend(range(start, start + count))
        start += count
    return ranks


def _explicit_layer_split(num_layers: int, p: ParallelConfig) -> list[int]:
    """``parallel.virtual_stage_layers``, checked against the layout and the model."""
    counts, stages = p.virtual_stage_layers, p.pp * p.vpp
    if p.first_stage_layers is not None or p.last_stage_layers is not None:
        raise ConfigError("parallel.virtual_stage_layers gives every stage's layers: unset "
                          "parallel.first_stage_layers/last_stage_layers, or put their counts in it")
    if p.pp == 1:
        raise ConfigError("parallel.virtual_stage_layers needs parallel.pp > 1 (one stage holds every layer)")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in counts):
        raise ConfigError(f"parallel.virtual_stage_layers = {counts!r}: every entry must be a whole number "
                          "of layers, at least 1")
    if len(counts) != stages:
        raise ConfigError(f"parallel.virtual_stage_layers = {counts!r} has {len(counts)} entries; it needs "
                          f"pp*vpp = {p.pp}*{p.vpp} = {stages}, one per virtual stage in model order")
    if sum(counts) != num_layers:
        raise ConfigError(f"parallel.virtual_stage_layers = {counts!r} sums to {sum(counts)} layers; "
                          f"model.num_layers = {num_layers}")
    return list(counts)


def pipeline_num_layers(m: ModelConfig) -> int:
    """The layers the pipeline stages split: ``model.num_layers``, or what the model family counts
    (``ModelFamily.pipeline_layers``: t5's encoder and decoder layers)."""
    from mtl.core.plugins import registry  # noqa: PLC0415 (plugins imports the hookspecs, not config)

    families = registry("model family")
    family = families.get(m.family) if m.family in families else None
    if family is None or family.pipeline_layers is None:
        return m.num_layers
    return family.pipeline_layers(m)


def default_pipeline_split(p: ParallelConfig, m: ModelConfig) -> str:
    """``parallel.pipeline_split`` unset: by FLOPs at pp > 1 where the model family counts them and
    no layer counts are given (the split users run fastest, by measurement); else even."""
    given = p.virtual_stage_layers is not None or p.first_stage_layers is not None or p.last_stage_layers is not None
    if p.pp == 1 or given:
        return "even"
    return "flops" if _family_counting_layer_flops(m.family) is not None else "even"


def _family_counting_layer_flops(name: str):
    """The registered model family ``name`` if it gives its FLOPs in all and per layer, else None."""
    from mtl.core.plugins import registry  # noqa: PLC0415 (plugins imports the hookspecs, not config)

    families = registry("model family")
    family = families.get(name) if name in families else None
    if family is None or family.flops_per_iteration is None or family.layer_flops_per_iteration is None:
        return None
    return family


def check_flops_split(num_layers: int, p: ParallelConfig) -> None:
    """What ``parallel.pipeline_split = "flops"`` can be checked for before the model is resolved."""
    if p.first_stage_layers is not None or p.last_stage_layers is not None:
        raise ConfigError("parallel.pipeline_split = 'flops' sizes every stage: unset "
                          "parallel.first_stage_layers/last_stage_layers, or use pipeline_split = 'even'")
    if num_layers < p.pp * p.vpp:
        raise ConfigError(f"model.num_layers = {num_layers} cannot fill pp*vpp = {p.pp}*{p.vpp} = "
                          f"{p.pp * p.vpp} pipeline stages with at least one layer each")


def layer_and_head_flops(cfg: Any) -> tuple[list[float], float] | None:
    """The resolved config's FLOPs per iteration of each layer and of the rest (the LM head and
    loss, on the last stage), as the model family counts them; None where it does not."""
    m = cfg.model
    family = _family_counting_layer_flops(m.family)
    if family is None:
        return None
    layer_costs = family.layer_flops_per_iteration(cfg)
    if len(layer_costs) != m.num_layers:
        raise ConfigError(f"model family '{m.family}': layer_flops_per_iteration gave {len(layer_costs)} counts for "
                          f"model.num_layers = {m.num_layers}; it must give one per layer (until it does, "
                          "parallel.pipeline_split = 'even' splits the stages without them)")
    return layer_costs, family.flops_per_iteration(cfg) - sum(layer_costs)


def derive_flops_split(cfg: Any) -> None:
    """``parallel.pipeline_split = "flops"``: derive ``virtual_stage_layers`` from the model family's
    FLOP counts (``mtl.core.stage_balance``). A split already given must be the one derived (a
    resolved config resolves again to itself)."""
    from mtl.core.stage_balance import balance_stage_layers  # noqa: PLC0415 (only this option needs it)

    m, p = cfg.model, cfg.parallel
    if p.pipeline_split != "flops" or p.pp == 1:
        return  # at pp = 1 one stage holds every layer: nothing to balance
    counts = layer_and_head_flops(cfg)
    if counts is None:
        raise ConfigError(f"parallel.pipeline_split = 'flops' needs the FLOPs of each layer of model family "
                          f"'{m.family}' (its flops_per_iteration and layer_flops_per_iteration), which it does not "
                          "give here; set parallel.virtual_stage_layers by hand, or pipeline_split = 'even'")
    derived = balance_stage_layers(*counts, p.pp, p.vpp)
    if p.virtual_stage_layers is not None and list(p.virtual_stage_layers) != derived:
        raise ConfigError(f"parallel.virtual_stage_layers = {p.virtual_stage_layers!r} is not the split "
                          f"parallel.pipeline_split = 'flops' derives ({derived}): unset one of them")
    p.virtual_stage_layers = derived
