"""Word + position (+ token-type) embedding, then (post-norm models) the embedding norm, then
dropout: tokens ``[b, s]`` -> hidden ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism).

It extends gpt's ``GPTEmbedding`` (the vocabulary-parallel word table and the learned
positions, under gpt's parameter names) with the token types and the norm.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.model_protocol import tag_init
from mtl.core.spec import ModuleSpec, build_module
from mtl.models.gpt.embedding import GPTEmbedding
from mtl.models.gpt.transformer_layer import sequence_parallel_norm_kwargs
from mtl.parallel.random import get_rng_tracker
from mtl.parallel.tensor_parallel import scatter_to_sequence_parallel


class EncoderEmbedding(GPTEmbedding):
    def __init__(self, *, padded_vocab_size: int, hidden_size: int, max_position_embeddings: int,
                 position_offset: int, type_vocab_size: int, init_std: float, hidden_dropout: float,
                 sequence_parallel: bool, topology, norm: ModuleSpec | None):
        # gpt's word and position tables, without its dropout (BERT's comes after the norm)
        super().__init__(
            padded_vocab_size=padded_vocab_size, hidden_size=hidden_size,
            max_position_embeddings=max_position_embeddings + position_offset, init_std=init_std,
            hidden_dropout=0.0, sequence_parallel=sequence_parallel, topology=topology,
        )
        self.encoder_dropout = hidden_dropout
        self.position_offset = position_offset
        self.token_type_embeddings = None
        if type_vocab_size:
            self.token_type_embeddings = nn.Embedding(type_vocab_size, hidden_size)  # replicated over TP
            tag_init(self.token_type_embeddings.weight, "normal")
        norm_kwargs = sequence_parallel_norm_kwargs(self.sequence_parallel, topology)
        self.norm = build_module(norm, **norm_kwargs) if norm is not None else None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, position_ids, token_type_ids [b, s] -> [s(/tp), b, h]."""
        hidden = super().forward(input_ids, position_ids + self.position_offset)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            types = self.token_type_embeddings(token_type_ids).transpose(0, 1)  # [b, s, h] -> [s, b, h]
            if self.sequence_parallel:
                types = scatter_to_sequence_parallel(types, self.tp_group)  # -> [s/tp, b, h]
            hidden = hidden + types
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.encoder_dropout == 0.0 or not self.training:
            return hidden
        # Under sequence parallelism each TP rank holds different tokens: its own stream
        tracker = get_rng_tracker()
        stream = tracker.fork() if self.sequence_parallel and tracker.is_initialized() else contextlib.nullcontext()
        with stream:
            return F.dropout(hidden, p=self.encoder_dropout, training=True)
