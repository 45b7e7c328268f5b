"""Which sample indices each data-parallel rank reads, resumable from a sample count."""

from __future__ import annotations

from typing import Iterator

from mtl.core.errors import ConfigError


class MicroBatchSampler:
    """Yields this rank's micro-batches of sample indices, in order, from ``consumed_samples``.

    Samples are consumed ``micro_batch_size * dp_size`` at a time; rank r takes the r-th slice
    of each such group. A resumed run that passes the number of samples the whole job has
    consumed continues with exactly the batch that would have come next. A final incomplete
    group is dropped so that every rank takes the same number of steps.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        if total_samples <= 0 or micro_batch_size <= 0 or dp_size <= 0:
            raise ConfigError(f"sampler needs positive total_samples ({total_samples}), "
                              f"micro_batch_size ({micro_batch_size}) and dp_size ({dp_size})")
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        if not 0 <= consumed_samples <= total_samples:
            raise ConfigError(f"consumed_samples {consumed_samples} is outside 0..{total_samples}; "
                              "the checkpoint was written for a larger dataset")
        if consumed_samples % (micro_batch_size * dp_size):
            raise ConfigError(f"consumed_samples {consumed_samples} is not a multiple of "
                              f"micro_batch_size * dp_size = {micro_batch_size * dp_size}")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.dp_size)

    def __iter__(self) -> Iterator[list[int]]:
        group = self.micro_batch_size * self.dp_size
        first = self.dp_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - group + 1, group):
            yield list(range(start + first, start + first + self.micro_batch_size))
