"""The gpt family is found through the entry point, like a third-party family would be."""

import pytest
import torch

from mtl.core.config import RunConfig
from mtl.core.errors import ConfigError
from mtl.core.plugins import registry
from mtl.models.convert_hf import HFConverter
from mtl.models.gpt import GPTModel


def test_registered_family_builds_a_model(make_config, backend, single):
    family = registry("model family").get("gpt")
    assert isinstance(family.converters["hf"], HFConverter)
    model = family.build(make_config("llama"), single, backend)
    assert isinstance(model, GPTModel)
    assert model(torch.randint(0, 100, (1, 4))).shape == (1, 4, 128)


def test_unresolved_config_is_refused(backend, single):
    with pytest.raises(ConfigError, match="resolved config"):
        registry("model family").get("gpt").build(RunConfig(), single, backend)
