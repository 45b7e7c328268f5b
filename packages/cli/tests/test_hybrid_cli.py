"""``mtl train`` with the hybrid family: bad patterns are one line before any compute, and
``--dry-run`` counts the Mamba-2 layers' parameters and FLOPs."""

import pytest

from mtl.cli.dry_run import human_bytes
from mtl.core.config_io import load_config
from mtl.models.hybrid.flops import flops_per_iteration, mamba_flops_per_token
from mtl.models.hybrid.memory import activation_bytes_per_layer

HYBRID = ["--set", "model.family='hybrid'", "--set", "model.num_layers=4", "--set", "model.mamba_head_dim=16",
          "--set", "model.mamba_num_groups=2", "--set", "model.mamba_state_dim=8"]


def pattern(value: str) -> list[str]:
    return ["--set", f"model.hybrid_pattern='{value}'"]


@pytest.mark.parametrize("value, extra, needles", [
    ("M*M", [], ["model.hybrid_pattern = 'M*M' has 3 layers", "model.num_layers = 4"]),
    ("M*X-", [], ["unknown symbol 'X' at position 2"]),
    ("M*|M-", [], ["1 pipeline cuts", "pp*vpp = 1*1 needs 0"]),
    ("M*M-", ["--set", "parallel.tp=4"], ["parallel.tp*cp = 4*1 must divide model.mamba_num_heads = 4",
                                          "model.mamba_num_groups = 2"]),
    ("M*E-", ["--set", "model.num_experts=4", "--set", "model.moe_router_num_groups=3"],
     ["model.moe_router_num_groups = 3 must be at least 1 and divide model.num_experts = 4"]),
    ("M*M-", ["--set", "model.moe_router_expert_bias=true"], ["model.moe_router_expert_bias = True needs "
                                                                "model.num_experts > 0"]),
])
def test_a_bad_pattern_is_one_line(mtl, clean_error, tiny_toml, value, extra, needles):
    clean_error(mtl("train", tiny_toml, *HYBRID, *pattern(value), *extra, "--dry-run"), *needles)


def test_dry_run_counts_the_mamba_layers(mtl, ok, tiny_toml):
    """Parameters, FLOPs and the activations of every layer, the Mamba layers' included."""
    out = ok(mtl("train", tiny_toml, *HYBRID, *pattern("M*M-"), "--dry-run"))
    # 4 heads of 16 in 2 groups, state 8. in_proj [2 groups * (z 32 + x 32 + B 8 + C 8 + dt 2), 32];
    # conv [2 * (32 + 8 + 8), 1, 4] + bias; A_log, dt_bias, D [4]; gated norm [64]; out_proj [32, 64]
    mixer = 164 * 32 + 96 * 4 + 96 + 3 * 4 + 64 + 32 * 64
    assert f"mixer (Mamba2Mixer): {mixer:,}" in out
    cfg = load_config(tiny_toml, [arg for arg in (*HYBRID, *pattern("M*M-")) if arg != "--set"])
    cfg = cfg.resolve(world_size=1, tokenizer_vocab_size=257)
    assert mamba_flops_per_token(cfg.model) == 2 * 32 * 164 + 7 * 64 * 8 + 2 * 64 * 32
    assert f"FLOPs per iteration: {flops_per_iteration(cfg):.4e}" in out
    memory = next(line for line in out.splitlines() if line.startswith("estimated memory per"))
    per_layer = activation_bytes_per_layer(cfg)
    assert per_layer[0] > per_layer[1] and f"activations {human_bytes(sum(per_layer))}" in memory


def test_pipeline_stages_without_cuts_split_by_flops():
    """No '|': pp = 2 sizes the stages by each layer's FLOPs (Mamba layers cost more than MLPs)."""
    overrides = ["model.family='hybrid'", "model.hybrid_pattern='MM--'", "model.num_layers=4",
                 "model.mamba_head_dim=16", "model.mamba_num_groups=2", "model.mamba_state_dim=8", "parallel.pp=2"]
    cfg = load_config(None, overrides).resolve(world_size=2, tokenizer_vocab_size=257)
    assert cfg.parallel.pipeline_split == "flops" and sum(cfg.parallel.virtual_stage_layers) == 4
    cut = load_config(None, [*overrides[:1], "model.hybrid_pattern='M|M--'", *overrides[2:]])
    assert cut.resolve(world_size=2, tokenizer_vocab_size=257).parallel.virtual_stage_layers == [1, 3]
