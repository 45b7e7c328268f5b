"""Family-independent counts: parameters per component of a built module, memory per GPU."""

import pytest
import torch
from torch import nn

from mtl.core.config_io import load_config
from mtl.core.flops import memory_per_gpu_bytes, parameter_counts


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 4)  # 40
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # 2 * 20
        self.output_layer = nn.Linear(4, 10, bias=False)
        self.output_layer.weight = self.embedding.weight  # tied: counted under embedding
        self.scale = nn.Parameter(torch.ones(3))  # held by the model itself


def test_parameter_counts_count_each_tensor_once_per_component():
    model = Tied()
    counts = parameter_counts(model)
    assert counts == {"embedding": 40, "layers": 40, "output_layer": 0, "(model)": 3, "total": 83}
    assert counts["total"] == sum(p.numel() for p in model.parameters())


def test_parameter_counts_on_the_meta_device():
    with torch.device("meta"):
        model = Tied()
    assert parameter_counts(model)["total"] == 83


def config(*overrides):
    return load_config(None, ["model.num_layers=8", "train.micro_batch_size=2", "train.global_batch_size=16",
                              *overrides]).resolve(world_size=4, tokenizer_vocab_size=1000)


def test_memory_splits_weights_over_tp_pp_and_adam_over_dp_with_the_distributed_optimizer():
    cfg = config("parallel.tp=2", "parallel.pp=2", "train.precision='bf16'", "parallel.distributed_optimizer=true",
                 "parallel.pipeline_split='even'")
    mem = memory_per_gpu_bytes(cfg, 4_000_000, activation_bytes_per_layer=1000.0)
    assert mem["weights"] == 1_000_000 * 2  # the bf16 weights of a quarter of the model
    assert mem["grads"] == 1_000_000 * 4
    assert mem["optimizer"] == 1_000_000 * 12  # fp32 main weights and moments; dp = 1: nothing to shard over
    assert mem["activations"] == 1000.0 * (8 / 2) * 2  # layers on a stage x micro-batches in flight
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")


def test_activations_follow_the_pipeline_split():
    """Rank r keeps up to pp - r micro-batches in flight: 8 layers as 3 + 5 keep 3 x 2 on rank 0
    and 5 x 1 on rank 1; as 5 + 3, 5 x 2 on rank 0."""
    for split, kept in (("[3, 5]", 6), ("[5, 3]", 10)):
        cfg = config("parallel.pp=2", f"parallel.virtual_stage_layers={split}")
        assert memory_per_gpu_bytes(cfg, 4_000_000, activation_bytes_per_layer=1000.0)["activations"] == 1000.0 * kept


def test_activations_per_layer_sum_each_ranks_own_layers():
    """One number per layer (a hybrid family's): 8 layers as 3 + 5, layer i keeping 100 * (i + 1)
    bytes: rank 0 keeps (100 + 200 + 300) x 2 micro-batches, rank 1 (400 + ... + 800) x 1."""
    cfg = config("parallel.pp=2", "parallel.virtual_stage_layers=[3, 5]")
    per_layer = [100.0 * (i + 1) for i in range(8)]
    assert memory_per_gpu_bytes(cfg, 4_000_000, activation_bytes_per_layer=per_layer)["activations"] == 3000.0


def test_memory_without_an_activation_formula_leaves_activations_out():
    cfg = config("parallel.distributed_optimizer=true")  # dp = 4
    mem = memory_per_gpu_bytes(cfg, 1000, activation_bytes_per_layer=None)
    assert "activations" not in mem
    assert mem == {"weights": 4000, "grads": 4000, "optimizer": 2000, "total": 10000}


def test_memory_splits_expert_parameters_over_ep_too():
    """Expert parameters live on 1/ep of the data-parallel ranks, and the distributed optimizer
    shards their state over the dp / ep ranks holding the same experts."""
    cfg = config("model.num_experts=4", "model.bias=false", "parallel.ep=2", "parallel.distributed_optimizer=true")
    mem = memory_per_gpu_bytes(cfg, 3000, activation_bytes_per_layer=None, num_expert_parameters=2000)
    params = 1000 + 2000 / 2  # dp = 4, ep = 2: half the experts on each rank
    assert mem["weights"] == params * 4 and mem["grads"] == params * 4
    assert mem["optimizer"] == 1000 * 8 / 4 + 1000 * 8 / 2  # dense over dp = 4, experts over dp / ep = 2


@pytest.mark.parametrize("sharding, weights, grads, optimizer", [
    ("none", 8000, 16000, 48000),  # bf16 weights, fp32 grads, fp32 main weights + 2 moments, 4000 parameters
    ("optimizer", 8000, 16000, 12000),
    ("gradients", 8000, 4000 + (2 * 300 + 200) * 4, 12000),  # + two layers' buckets and what is outside
    ("parameters", 2000 + (2 * 300 + 200) * 2, 4000 + (2 * 300 + 200) * 4, 12000),  # + two layers and the outside
])
def test_memory_follows_the_sharding(sharding, weights, grads, optimizer):
    cfg = config("train.precision='bf16'", f"parallel.sharding='{sharding}'")  # dp = 4
    mem = memory_per_gpu_bytes(cfg, 4000, activation_bytes_per_layer=None, unit_parameters=(300, 0, 200))
    assert (mem["weights"], mem["grads"], mem["optimizer"]) == (weights, grads, optimizer)


def test_zero3_holds_one_vocabulary_table_whole_not_both():
    """Embedding and head as units of their own (1000 each, layers of 300): held whole are the
    largest unit and a layer (weights), the table's gradient and a layer's bucket (grads)."""
    cfg = config("train.precision='bf16'", "parallel.sharding='parameters'")
    mem = memory_per_gpu_bytes(cfg, 4000, activation_bytes_per_layer=None, unit_parameters=(300, 1000, 0))
    assert (mem["weights"], mem["grads"]) == (2000 + (1000 + 300) * 2, 4000 + (1000 + 300) * 4)
    before = memory_per_gpu_bytes(cfg, 4000, activation_bytes_per_layer=None, unit_parameters=(300, 0, 2000))
    assert before["weights"] - mem["weights"] == (1000 + 300) * 2  # the other table, and the second layer


def test_zero3_gathers_a_unit_whole_on_its_pipeline_stage():
    """Under pp a unit still sits whole on one stage: tp splits what is gathered, pp does not
    (dp = 2 x pp = 2; 4000 parameters, a 1000-parameter table, layers of 300)."""
    cfg = config("train.precision='bf16'", "parallel.sharding='parameters'", "parallel.pp=2",
                 "parallel.pipeline_split='even'")
    mem = memory_per_gpu_bytes(cfg, 4000, activation_bytes_per_layer=None, unit_parameters=(300, 1000, 0))
    assert mem["weights"] == 4000 / 2 / 2 * 2 + (1000 + 300) * 2  # the shards of the stage's half, then whole units


def test_hybrid_sharding_divides_by_the_shard_block_only():
    cfg = config("parallel.sharding='parameters'", "parallel.dp_replicate=2")  # dp = 4: blocks of 2, fp32 weights
    mem = memory_per_gpu_bytes(cfg, 4000, activation_bytes_per_layer=None)
    assert (mem["weights"], mem["grads"], mem["optimizer"]) == (8000, 8000, 16000)
