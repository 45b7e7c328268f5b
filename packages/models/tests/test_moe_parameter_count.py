"""An MoE model's parameters (what ``--dry-run`` counts on the meta device) equal a hand count
from the config and the model built for real."""

import torch

from mtl.core.flops import parameter_counts
from mtl.models.gpt import build_gpt


def test_moe_layers_count_router_experts_shared_expert_and_gate(make_config, backend, single):
    moe = {"num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 16, "moe_shared_expert_ffn_hidden_size": 24,
           "moe_shared_expert_gate": True, "moe_layer_freq": 2, "num_layers": 4}
    config = make_config("llama", model=moe)
    with torch.device("meta"):
        meta = build_gpt(config, single, backend)
    dense = build_gpt(make_config("llama", model={"num_layers": 4}), single, backend)
    h, m = 32, config.model
    # layers 0 and 2: router [E, h], experts fc1 [E, 2f, h] + fc2 [E, h, f], shared SwiGLU MLP, gate [1, h]
    moe_mlp = 4 * h + 4 * 3 * 16 * h + 3 * 24 * h + h
    dense_mlp = 3 * m.ffn_hidden_size * h
    expected_layers = parameter_counts(dense)["layers"] + 2 * (moe_mlp - dense_mlp)
    counts = parameter_counts(meta)
    assert counts["layers"] == expected_layers
    assert counts["total"] == sum(p.numel() for p in build_gpt(config, single, backend).parameters())
