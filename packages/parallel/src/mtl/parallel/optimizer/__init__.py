"""Optimizers (replicated AdamW and the ZeRO-1 distributed optimizer) and gradient clipping."""

from mtl.parallel.optimizer.build import build_optimizer
from mtl.parallel.optimizer.distributed_optimizer import DistributedOptimizer
from mtl.parallel.optimizer.grad_norm import check_for_nan, clip_grad_norm, global_grad_norm
from mtl.parallel.optimizer.param_groups import uses_weight_decay
from mtl.parallel.optimizer.replicated_optimizer import ReplicatedOptimizer

__all__ = [
    "DistributedOptimizer",
    "ReplicatedOptimizer",
    "build_optimizer",
    "check_for_nan",
    "clip_grad_norm",
    "global_grad_norm",
    "uses_weight_decay",
]
