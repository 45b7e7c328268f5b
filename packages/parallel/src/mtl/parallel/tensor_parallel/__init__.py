"""Tensor and sequence parallelism: autograd mappings, parallel linears, vocab-parallel
embedding and cross-entropy. Activations are sequence-first ``[s, b, h]``."""

from mtl.parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mtl.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from mtl.parallel.tensor_parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
    scatter_to_tensor_parallel,
)
from mtl.parallel.tensor_parallel.vocab_parallel import VocabParallelEmbedding

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel",
    "gather_from_sequence_parallel",
    "gather_from_tensor_parallel",
    "reduce_from_tensor_parallel",
    "reduce_scatter_to_sequence_parallel",
    "scatter_to_sequence_parallel",
    "scatter_to_tensor_parallel",
    "vocab_parallel_cross_entropy",
]
