"""parallel.sharding (ZeRO-0..3), its Megatron spelling distributed_optimizer, and dp_replicate."""

import pytest

from mtl.core.config_io import load_config
from mtl.core.errors import ConfigError

BATCH = ["train.global_batch_size=16", "train.micro_batch_size=2"]


@pytest.mark.parametrize("overrides, sharding, distributed_optimizer", [
    ([], "none", False),
    (["parallel.distributed_optimizer=true"], "optimizer", True),  # Megatron's spelling
    (["parallel.distributed_optimizer=false"], "none", False),
    (["parallel.sharding='optimizer'", "parallel.distributed_optimizer=true"], "optimizer", True),
    (["parallel.sharding='gradients'"], "gradients", True),
    (["parallel.sharding='parameters'", "parallel.dp_replicate=2"], "parameters", True),
])
def test_sharding_derived_from_either_spelling(overrides, sharding, distributed_optimizer):
    p = load_config(None, [*BATCH, *overrides]).resolve(world_size=4, tokenizer_vocab_size=257).parallel
    assert (p.sharding, p.distributed_optimizer) == (sharding, distributed_optimizer)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.sharding='none'", "parallel.distributed_optimizer=true"], "contradicts parallel.sharding = 'none'"),
    (["parallel.sharding='parameters'", "parallel.distributed_optimizer=false"], "drop parallel.distributed_optimizer"),
    (["parallel.sharding='zero3'"], "parallel.sharding = 'zero3' is not one of none, optimizer, gradients, parameters"),
    (["parallel.dp_replicate=0"], "parallel.dp_replicate = 0 must be at least 1"),
    (["parallel.dp_replicate=2"], "dp_replicate = 2 needs parallel.sharding other than 'none'"),
    (["parallel.dp_replicate=3", "parallel.sharding='gradients'"], "must divide dp x cp = 4"),
    (["parallel.dp_replicate=4", "parallel.sharding='gradients'"], "leave groups of at least 2 ranks"),
    (["parallel.dp_replicate=2", "parallel.sharding='parameters'", "parallel.ep=2", "model.num_experts=2"],
     "dp_replicate = 2 does not work with parallel.ep = 2"),
    (["parallel.sharding='parameters'", "parallel.overlap_param_gather=true"], "set it to false"),
    (["parallel.sharding='gradients'", "parallel.overlap_grad_reduce=false"], "overlap_grad_reduce = false does not"),
])
def test_invalid_sharding_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config(None, [*BATCH, *overrides]).resolve(world_size=4, tokenizer_vocab_size=257)
    assert "\n" not in str(error.value)
