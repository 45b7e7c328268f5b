"""ShardedTensor validation, state flattening, and the gathered layout checks."""

import pytest
import torch

from mtl.ckpt.layout import ShardRecord, plan_layout
from mtl.ckpt.sharded import ShardedTensor, common_state, flatten_state
from mtl.core.errors import CheckpointError


def rec(key, offset, shape, rank, global_shape=(4, 6), replica_id=0, dtype="float32"):
    return ShardRecord(key, dtype, global_shape, offset, shape, replica_id, rank)


def test_sharded_tensor_rejects_slice_outside_global_shape():
    with pytest.raises(CheckpointError, match=r"'w'.*dim 0 slice \[2, 5\).*global size 4"):
        ShardedTensor("w", torch.zeros(3, 2), (4, 2), (2, 0))


def test_sharded_tensor_rejects_rank_mismatch_and_bad_key():
    with pytest.raises(CheckpointError, match="one entry per dimension"):
        ShardedTensor("w", torch.zeros(3), (3, 1), (0, 0))
    with pytest.raises(CheckpointError, match="not usable"):
        ShardedTensor("", torch.zeros(3), (3,), (0,))


def test_from_split_gives_offsets_and_replicas():
    part = ShardedTensor.from_split("w", torch.zeros(2, 3), split_dim=1, rank=2, world=4)
    assert part.global_shape == (2, 12) and part.global_offset == (0, 6) and part.replica_id == 0
    rep = ShardedTensor.from_split("b", torch.zeros(3), split_dim=None, rank=1, world=4)
    assert rep.global_shape == (3,) and rep.replica_id == 1


def test_flatten_state_paths_and_duplicate_keys():
    a = ShardedTensor("a", torch.zeros(2), (2,), (0,))
    b = ShardedTensor("b", torch.zeros(2), (2,), (0,))
    flat = flatten_state({"model": {"layers": [a, b]}, "step": 3})
    assert flat == {"model.layers.0": a, "model.layers.1": b}
    with pytest.raises(CheckpointError, match="'a' at offset \\(0,\\) appears twice.*'x'.*'y'"):
        flatten_state({"x": a, "y": ShardedTensor("a", torch.zeros(2), (2,), (0,))})
    # two boxes of one key (pieces of a flat range) are fine
    left, right = ShardedTensor("c", torch.zeros(2), (4,), (0,)), ShardedTensor("c", torch.zeros(2), (4,), (2,))
    assert flatten_state({"x": left, "y": right}) == {"x": left, "y": right}


def test_common_state_refuses_plain_tensors_and_objects():
    with pytest.raises(CheckpointError, match="'opt.m' is a plain torch.Tensor"):
        common_state({"opt": {"m": torch.zeros(2)}})
    with pytest.raises(CheckpointError, match="'x' has type set"):
        common_state({"x": {1, 2}})


def test_layout_uniform_shards_use_shard_shape_as_chunk():
    layouts = plan_layout([rec("w", (0, 0), (2, 6), 0), rec("w", (2, 0), (2, 6), 1), rec("w", (0, 0), (2, 6), 2, replica_id=1)])
    assert layouts["w"].chunk_shape == (2, 6)
    assert [r.rank for r in layouts["w"].writers] == [0, 1]


def test_layout_uneven_shards_use_gcd_of_boundaries():
    layouts = plan_layout([rec("w", (0, 0), (4, 2), 0), rec("w", (0, 2), (4, 4), 1)])
    assert layouts["w"].chunk_shape == (4, 2)  # boundaries at 0, 2, 6 -> gcd 2; rows 0,4 -> 4


def test_layout_shard_cut_short_by_the_tensor_end_keeps_the_shard_chunk():
    """A vocabulary of 257 rows at tp=2: rank 1's slice holds one real row (the rest is
    padding). Chunks stay 256 rows: the gcd of the boundaries would be one row per chunk."""
    layouts = plan_layout([rec("e", (0, 0), (256, 8), 0, global_shape=(257, 8)),
                           rec("e", (256, 0), (1, 8), 1, global_shape=(257, 8))])
    assert layouts["e"].chunk_shape == (256, 8)


def test_layout_detects_overlap_gap_and_disagreement():
    with pytest.raises(CheckpointError, match="'w': shards overlap.*rank 0.*rank 1"):
        plan_layout([rec("w", (0, 0), (3, 6), 0), rec("w", (2, 0), (2, 6), 1)])
    with pytest.raises(CheckpointError, match="'w'.*cover 12 of 24 elements"):
        plan_layout([rec("w", (0, 0), (2, 6), 0), rec("w", (2, 0), (2, 6), 1, replica_id=1)])
    with pytest.raises(CheckpointError, match=r"'w'.*rank 0 says global shape \(4, 6\) but rank 1 says \(4, 7\)"):
        plan_layout([rec("w", (0, 0), (2, 6), 0), rec("w", (2, 0), (2, 6), 1, global_shape=(4, 7))])
    with pytest.raises(CheckpointError, match="'w'.*float32 but rank 1 holds bfloat16"):
        plan_layout([rec("w", (0, 0), (2, 6), 0), rec("w", (2, 0), (2, 6), 1, dtype="bfloat16")])
    with pytest.raises(CheckpointError, match="'w'.*no rank writes that exact slice"):
        plan_layout([rec("w", (0, 0), (4, 6), 0), rec("w", (0, 0), (2, 6), 1, replica_id=1)])
