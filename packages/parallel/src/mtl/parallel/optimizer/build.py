"""One entry point for the training loop: the distributed or the replicated AdamW."""

from __future__ import annotations

from torch import nn

from mtl.parallel.optimizer.distributed_optimizer import DistributedOptimizer
from mtl.parallel.optimizer.replicated_optimizer import ReplicatedOptimizer
from mtl.parallel.topology import Topology


def build_optimizer(model: nn.Module | list[nn.Module], topology: Topology, *, use_distributed_optimizer: bool,
                    lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float = 0.0) -> ReplicatedOptimizer | DistributedOptimizer:
    """AdamW over ``model`` (one module or the list of virtual-pipeline chunks). With
    ``use_distributed_optimizer`` every chunk must be ``DataParallel(...,
    use_distributed_optimizer=True)``; otherwise plain modules or DataParallel wrappers."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    kwargs = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if use_distributed_optimizer:
        return DistributedOptimizer(chunks, topology, **kwargs)
    return ReplicatedOptimizer(chunks, topology, **kwargs)
