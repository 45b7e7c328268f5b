"""The proof that a third party can add a model family: this distribution, installed on its
own, registers ``parallel_gpt`` through its entry point; the family reuses GPTModel with its
own layer; ``--dry-run`` counts its parameters from the model it builds; and it trains at
tp=2 and pp=2 to the losses and gradients of one process, and its checkpoints reshard."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from mtl.core.config_io import load_config
from mtl.core.errors import ConfigError
from mtl.core.model_protocol import INIT_KINDS, LanguageModel, build_model
from mtl.core.plugins import installed_distributions, registry
from mtl.models.generate import generate
from mtl.models.param_layout import parameter_entries
from mtl.parallel.testing import run_distributed
from mtl.parallel.topology import Topology
from mtl.train.testing import LOSS_RTOL, TINY, compare_with_reference, run_layout, run_tiny
from mtl_example_family.parallel_layer import ParallelTransformerLayer

DIST = "mtl-example-family"
FAMILY = ["model.family='parallel_gpt'"]


def resolved(*overrides):
    return load_config(None, [*TINY, *FAMILY, *overrides]).resolve(world_size=1, tokenizer_vocab_size=257)


def build(cfg, **stage):
    return build_model(registry("model family").get("parallel_gpt"), cfg, Topology.single(),
                       registry("backend").get(cfg.model.backend), **stage)


def test_the_distribution_registers_the_family_through_its_entry_point():
    dist = importlib.metadata.distribution(DIST)
    assert {ep.value for ep in dist.entry_points if ep.group == "mtl"} == {"mtl_example_family.plugin"}
    families = registry("model family")
    assert families.entries()["parallel_gpt"].distribution == DIST
    rows = {dist: kinds for dist, _version, kinds in installed_distributions()}
    assert "parallel_gpt" in rows[DIST]["model family"]


def test_the_model_is_gpts_with_the_parallel_layer_and_follows_the_contract():
    cfg = resolved()
    model = build(cfg)
    assert isinstance(model, LanguageModel)
    assert all(type(layer) is ParallelTransformerLayer for layer in model.layers.values())
    assert len(model.compile_units()) == cfg.model.num_layers + 1  # each layer and the final norm
    # every parameter says how it starts: initialisation guesses nothing from this layer's names
    untagged = [e.global_name for e in parameter_entries(model, Topology.single())
                if getattr(e.param, "init_kind", None) not in INIT_KINDS]
    assert untagged == []
    # one norm per layer, not gpt's two: gpt's count less num_layers norms
    gpt = build_model(registry("model family").get("gpt"), cfg, Topology.single(), registry("backend").get("local"))
    norm = count(gpt.layers["0"].pre_mlp_norm)
    assert count(model) == count(gpt) - cfg.model.num_layers * norm > 0


def count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_the_layer_adds_attention_and_mlp_of_one_norm():
    cfg = resolved()
    layer = build(cfg).layers["1"]
    hidden = torch.randn(16, 2, cfg.model.hidden_size)  # [s, b, h]
    normed = layer.input_norm(hidden)
    expected = hidden + layer.self_attention(normed, None) + layer.mlp(normed)
    torch.testing.assert_close(layer(hidden), expected, rtol=0, atol=0)
    assert not torch.allclose(layer(hidden), hidden + layer.self_attention(normed, None))  # the MLP counts


def test_dry_run_counts_the_parameters_of_the_built_model():
    from mtl.cli.dry_run import dry_run

    cfg = load_config(None, [*TINY, *FAMILY])
    out = dry_run(cfg)
    total = count(build(resolved()))  # unique parameters, padded vocabulary rows included
    assert f"parameters: {total:,}" in out.splitlines()
    assert "family 'parallel_gpt'" in out and "ParallelTransformerLayer" in out
    assert "FLOPs per iteration: " in out and "not counted" not in out


def test_kv_cache_generation_equals_recomputing():
    model = build(resolved("model.position_embedding='rope'"))
    cached = generate(model, [5, 9, 17], 6, temperature=0, use_cache=True)
    recomputed = generate(model, [5, 9, 17], 6, temperature=0, use_cache=False)
    assert cached == recomputed and len(cached) == 6


@pytest.fixture(scope="module")
def reference():
    (result,) = run_distributed(run_tiny, 1, args=(FAMILY,))
    return result


@pytest.mark.parametrize("layout", ["tp2", "tp2_sp", "pp2"])
def test_trains_at_tp2_and_pp2_like_one_process(layout, reference):
    """Losses of 3 steps and every gradient (gathered to full shape) within the tolerances of
    mtl's own equivalence tests (mtl.train.testing)."""
    assert sorted(reference["losses"]) == [1, 2, 3]
    assert "layers.0.input_norm.weight" in reference["grads"]
    assert not any("pre_mlp_norm" in name for name in reference["grads"])  # this family's model
    diffs = compare_with_reference(layout, run_layout(layout, extra=FAMILY), reference)
    assert diffs["loss_rel_diff"] < 1e-5


def last_stage_losses(world: int, overrides: list[str]) -> dict[int, float]:
    results = run_distributed(run_tiny, world, args=([*FAMILY, "train.iters=4", *overrides], False))
    return next(r["losses"] for r in results if r["last_stage"])


def test_a_checkpoint_saved_at_tp2_resumes_at_pp2(tmp_path):
    """The checkpoint layout needs nothing from the family beyond the parameters' attributes:
    steps 1-2 at tp=2, saved, then steps 3-4 at pp=2 equal four steps in one process."""
    straight = last_stage_losses(1, [])
    ckpt = f"ckpt.save='{tmp_path / 'ckpt'}'"
    first = last_stage_losses(2, ["parallel.tp=2", ckpt, "train.exit_interval=2"])
    resumed = last_stage_losses(2, ["parallel.pp=2", ckpt])
    assert sorted(first) == [1, 2] and sorted(resumed) == [3, 4]
    for step, loss in {**first, **resumed}.items():
        assert abs(loss - straight[step]) / abs(straight[step]) < LOSS_RTOL, (step, loss, straight[step])


def test_a_config_with_experts_is_refused_by_key():
    """The GPT-J block has one dense MLP: experts would silently be left out."""
    with pytest.raises(ConfigError, match="model.num_experts = 4: the parallel_gpt family"):
        build(resolved("model.num_experts=4", "model.moe_top_k=2", "model.bias=false"))
