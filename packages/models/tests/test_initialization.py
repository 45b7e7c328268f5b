"""Layout-independent initialization: values by (seed, global name), Megatron's rules."""

import math

import pytest
import torch
from torch import nn

from mtl.core.errors import PluginError
from mtl.models.gpt import build_gpt
from mtl.models.initialization import INIT_KINDS, initialize_parameters, output_init_std, tag_init
from mtl.models.param_layout import global_layout, parameter_entries


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


def old_name_rule(global_name: str, global_shape, seed: int, config) -> torch.Tensor:
    """The initial value as it was decided before parameters carried ``init_kind`` (by name)."""
    from mtl.models.initialization import output_init_std, parameter_seed

    module_path, _, leaf = global_name.rpartition(".")
    module_name = module_path.rpartition(".")[2]
    if "bias" in leaf:
        return torch.zeros(global_shape)
    if module_name.endswith("norm"):
        return torch.ones(global_shape)
    std = output_init_std(config) if module_name in ("linear_proj", "linear_fc2") else config.model.init_std
    generator = torch.Generator().manual_seed(parameter_seed(seed, global_name))
    return torch.empty(global_shape).normal_(0.0, std, generator=generator)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_tagged_init_is_bit_identical_to_the_old_name_rule(make_config, backend, single, style):
    config = make_config(style, model={"num_layers": 3, "qkv_bias": True})
    model = build_gpt(config, single, backend)
    entries = parameter_entries(model, single)
    assert all(getattr(e.param, "init_kind", None) in INIT_KINDS for e in entries)  # every one tagged
    for entry in entries:
        expected = old_name_rule(entry.global_name, entry.global_shape, config.train.seed, config)
        assert torch.equal(entry.view(entry.param.data), expected), entry.global_name
    kinds = {e.global_name: e.param.init_kind for e in entries}
    assert kinds["layers.2.mlp.linear_fc2.weight"] == kinds["layers.0.self_attention.linear_proj.weight"] == "residual_output"
    assert kinds["layers.0.self_attention.linear_qkv.bias"] == "zeros"
    assert kinds["final_norm.weight"] == "ones"


def test_the_tag_decides_not_the_name(make_config, backend, single):
    """A parameter whose name the old rule would misread starts as its tag says."""
    config = make_config("gpt2")
    model = build_gpt(config, single, backend)
    extra = nn.Parameter(torch.empty(4, 32))  # its module's name ends in "norm": the old rule gave ones
    model.layers["0"].mlp.register_module("gate_norm", nn.Linear(1, 1, bias=False))
    model.layers["0"].mlp.gate_norm.weight = tag_init(extra, "residual_output")
    untagged = nn.Parameter(torch.empty(5))
    model.layers["0"].register_parameter("scale_bias", untagged)  # no tag: the name rule, zeros
    initialize_parameters(model, 3, single)
    assert abs(extra.std().item() - output_init_std(config)) < 0.5 * output_init_std(config)
    assert torch.equal(untagged.data, torch.zeros(5))
    with pytest.raises(PluginError, match="init_kind = 'uniform'"):
        tag_init(nn.Parameter(torch.empty(1)), "uniform")


def test_an_unknown_kind_set_by_hand_is_named_with_its_parameter(make_config, backend, single):
    model = build_gpt(make_config("llama"), single, backend)
    model.layers["1"].mlp.linear_fc1.weight.init_kind = "uniform"  # bypassing tag_init's check
    with pytest.raises(PluginError, match=r"parameter layers\.1\.mlp\.linear_fc1\.weight: init_kind = 'uniform'"):
        initialize_parameters(model, 1, single)
