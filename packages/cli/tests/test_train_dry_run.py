"""``mtl train --dry-run``: a summary (model, parameters, FLOPs, layout, memory) first, then the
module tree with parameter counts, then the resolved config."""

import re

import pytest
import torch

from mtl.core.config_io import load_config
from mtl.core.plugins import registry
from mtl.models.gpt.flops import flops_per_iteration
from mtl.parallel.topology import Topology

H, L, S, V_PADDED, FFN = 32, 2, 16, 384, 128  # the byte tokenizer's 257 ids pad to 384
EMBEDDING = V_PADDED * H + S * H  # word + learned position embeddings
LAYER = (2 * H                      # input LayerNorm
         + H * 3 * H + 3 * H        # fused QKV with bias
         + H * H + H                # attention output projection
         + 2 * H                    # pre-MLP LayerNorm
         + H * FFN + FFN            # fc1
         + FFN * H + H)             # fc2
TOTAL = EMBEDDING + L * LAYER + 2 * H  # + final LayerNorm; the output layer is tied


def built_parameter_count(path, overrides=()) -> int:
    cfg = load_config(path, overrides).resolve(world_size=1, tokenizer_vocab_size=257)
    with torch.device("meta"):
        model = registry("model family").get("gpt").build(cfg, Topology.single(), registry("backend").get("local"))
    return sum(p.numel() for p in model.parameters())


def test_dry_run_shows_config_tree_flops_and_memory_and_trains_nothing(mtl, ok, tiny_toml, workdir):
    out = ok(mtl("train", tiny_toml, "--dry-run"))
    # the resolved config, derived values included
    for line in ("hidden_size = 32", "num_layers = 2", "ffn_hidden_size = 128", "vocab_size = 257",
                 "padded_vocab_size = 384", 'dataset = "mock"', "dp = 1", "num_micro_batches = 2"):
        assert line in out.splitlines(), line
    # the module tree and the per-component counts agree with a model built the same way
    assert TOTAL == built_parameter_count(tiny_toml) == 38_272
    assert f"model (GPTModel): {TOTAL:,}" in out
    assert f"embedding (GPTEmbedding): {EMBEDDING:,}" in out
    assert f"layers (TransformerBlock): {L * LAYER:,}" in out
    assert f"2 x TransformerLayer, {LAYER:,} each" in out
    assert re.search(r"output_layer \(\w+\): [\d,]+ \(shared", out)  # tied: not counted twice
    components = dict(re.findall(r"^\s*(\w+): ([\d,]+)$",
                                 out.split("# parameters per component")[1].split("# resolved config")[0],
                                 re.MULTILINE))
    assert int(components["total"].replace(",", "")) == TOTAL
    assert sum(int(v.replace(",", "")) for k, v in components.items() if k != "total") == TOTAL
    assert f"parameters: {TOTAL:,}" in out.splitlines()
    # FLOPs per iteration as the gpt family counts them, and memory in readable units
    cfg = load_config(tiny_toml).resolve(world_size=1, tokenizer_vocab_size=257)
    assert f"FLOPs per iteration: {flops_per_iteration(cfg):.4e}" in out
    assert "world size 1: tp 1 x pp 1 x cp 1 x dp 1; 2 micro-batches of 2 per step" in out
    # a CPU run: each process's memory (there is no GPU)
    memory = re.search(r"estimated memory per process: weights (.+?), grads .*total (\d+\.\d+ \w+)$", out,
                       re.MULTILINE)
    assert memory, out
    assert memory.group(1) == f"{TOTAL * 4 / 1024:.2f} KiB"  # fp32 weights: 4 bytes each
    assert "None" not in out.split("# resolved config")[0]
    # nothing ran: no checkpoint, no logs
    assert not (workdir / "ckpt").exists() and not (workdir / "logs").exists()
    assert "step " not in out and "| loss" not in out


def test_dry_run_leads_with_the_summary_and_ends_with_the_config(mtl, ok, tiny_toml):
    out = ok(mtl("train", tiny_toml, "--dry-run"))
    lines = out.splitlines()
    assert lines[0] == "# summary"
    assert lines[1].startswith("model: GPTModel of family 'gpt', backend 'local', 2 layers, hidden 32")
    summary = out.split("\n\n")[0]
    for head in (f"parameters: {TOTAL:,}", "FLOPs per iteration: ", "world size 1: ", "estimated memory per process: "):
        assert head in summary, head
    sections = [line for line in lines if line.startswith("# ") and " = " not in line]  # not a config comment
    assert sections == ["# summary", "# model (whole model, one process; family 'gpt')", "# parameters per component",
                        "# resolved config"]
    assert lines[-1] in out.split("# resolved config")[1] and "[logging]" in out.split("# resolved config")[1]
    # a CUDA run's estimate is per GPU
    cuda = ok(mtl("train", tiny_toml, "--dry-run", "--set", "train.device='cuda'"))
    assert "estimated memory per GPU: " in cuda and "per process" not in cuda


def test_flops_scale_with_the_global_batch(mtl, ok, tiny_toml):
    def flops(*sets):
        out = ok(mtl("train", tiny_toml, "--dry-run", *sets))
        return float(re.search(r"FLOPs per iteration: (\S+)", out).group(1))

    assert flops("--set", "train.global_batch_size=8") == 2 * flops()


def test_dry_run_shows_each_pipeline_rank_s_share_of_the_flops(mtl, ok, tiny_toml):
    """At pp > 1 the last rank also runs the LM head; ``parallel.virtual_stage_layers`` moves
    layers to balance it (the split by FLOPs is off here, so that the counts are the ones given). By hand (4 layers, 64 tokens per iteration, 3 x 2 FLOPs per
    multiply-add): a layer's QKV, scores, projection and GELU MLP 3 * 64 * 25,600 = 4,915,200;
    the head 3 * 64 * 2 * 32 * 384 = 4,718,592; in all 24,379,392."""
    layer, head = 3 * 64 * 25_600, 3 * 64 * 2 * H * V_PADDED
    total = 4 * layer + head

    def shares(*sets):
        out = ok(mtl("train", tiny_toml, "--dry-run", "--set", "model.num_layers=4", "--set", "parallel.pp=2",
                     "--set", "parallel.pipeline_split=even", *sets))
        assert f"FLOPs per iteration: {total:.4e}" in out
        return re.search(r"^pipeline ranks' share of the FLOPs \(the busiest sets the step\): (.*)$", out,
                         re.MULTILINE).group(1)

    even = (f"rank 0 {100 * 2 * layer / total:.1f}% (2 layers), "
            f"rank 1 {100 * (2 * layer + head) / total:.1f}% (2 layers + LM head)")
    assert shares() == even == "rank 0 40.3% (2 layers), rank 1 59.7% (2 layers + LM head)"
    moved = shares("--set", "parallel.virtual_stage_layers=[3, 1]")
    assert moved == "rank 0 60.5% (3 layers), rank 1 39.5% (1 layer + LM head)"
    out = ok(mtl("train", tiny_toml, "--dry-run"))
    assert "pipeline ranks" not in out  # one stage: nothing to balance


def test_pipeline_split_by_flops_moves_a_layer_only_where_it_pays(mtl, ok, tiny_toml):
    """``parallel.pipeline_split = 'flops'`` derives the split the dry run shows. Here the head
    is 0.96 of a layer: 4 layers stay 2 + 2 (3 + 1 would make rank 0 the busier, 60.5% against
    59.7%), and 5 layers, which do not split evenly, go 3 + 2 (rank 1: 2 layers + the head)."""
    def run(layers):
        return ok(mtl("train", tiny_toml, "--dry-run", "--set", f"model.num_layers={layers}", "--set", "parallel.pp=2",
                      "--set", "parallel.pipeline_split=flops"))

    four = run(4)
    assert "virtual_stage_layers = [2, 2]" in four.splitlines()
    assert "rank 0 40.3% (2 layers), rank 1 59.7% (2 layers + LM head)" in four
    five = run(5)
    assert "virtual_stage_layers = [3, 2]" in five.splitlines()
    assert "rank 0 50.3% (3 layers), rank 1 49.7% (2 layers + LM head)" in five


def test_dry_run_pipeline_shares_follow_the_virtual_stages(mtl, ok, tiny_toml):
    """Interleaved, rank r holds virtual stages r, r + pp, ...: 5 layers as 1, 2, 1, 1 put 2
    layers on rank 0 (stages 0 and 2) and 3 and the head on rank 1 (stages 1 and 3); in an MoE
    model each rank sums its own layers' counts (layers 0 and 2 MoE, 1 and 3 dense)."""
    layer, head = 3 * 64 * 25_600, 3 * 64 * 2 * H * V_PADDED
    total = 5 * layer + head
    out = ok(mtl("train", tiny_toml, "--dry-run", "--set", "model.num_layers=5", "--set", "parallel.pp=2",
                 "--set", "parallel.vpp=2", "--set", "parallel.virtual_stage_layers=[1, 2, 1, 1]"))
    assert (f"rank 0 {100 * 2 * layer / total:.1f}% (2 layers), "
            f"rank 1 {100 * (3 * layer + head) / total:.1f}% (3 layers + LM head)") in out

    from mtl.models.gpt.flops import flops_per_iteration, layer_flops_per_iteration

    moe = ["model.num_layers=4", "parallel.pp=2", "parallel.virtual_stage_layers=[1, 3]", *MOE_SETS]
    cfg = load_config(tiny_toml, moe).resolve(world_size=2, tokenizer_vocab_size=257)
    per_layer, total = layer_flops_per_iteration(cfg), flops_per_iteration(cfg)
    assert cfg.model.moe_layers == [0, 2] and per_layer[0] == per_layer[2] != per_layer[1] == per_layer[3]
    rank0 = per_layer[0]
    out = ok(mtl("train", tiny_toml, "--dry-run", *[arg for key in moe for arg in ("--set", key)]))
    assert (f"rank 0 {100 * rank0 / total:.1f}% (1 layer), "
            f"rank 1 {100 * (total - rank0) / total:.1f}% (3 layers + LM head)") in out


def test_set_overrides_show_in_the_dry_run(mtl, ok, tiny_toml):
    out = ok(mtl("train", tiny_toml, "--dry-run", "--set", "model.hidden_size=48",
                 "--set", "logging.dir=runs/not-toml", "--set", "train.lr=2e-4"))
    lines = out.splitlines()
    assert "hidden_size = 48" in lines and "head_dim = 12" in lines  # derived from the override
    assert 'dir = "runs/not-toml"' in lines  # not TOML: taken as a bare string
    assert "lr = 0.0002" in lines
    total = built_parameter_count(tiny_toml, ["model.hidden_size=48"])
    assert f"model (GPTModel): {total:,}" in out and total != TOTAL


def test_dry_run_without_a_config_file_uses_the_defaults(mtl, ok, workdir):
    out = ok(mtl("train", "--dry-run", "--set", "model.num_layers=1"))
    assert "num_layers = 1" in out.splitlines() and "1 x TransformerLayer" not in out
    assert "FLOPs per iteration" in out


def test_a_family_without_a_flop_count_still_dry_runs(mtl, ok, clean_error, tiny_toml):
    """FLOPs are the family's: a family record without ``flops_per_iteration`` says so, and
    its parameters are still counted from the model it builds; stages sized by FLOPs are
    refused for it, naming the family and the fix."""
    from dataclasses import replace

    from mtl.core.hookspecs import hookimpl
    from mtl.core.plugins import register_plugin, unregister_plugin

    uncounted = replace(registry("model family").get("gpt"), name="gpt_uncounted",
                        flops_per_iteration=None, activation_bytes_per_layer=None)

    class Plugin:
        @hookimpl
        def mtl_model_families(self):
            return [uncounted]

    plugin = Plugin()
    register_plugin(plugin)
    try:
        out = ok(mtl("train", tiny_toml, "--dry-run", "--set", "model.family='gpt_uncounted'"))
    finally:
        unregister_plugin(plugin)
    assert "FLOPs per iteration: not counted (model family 'gpt_uncounted' gives no flops_per_iteration)" in out
    assert f"parameters: {TOTAL:,}" in out.splitlines()
    assert "activations" not in out.split("estimated memory per process:")[1].splitlines()[0]
    register_plugin(plugin)
    try:
        result = mtl("train", tiny_toml, "--dry-run", "--set", "model.family='gpt_uncounted'", "--set", "parallel.pp=2",
                     "--set", "parallel.pipeline_split=flops")
    finally:
        unregister_plugin(plugin)
    clean_error(result, "parallel.pipeline_split = 'flops' needs the FLOPs of each layer of model family "
                        "'gpt_uncounted'", "set parallel.virtual_stage_layers by hand, or pipeline_split = 'even'")


MOE_SETS = ("model.bias=false", "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=16",
            "model.moe_shared_expert_ffn_hidden_size=24", "model.moe_shared_expert_gate=true",
            "model.moe_layer_freq=2")  # layer 0 MoE, layer 1 dense


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_dry_run_counts_an_moe_model_as_built(mtl, ok, tiny_toml, activation):
    """``parameters:`` for an MoE model is ``sum(p.numel())`` of the model the gpt family
    builds: router, the stacked ``[E, ...]`` experts, shared expert and its gate."""
    sets = (*MOE_SETS, f"model.activation={activation}")
    out = ok(mtl("train", tiny_toml, "--dry-run", *[arg for s in sets for arg in ("--set", s)]))
    total = built_parameter_count(tiny_toml, sets)
    assert f"parameters: {total:,}" in out.splitlines()
    assert f"model (GPTModel): {total:,}" in out
    # the MoE layer by hand: its MLP slot differs from the dense layer's by exactly this
    gated = 2 if activation == "swiglu" else 1
    cfg = load_config(tiny_toml, sets).resolve(world_size=1, tokenizer_vocab_size=257)
    moe = (4 * H                               # router [E, h]
           + 4 * (gated * 16 * H + H * 16)     # experts fc1 [E, (2,) ffn, h] and fc2 [E, h, ffn]
           + gated * 24 * H + 24 * H           # shared expert (no biases)
           + H)                                # its sigmoid gate [1, h]
    dense = gated * cfg.model.ffn_hidden_size * H + cfg.model.ffn_hidden_size * H
    assert re.search(rf"^\s+mlp \(MoELayer\): {moe:,}$", out, re.MULTILINE), out
    assert re.search(rf"^\s+mlp \(MLP\): {dense:,}$", out, re.MULTILINE), out
