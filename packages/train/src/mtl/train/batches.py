"""Micro-batches for this rank: the data-parallel slice of each global batch, split for
context parallelism, with position ids, on the training device."""

from __future__ import annotations

from typing import Iterator

import torch

from mtl.core.config import RunConfig
from mtl.data.sampler import MicroBatchSampler
from mtl.parallel.topology import Topology


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}


class MicroBatches:
    """Iterates micro-batches of ``dataset`` from ``consumed_samples`` on; every pipeline stage
    of a data-parallel rank reads the same micro-batches (first stage: tokens; last: labels)."""

    def __init__(self, dataset, config: RunConfig, topology: Topology, device: torch.device,
                 consumed_samples: int = 0):
        self.dataset = dataset
        self.config = config
        self.topology = topology
        self.device = device
        self.sampler = MicroBatchSampler(
            total_samples=len(dataset),
            consumed_samples=consumed_samples,
            micro_batch_size=config.train.micro_batch_size,
            dp_rank=topology.dp_rank,
            dp_size=topology.dp,
        )
        self._indices = iter(self.sampler)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        indices = next(self._indices)
        batch = collate([self.dataset[i] for i in indices])
        # per-token fields are [b, s] (gpt's tokens, BERT's text, ...); per-sample ones [b] (is_random)
        tokens = next(v for v in batch.values() if v.dim() == 2)
        batch["position_ids"] = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        if self.topology.cp > 1:
            from mtl.parallel.context_parallel import split_for_context_parallel

            batch = {k: split_for_context_parallel(v, 1, self.topology) if v.dim() == 2 else v
                     for k, v in batch.items()}
        # From pageable memory a copy to the GPU first waits for everything queued before it
        # (CUDA stages it); from pinned memory it is queued like a kernel, so a batch taken
        # while the device still works on the previous step does not stall it. (contiguous:
        # pinning keeps an expanded tensor's overlapping strides, which the copy cannot write.)
        pin = self.device.type == "cuda"
        return {
            k: (v.contiguous().pin_memory() if pin else v).to(self.device, non_blocking=True)
            .to(torch.float32 if k == "loss_mask" else torch.int64)
            for k, v in batch.items()
        }

    def take(self, count: int) -> list[dict[str, torch.Tensor]]:
        return [next(self) for _ in range(count)]
