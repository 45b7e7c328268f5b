"""The MoE keys of the model section: derived values and the errors that name key and value."""

import pytest

from mtl.core.config_io import load_config
from mtl.core.errors import ConfigError


def resolve(*overrides, world_size=1):
    base = ["model.num_layers=4", "model.hidden_size=32", "model.num_attention_heads=4", "model.vocab_size=100"]
    return load_config(None, [*base, *overrides]).resolve(world_size).model


def test_dense_by_default():
    m = resolve()
    assert m.num_experts == 0 and m.moe_layers == [] and m.moe_ffn_hidden_size is None


def test_derived_moe_layers_and_expert_width():
    m = resolve("model.num_experts=4", "model.moe_layer_freq=2", "model.ffn_hidden_size=48")
    assert m.moe_layers == [0, 2]  # Megatron: layer i is MoE when i % freq == 0
    assert m.moe_ffn_hidden_size == 48
    m = resolve("model.num_experts=4", "model.moe_ffn_hidden_size=16", "model.moe_capacity_factor=0")
    assert m.moe_layers == [0, 1, 2, 3] and m.moe_ffn_hidden_size == 16
    assert m.moe_capacity_factor is None  # 0 means dropless
    assert resolve("model.num_experts=4", "model.moe_layers=[1, 3]").moe_layers == [1, 3]


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (["model.num_experts=4", "model.moe_top_k=5"], 1, "model.moe_top_k = 5"),
        (["model.num_experts=4", "model.moe_top_k=0"], 1, "model.moe_top_k = 0"),
        (["parallel.ep=2"], 2, "parallel.ep = 2 needs experts"),
        (["model.num_experts=3", "parallel.ep=2"], 2, "model.num_experts = 3 is not divisible by parallel.ep = 2"),
        (["model.num_experts=4", "model.moe_ffn_hidden_size=15", "parallel.tp=2"], 2,
         "model.moe_ffn_hidden_size = 15 is not divisible by parallel.tp = 2"),
        (["model.num_experts=4", "model.moe_layer_freq=0"], 1, "model.moe_layer_freq = 0"),
        (["model.num_experts=4", "model.moe_layers=[3, 1]"], 1, "model.moe_layers = [3, 1]"),
        (["model.num_experts=4", "model.moe_layers=[4]"], 1, "model.moe_layers = [4]"),
        (["model.moe_layers=[1]"], 1, "needs model.num_experts > 0"),
        (["model.moe_shared_expert_gate=true"], 1, "model.moe_shared_expert_gate = True needs model.num_experts > 0"),
        (["model.moe_capacity_factor=1.5"], 1, "model.moe_capacity_factor = 1.5 needs model.num_experts > 0"),
        (["model.num_experts=4", "model.moe_shared_expert_gate=true"], 1, "model.moe_shared_expert_gate"),
        (["model.num_experts=4", "model.moe_router='topk'"], 1, "model.moe_router = 'topk'"),
        (["model.num_experts=4", "model.moe_aux_loss_coeff=-1.0"], 1, "model.moe_aux_loss_coeff = -1.0"),
        (["model.num_experts=4", "model.moe_capacity_factor=-0.5"], 1, "model.moe_capacity_factor = -0.5"),
        (["model.num_experts=4", "model.bias=true"], 1, "model.bias = true with model.num_experts > 0"),
        (["model.moe_router_scaling_factor=2.0"], 1, "model.moe_router_scaling_factor = 2.0 needs model.num_experts"),
        (["model.num_experts=4", "model.moe_router_scaling_factor=0.0"], 1,
         "model.moe_router_scaling_factor = 0.0 must be positive"),
        (["model.num_experts=8", "model.moe_router_num_groups=3"], 1,
         "model.moe_router_num_groups = 3 must be at least 1 and divide model.num_experts = 8"),
        (["model.num_experts=8", "model.moe_router_num_groups=2", "model.moe_router_group_topk=3"], 1,
         "model.moe_router_group_topk = 3 must be between 1 and model.moe_router_num_groups = 2"),
        (["model.num_experts=8", "model.moe_router_num_groups=4", "model.moe_top_k=6", "model.moe_router_group_topk=2"],
         1, "model.moe_top_k // model.moe_router_group_topk = 6 // 2 = 3 experts rank each group"),
        (["model.num_experts=8", "model.moe_router_num_groups=4", "model.moe_top_k=5", "model.moe_router_group_topk=2"],
         1, "model.moe_top_k = 5 exceeds the 4 experts"),
        (["model.num_experts=4", "model.moe_router_expert_bias=true"], 1,
         "model.moe_router_expert_bias = true needs model.moe_router = 'sigmoid'"),
        (["model.num_experts=4", "model.moe_router='sigmoid'", "model.moe_router_expert_bias=true",
          "model.moe_capacity_factor=1.5"], 1, "the bias balances dropless routing"),
    ],
)
def test_refused(overrides, world_size, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        resolve(*overrides, world_size=world_size)
