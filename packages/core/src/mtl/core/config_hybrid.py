"""The hybrid family's layer pattern (``model.hybrid_pattern``, Megatron's symbols) and the Mamba-2
sizes: checked as given, derived (the pipeline stages from its ``|`` cuts, the MoE layers from its
``E``, the SSM head count), and checked against the layout once resolved."""

from __future__ import annotations

from mtl.core.config_sections import ModelConfig, ParallelConfig
from mtl.core.errors import ConfigError

LAYER_SYMBOLS = {"M": "Mamba-2 mixer", "*": "attention", "-": "MLP", "E": "MoE"}
PIPELINE_CUT = "|"
MAMBA_SIZES = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_expand", "mamba_conv_kernel",
               "mamba_chunk_size")


def layer_symbols(pattern: str) -> str:
    """The pattern's layer symbols, one per layer, without the pipeline cuts."""
    return pattern.replace(PIPELINE_CUT, "")


def check_hybrid_values(m: ModelConfig, p: ParallelConfig) -> None:
    """The pattern as given: its family, symbols, length, cuts and MoE layers."""
    pattern = m.hybrid_pattern
    if pattern is None:
        if m.family == "hybrid":
            raise ConfigError("model.family = 'hybrid' needs model.hybrid_pattern, one symbol per layer "
                              "(e.g. 'M-M*-' : M Mamba-2, * attention, - MLP, E MoE, | pipeline cut)")
        return
    if m.family != "hybrid":
        raise ConfigError(f"model.hybrid_pattern = {pattern!r} is read by model.family = 'hybrid' only "
                          f"(it is {m.family!r}): set the family or remove the pattern")
    for position, symbol in enumerate(pattern):
        if symbol not in LAYER_SYMBOLS and symbol != PIPELINE_CUT:
            known = ", ".join(f"{s} ({what})" for s, what in LAYER_SYMBOLS.items())
            raise ConfigError(f"model.hybrid_pattern = {pattern!r}: unknown symbol {symbol!r} at position "
                              f"{position}; use {known} or | (pipeline cut)")
    symbols = layer_symbols(pattern)
    if len(symbols) != m.num_layers:
        raise ConfigError(f"model.hybrid_pattern = {pattern!r} has {len(symbols)} layers but model.num_layers = "
                          f"{m.num_layers}: give one symbol per layer")
    cuts = pattern.count(PIPELINE_CUT)
    if cuts and cuts != p.pp * p.vpp - 1:
        raise ConfigError(f"model.hybrid_pattern = {pattern!r} has {cuts} pipeline cuts '|' but pp*vpp = "
                          f"{p.pp}*{p.vpp} needs {p.pp * p.vpp - 1}; fix the cuts or remove them (pp > 1 then "
                          "splits by FLOPs)")
    if cuts and any(not stage for stage in pattern.split(PIPELINE_CUT)):
        raise ConfigError(f"model.hybrid_pattern = {pattern!r} has an empty pipeline stage: every '|' needs "
                          "layers on both sides")
    if "E" in symbols and m.num_experts == 0:
        raise ConfigError(f"model.hybrid_pattern = {pattern!r} has MoE layers 'E' but model.num_experts = 0; "
                          "set model.num_experts")
    for key in MAMBA_SIZES:
        if getattr(m, key) < 1:
            raise ConfigError(f"model.{key} = {getattr(m, key)} must be at least 1")
    if m.mamba_dt_min < 0:
        raise ConfigError(f"model.mamba_dt_min = {m.mamba_dt_min} must not be negative (0: no floor)")


def derive_hybrid(m: ModelConfig, p: ParallelConfig) -> None:
    """The pipeline stages' layers from the cuts, the MoE layers from 'E', the SSM head count."""
    pattern = m.hybrid_pattern
    if pattern is None:
        return
    if PIPELINE_CUT in pattern:
        stages = [len(stage) for stage in pattern.split(PIPELINE_CUT)]
        if p.virtual_stage_layers is not None and list(p.virtual_stage_layers) != stages:
            raise ConfigError(f"parallel.virtual_stage_layers = {p.virtual_stage_layers!r} disagrees with the cuts "
                              f"of model.hybrid_pattern = {pattern!r} ({stages}): unset one of them")
        p.virtual_stage_layers = stages
    symbols = layer_symbols(pattern)
    moe_layers = [i for i, symbol in enumerate(symbols) if symbol == "E"]
    if m.moe_layers is not None and list(m.moe_layers) != moe_layers:
        raise ConfigError(f"model.moe_layers = {m.moe_layers!r} disagrees with the 'E' layers of "
                          f"model.hybrid_pattern ({moe_layers}): unset model.moe_layers")
    m.moe_layers = moe_layers
    if m.mamba_num_heads is None:
        inner = m.mamba_expand * m.hidden_size
        if inner % m.mamba_head_dim:
            raise ConfigError(f"model.mamba_expand * hidden_size = {inner} is not divisible by model.mamba_head_dim "
                              f"= {m.mamba_head_dim}; change one or set model.mamba_num_heads")
        m.mamba_num_heads = inner // m.mamba_head_dim


def check_hybrid(m: ModelConfig, p: ParallelConfig) -> None:
    """The resolved SSM sizes against the layout: TP, and under CP the scan, split whole groups of heads."""
    if m.hybrid_pattern is None or "M" not in m.hybrid_pattern:
        return
    heads, groups = m.mamba_num_heads, m.mamba_num_groups
    if heads % groups:
        raise ConfigError(f"model.mamba_num_heads = {heads} is not divisible by model.mamba_num_groups = {groups}")
    if heads % (p.tp * p.cp) or groups % (p.tp * p.cp):
        raise ConfigError(f"parallel.tp*cp = {p.tp}*{p.cp} must divide model.mamba_num_heads = {heads} and "
                          f"model.mamba_num_groups = {groups} (each rank's conv and scan take whole groups of SSM heads)")
