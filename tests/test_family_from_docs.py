"""A GPT-J-style model family written from the plugin docs alone (docs/plugin-guide.md).

The layer is a "parallel block": ``x + attn(ln(x)) + mlp(ln(x))`` with one shared input
norm, reusing gpt's attention and MLP specs (and so the backend's leaves) through the layer
spec. It is registered in-process (``register_plugin``) and trained for 3 steps at one
process, tp=2 with sequence parallelism and pp=2 (gloo, spawned processes); the losses must
equal one process's.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.hookspecs import hookimpl
from mtl.core.spec import ModuleSpec, build_module
from mtl.models.gpt.family import gpt_like_family
from mtl.models.gpt.layer_spec import layer_spec as gpt_layer_spec
from mtl.models.gpt.transformer_layer import sequence_parallel_norm_kwargs

FAMILY = "gptj_from_docs"
STEPS = 3


# ----------------------------------------------------------------------------- the family


@dataclass(frozen=True)
class ParallelLayerSubmodules:
    input_norm: object
    self_attention: object
    mlp: object


class ParallelLayer(nn.Module):
    """GPT-J block: ``hidden + attention(norm(hidden)) + mlp(norm(hidden))``."""

    def __init__(self, *, layer_number, topology, submodules, hidden_dropout=0.0,
                 sequence_parallel=False):
        super().__init__()
        self.layer_number = layer_number
        self.hidden_dropout = hidden_dropout
        self.input_norm = build_module(
            submodules.input_norm, **sequence_parallel_norm_kwargs(sequence_parallel, topology))
        self.self_attention = build_module(
            submodules.self_attention, layer_number=layer_number, topology=topology)
        self.mlp = build_module(submodules.mlp, topology=topology)

    def forward(self, hidden, rotary=None, inference_context=None):
        normed = self.input_norm(hidden)
        attn = self.self_attention(normed, rotary, inference_context)
        mlp = self.mlp(normed)
        p = self.hidden_dropout if self.training else 0.0
        return hidden + F.dropout(attn, p) + F.dropout(mlp, p)


def parallel_layer_spec(config, backend):
    # One norm feeds two consumers: ask gpt's spec for the unfused leaves (plugin guide).
    unfused = dataclasses.replace(backend, norm_column_linear=None, norm_mlp=None)
    gpt = gpt_layer_spec(config, unfused)
    return ModuleSpec(
        ParallelLayer,
        {"hidden_dropout": gpt.params["hidden_dropout"],
         "sequence_parallel": gpt.params["sequence_parallel"]},
        ParallelLayerSubmodules(
            input_norm=gpt.submodules.input_norm,
            self_attention=gpt.submodules.self_attention,
            mlp=gpt.submodules.mlp,
        ),
    )


GPTJ_FAMILY = gpt_like_family(FAMILY, parallel_layer_spec,
                              description="GPT-J parallel block (written from the docs)")


@hookimpl
def mtl_model_families():
    return [GPTJ_FAMILY]


def register():
    from mtl.core.plugins import register_plugin

    register_plugin(sys.modules[__name__])  # a second call in the same process does nothing


# ----------------------------------------------------------------------------- training


CONFIG = """
[model]
family = "{family}"
num_layers = 4
hidden_size = 32
num_attention_heads = 4
seq_length = 16
init_std = 0.1

[parallel]
tp = {tp}
pp = {pp}
sequence_parallel = {sp}

[data]
tokenizer = "byte"
dataset = "mock"
mock_num_samples = 256

[train]
micro_batch_size = 2
global_batch_size = 4
iters = {steps}
device = "cpu"
eval_interval = 0

[logging]
dir = "{logdir}"
progress = "none"
"""


def train_losses(tmpdir, family, tp=1, pp=1, sp=False):
    """Runs in each process (and in the pytest process for one process)."""
    from mtl.core.config_io import load_config
    from mtl.train.loop import train

    register()
    path = Path(tmpdir) / f"{family}_tp{tp}_pp{pp}_sp{int(sp)}.toml"
    path.write_text(CONFIG.format(family=family, tp=tp, pp=pp, sp=str(sp).lower(), steps=STEPS,
                                  logdir=Path(tmpdir) / f"logs_{family}_{tp}_{pp}_{int(sp)}"))
    result = train(load_config(str(path), []))
    return {int(k): float(v) for k, v in dict(result.losses).items()}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return train_losses(str(tmp_path_factory.mktemp("one")), FAMILY)


def test_one_process_trains(single):
    assert sorted(single) == list(range(1, STEPS + 1)), single
    assert all(torch.isfinite(torch.tensor(v)) for v in single.values())


def test_is_a_parallel_block(single, tmp_path):
    from mtl.core.config_io import load_config
    from mtl.core.model_protocol import build_model
    from mtl.core.plugins import registry
    from mtl.parallel.topology import Topology

    register()
    path = tmp_path / "c.toml"
    path.write_text(CONFIG.format(family=FAMILY, tp=1, pp=1, sp="false", steps=STEPS,
                                  logdir=tmp_path / "logs"))
    config = load_config(str(path), []).resolve(world_size=1, tokenizer_vocab_size=257)
    family = registry("model family").get(FAMILY)
    backend = registry("backend").get(config.model.backend)
    with torch.device("meta"):
        model = build_model(family, config, Topology.single(), backend)
    layers = [m for m in model.modules() if isinstance(m, ParallelLayer)]
    assert len(layers) == 4
    with torch.device("meta"):
        gpt_model = build_model(registry("model family").get("gpt"), config, Topology.single(),
                                backend)
    names = [n for n, _ in model.named_parameters()]
    gpt_names = [n for n, _ in gpt_model.named_parameters()]
    for i in range(4):
        # one input norm per layer, and no pre-MLP norm (which gpt's layer has)
        assert any(n.startswith(f"layers.{i}.input_norm.") for n in names), names
        assert not any(n.startswith(f"layers.{i}.pre_mlp_norm.") for n in names), names
        assert any(n.startswith(f"layers.{i}.pre_mlp_norm.") for n in gpt_names), gpt_names
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in gpt_model.parameters())
    # And the same config in gpt's (sequential) family trains to other losses.
    gpt = train_losses(str(tmp_path), "gpt")
    assert max(abs(gpt[k] - single[k]) / single[k] for k in single) > 1e-3, (gpt, single)


@pytest.mark.parametrize("tp,pp,sp", [(2, 1, True), (1, 2, False)], ids=["tp2_sp", "pp2"])
def test_layouts_equal_one_process(single, tmp_path, tp, pp, sp):
    from mtl.parallel.testing import run_distributed

    results = run_distributed(train_losses, 2, args=(str(tmp_path), FAMILY, tp, pp, sp))
    # The last pipeline stage computes the loss; at pp=2 the first stage's steps hold NaN.
    last_stage = results[-tp:]
    for got in last_stage:
        assert sorted(got) == sorted(single)
        for step, want in single.items():
            assert got[step] == pytest.approx(want, rel=1e-5), (step, got, single)
