import pytest

from mtl.core.errors import ConfigError
from mtl.data.sampler import MicroBatchSampler


def test_ranks_partition_each_global_batch_and_resume_continues_exactly():
    total, mbs, dp = 50, 3, 2
    full = [list(MicroBatchSampler(total, 0, mbs, r, dp)) for r in range(dp)]
    assert len(full[0]) == len(full[1]) == total // (mbs * dp) == 8
    step_samples = [sorted(full[0][s] + full[1][s]) for s in range(8)]
    assert step_samples == [list(range(6 * s, 6 * s + 6)) for s in range(8)]
    # stop after 3 steps, resume with the consumed count: the same remaining batches
    for r in range(dp):
        resumed = list(MicroBatchSampler(total, 3 * mbs * dp, mbs, r, dp))
        assert resumed == full[r][3:]


def test_bad_arguments():
    with pytest.raises(ConfigError, match="dp_rank 2"):
        MicroBatchSampler(10, 0, 1, 2, 2)
    with pytest.raises(ConfigError, match="not a multiple"):
        MicroBatchSampler(10, 3, 2, 0, 1)
    with pytest.raises(ConfigError, match="consumed_samples 12"):
        MicroBatchSampler(10, 12, 2, 0, 1)
