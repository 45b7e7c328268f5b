import pytest
import torch

from mtl.core.config import RunConfig
from mtl.core.plugins import registry
from mtl.parallel.topology import Topology


def tiny_config(world_size: int = 1, vocab_size: int = 100, **sections) -> RunConfig:
    """A resolved config of a tiny model; ``sections`` maps a section name to its overrides."""
    config = RunConfig()
    config.model.num_layers = 2
    config.model.hidden_size = 32
    config.model.num_attention_heads = 4
    config.model.seq_length = 16
    for section, overrides in sections.items():
        for key, value in overrides.items():
            setattr(getattr(config, section), key, value)
    return config.resolve(world_size, vocab_size)


@pytest.fixture
def backend():
    return registry("backend").get("local")


@pytest.fixture
def single():
    return Topology.single()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
