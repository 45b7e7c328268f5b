"""Pipeline parallelism: p2p exchange between stages, the no-pipelining / 1F1B / interleaved
1F1B schedules, the layer split of each (rank, chunk), and the tied-embedding gradient sync."""

from .embedding_sync import allreduce_shared_embedding_grads
from .layer_split import stage_layer_range
from .schedules import forward_backward

__all__ = ["allreduce_shared_embedding_grads", "forward_backward", "stage_layer_range"]
