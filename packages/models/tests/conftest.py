"""Fixtures: tiny resolved configs of the two model styles, the local backend, one process."""

import pytest
import torch

from mtl.core.config import RunConfig
from mtl.core.plugins import registry
from mtl.parallel.topology import Topology

GPT2_STYLE = {
    "normalization": "layernorm",
    "activation": "gelu",
    "position_embedding": "learned",
    "bias": True,
    "tie_embeddings": True,
}
LLAMA_STYLE = {
    "normalization": "rmsnorm",
    "activation": "swiglu",
    "position_embedding": "rope",
    "bias": False,
    "tie_embeddings": False,
    "num_query_groups": 2,  # grouped-query attention: 4 heads share 2 K/V heads
    "qk_norm": True,
    "rope_theta": 1000.0,
}
STYLES = {"gpt2": GPT2_STYLE, "llama": LLAMA_STYLE}


def tiny_config(style: str, world_size: int = 1, vocab_size: int = 100, **sections) -> RunConfig:
    """A resolved config of a 2-layer, 32-wide model of ``style``; ``sections`` maps a section
    name to extra overrides (``model={"qk_norm": False}``)."""
    model = dict(STYLES[style], num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    return resolved_config(model, world_size, vocab_size, sections)


def resolved_config(model: dict, world_size: int, vocab_size: int, sections: dict) -> RunConfig:
    """``model`` as the model section, updated by ``sections`` (section name -> overrides), resolved."""
    config = RunConfig()
    overrides = {"model": dict(model)}
    for section, values in sections.items():
        overrides.setdefault(section, {}).update(values)
    for section, values in overrides.items():
        for key, value in values.items():
            setattr(getattr(config, section), key, value)
    return config.resolve(world_size, vocab_size)


@pytest.fixture
def make_config():
    return tiny_config


@pytest.fixture
def backend():
    return registry("backend").get("local")


@pytest.fixture
def single():
    return Topology.single()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


# The hybrid family's tests: a tiny model with every layer kind, 4 SSM heads in 2 groups.
HYBRID_MODEL = {
    "family": "hybrid",
    "hybrid_pattern": "M*M-",
    "num_layers": 4,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "seq_length": 16,
    "mamba_head_dim": 16,
    "mamba_num_groups": 2,
    "mamba_state_dim": 8,
    "mamba_chunk_size": 8,
    "tie_embeddings": False,
}


def hybrid_config(world_size: int = 1, vocab_size: int = 100, **sections) -> RunConfig:
    """Resolved; ``sections`` maps a section name to overrides (``parallel={"tp": 2}``)."""
    return resolved_config(HYBRID_MODEL, world_size, vocab_size, sections)


@pytest.fixture
def make_hybrid_config():
    return hybrid_config
