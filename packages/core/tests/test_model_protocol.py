"""The written contract of what a family's ``build`` returns, checked at build time."""

import pytest
import torch
from torch import nn

from mtl.core.errors import PluginError
from mtl.core.model_protocol import LanguageModel, build_model, check_model, tag_init
from mtl.core.registrations import ModelFamily


class Complete(nn.Module):
    def __init__(self, config=None, pre_process=True, post_process=True):
        super().__init__()
        self.config, self.pre_process, self.post_process = config, pre_process, post_process
        self.proj = nn.Linear(2, 2)

    def forward(self, input_ids, position_ids=None, labels=None, inference_context=None):
        return self.proj(input_ids)

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor

    def compile_units(self):
        return [self.proj]


class NoStageMethods(nn.Module):
    config, pre_process, post_process = None, True, True

    def forward(self, input_ids, labels=None):
        return input_ids


def test_a_complete_model_passes_and_is_a_language_model():
    model = Complete()
    assert isinstance(model, LanguageModel)
    assert check_model(model, "mine") is model
    family = ModelFamily(name="mine", build=lambda config, topology, backend, **stage: Complete(config, **stage))
    built = build_model(family, "cfg", None, None, pre_process=False, post_process=True)
    assert (built.config, built.pre_process, built.post_process) == ("cfg", False, True)
    assert built(torch.ones(1, 2)).shape == (1, 2)


def test_a_family_layer_spec_reaches_build():
    seen = {}

    def build(config, topology, backend, **stage):
        seen.update(stage)
        return Complete(config, stage.get("pre_process", True), stage.get("post_process", True))

    def spec(config, backend):
        return "my layer"

    build_model(ModelFamily(name="mine", build=build, layer_spec=spec), "cfg", None, None, pre_process=True)
    assert seen == {"pre_process": True, "layer_spec": spec}
    seen.clear()
    build_model(ModelFamily(name="plain", build=build), "cfg", None, None)
    assert seen == {}  # a record without a layer spec passes none


def test_a_missing_member_is_named_with_the_family():
    with pytest.raises(PluginError) as err:
        check_model(NoStageMethods(), "parallel_gpt")
    message = str(err.value)
    assert "model family 'parallel_gpt'" in message
    assert "lacks set_input_tensor, compile_units" in message


def test_a_forward_without_the_callers_keywords_is_refused():
    class NarrowForward(Complete):
        def forward(self, input_ids, labels=None):
            return input_ids

    with pytest.raises(PluginError, match="its forward takes no position_ids, inference_context"):
        check_model(NarrowForward(), "narrow")


def test_not_a_module_is_refused():
    with pytest.raises(PluginError, match="it is a dict, not a torch.nn.Module"):
        build_model(ModelFamily(name="d", build=lambda *a, **k: {}), None, None, None)


def test_tag_init_sets_the_kind_and_refuses_unknown_ones():
    param = tag_init(nn.Parameter(torch.empty(2)), "residual_output")
    assert param.init_kind == "residual_output"
    with pytest.raises(PluginError, match="init_kind = 'xavier' is not one of"):
        tag_init(param, "xavier")
