"""Token (+ learned position) embedding: tokens ``[b, s]`` -> hidden ``[s, b, h]``
(``[s/tp, b, h]`` under sequence parallelism)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.model_protocol import tag_init
from mtl.parallel.random import get_rng_tracker
from mtl.parallel.tensor_parallel import (
    VocabParallelEmbedding,
    scatter_to_sequence_parallel,
)


class GPTEmbedding(nn.Module):
    def __init__(
        self,
        *,
        padded_vocab_size: int,
        hidden_size: int,
        max_position_embeddings: int | None,  # None: no learned positions (RoPE)
        init_std: float,
        hidden_dropout: float,
        sequence_parallel: bool,
        topology,
    ):
        super().__init__()
        self.sequence_parallel = sequence_parallel and topology.tp > 1
        self.tp_group = topology.tp_group
        self.hidden_dropout = hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, hidden_size, init_std=init_std, topology=topology, sequence_parallel=sequence_parallel
        )
        self.position_embeddings = None
        if max_position_embeddings is not None:
            # replicated on every TP rank: each rank adds the positions of its own tokens
            self.position_embeddings = nn.Embedding(max_position_embeddings, hidden_size)
            tag_init(self.position_embeddings.weight, "normal")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids [b, s] -> [s(/tp), b, h]."""
        hidden = self.word_embeddings(input_ids)  # [s(/tp), b, h], already summed over TP
        if self.position_embeddings is not None:
            positions = self.position_embeddings(position_ids).transpose(0, 1)  # [b, s, h] -> [s, b, h]
            if self.sequence_parallel:
                positions = scatter_to_sequence_parallel(positions, self.tp_group)  # -> [s/tp, b, h]
            hidden = hidden + positions
        if self.hidden_dropout == 0.0 or not self.training:
            return hidden
        # Under sequence parallelism each TP rank holds different tokens: draw its mask from
        # the TP stream; otherwise the activation is replicated and every rank must agree.
        tracker = get_rng_tracker()
        stream = tracker.fork() if self.sequence_parallel and tracker.is_initialized() else contextlib.nullcontext()
        with stream:
            return F.dropout(hidden, p=self.hidden_dropout, training=True)
