"""The built model's parameters per component equal mtl.core.flops.parameter_count."""

import pytest

from mtl.core.flops import parameter_count
from mtl.models.gpt import build_gpt

COMPONENTS = ("embedding", "layers", "final_norm", "output_layer")


@pytest.mark.parametrize("style,qk_norm", [("gpt2", False), ("gpt2", True), ("llama", True), ("llama", False)])
def test_parameter_count_per_component(make_config, backend, single, style, qk_norm):
    config = make_config(style, model={"qk_norm": qk_norm})
    model = build_gpt(config, single, backend)
    counted = dict.fromkeys(COMPONENTS, 0)
    for name, param in model.named_parameters():  # a tied weight is listed once, under embedding
        counted[name.split(".")[0]] += param.numel()
    expected = parameter_count(config)
    assert counted == {k: expected[k] for k in COMPONENTS}
    assert sum(counted.values()) == expected["total"]
