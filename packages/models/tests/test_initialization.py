"""Layout-independent initialization: values by (seed, global name), Megatron's rules."""

import math

import torch

from mtl.models.gpt import build_gpt
from mtl.models.initialization import initialize_parameters
from mtl.models.param_layout import global_layout


def test_rules_and_determinism(make_config, backend, single):
    config = make_config("gpt2", model={"num_layers": 4, "hidden_size": 64, "init_std": 0.05})
    model = build_gpt(config, single, backend)
    initialize_parameters(model, 1, single)
    params = dict(model.named_parameters())
    assert torch.equal(params["layers.0.input_norm.weight"], torch.ones(64))
    assert torch.equal(params["layers.3.mlp.linear_fc1.bias"], torch.zeros(256))
    plain = params["layers.1.mlp.linear_fc1.weight"].std().item()
    scaled = params["layers.1.mlp.linear_fc2.weight"].std().item()
    assert abs(plain - 0.05) < 0.005
    assert abs(scaled - 0.05 / math.sqrt(2 * 4)) < 0.002
    # each parameter has its own stream: layers do not repeat each other
    assert not torch.equal(params["layers.0.mlp.linear_fc1.weight"], params["layers.1.mlp.linear_fc1.weight"])

    again = build_gpt(config, single, backend)
    initialize_parameters(again, 1, single)
    assert all(torch.equal(p, dict(again.named_parameters())[n]) for n, p in params.items())
    initialize_parameters(again, 2, single)
    assert not torch.equal(dict(again.named_parameters())["embedding.word_embeddings.weight"], params["embedding.word_embeddings.weight"])


def test_swiglu_fc1_is_presented_as_gate_and_up(make_config, backend, single):
    model = build_gpt(make_config("llama"), single, backend)
    ffn, hidden = model.config.model.ffn_hidden_size, model.config.model.hidden_size
    local, global_shape, offset = global_layout(model, single)["layers.0.mlp.linear_fc1.weight"]
    assert global_shape == (2, ffn, hidden) and offset == (0, 0, 0)
    assert local.data_ptr() == model.layers["0"].mlp.linear_fc1.weight.data_ptr()
    qkv_shape = global_layout(model, single)["layers.0.self_attention.linear_qkv.weight"][1]
    assert qkv_shape == (2 * (2 + 2) * 8, hidden)  # groups * (q heads per group + k + v) * head_dim
