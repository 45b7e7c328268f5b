"""Token embedding with the vocabulary split over tensor-parallel ranks.

Rank r holds rows ``[r*V/tp, (r+1)*V/tp)`` of the ``[V, h]`` table (``V`` is the padded
vocabulary, a multiple of tp). A rank looks up the tokens it owns, writes zeros for the
others, and the ranks sum their results: all-reduce to ``[s, b, h]``, or with sequence
parallelism reduce-scatter straight to ``[s/tp, b, h]``.

With bf16 weights and fp32 gradient buffers the table takes part in wgrad_fusion.py's
gradient-accumulation fusion: its backward adds each token's gradient row into
``weight.main_grad`` in fp32 (embedding_grad.py) instead of writing a dense bf16 ``[V/tp, h]``
gradient for the DataParallel hook to add (unless the table is tied to the output layer).
"""

from __future__ import annotations

import torch
from torch import nn

from mtl.core.model_protocol import tag_init
from mtl.parallel.param_layout import set_param_layout
from mtl.parallel.tensor_parallel import mappings
from mtl.parallel.tensor_parallel.embedding_grad import embedding
from mtl.parallel.tensor_parallel.sharding import divide, shard_of, tp_size_and_rank
from mtl.parallel.tensor_parallel.wgrad_fusion import fused_main_grad


def vocab_range(vocab_size: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rows that ``tp_rank`` owns."""
    per_rank = divide(vocab_size, tp, "padded vocab size")
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


class VocabParallelEmbedding(nn.Module):
    """tokens ``[b, s]`` (int64) -> embeddings ``[s, b, h]`` (``[s/tp, b, h]`` under SP)."""

    # enable_wgrad_fusion keeps a table shared with the output layer on the hook's path
    word_embedding_table = True

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_std: float = 0.02,
        topology=None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.tp, self.tp_rank, self.tp_group = tp_size_and_rank(topology)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, self.tp, self.tp_rank)
        self.sequence_parallel = sequence_parallel and self.tp > 1
        self.weight = nn.Parameter(
            torch.empty(self.vocab_end - self.vocab_start, embedding_dim, dtype=params_dtype, device=device)
        )
        set_param_layout(self.weight, tp_split_dim=0)
        tag_init(self.weight, "normal")
        self.init_std = init_std
        self.accumulates_main_grad = False  # enable_main_grad_accumulation switches it on
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of a global ``[V, h]`` table."""
        self.weight.copy_(shard_of(weight, 0, self.tp, self.tp_rank))

    # wgrad_fusion.enable_wgrad_fusion's contract: the backward can add the table's gradient
    # into weight.main_grad itself (embedding_grad.py), touching only the rows of the tokens seen
    def main_grad_accumulation_params(self) -> list[nn.Parameter]:
        return [self.weight]

    def enable_main_grad_accumulation(self) -> None:
        self.accumulates_main_grad = True

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.t()  # [b, s] -> [s, b]: activations are sequence-first
        main_grad = fused_main_grad(self.weight) if self.accumulates_main_grad else None
        if self.tp == 1:
            return embedding(tokens, self.weight, main_grad)  # [s, b, h]
        not_mine = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local_ids = (tokens - self.vocab_start).masked_fill(not_mine, 0)
        # the tokens of other ranks look up row 0, are zeroed here and add nothing to its gradient
        partial = embedding(local_ids, self.weight, main_grad, skip=not_mine)
        partial = partial.masked_fill(not_mine.unsqueeze(-1), 0.0)  # [s, b, h]
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel(partial, self.tp_group)  # [s/tp, b, h]
        return mappings.reduce_from_tensor_parallel(partial, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim} (rows {self.vocab_start}:{self.vocab_end}), "
            f"tp={self.tp}, sequence_parallel={self.sequence_parallel}"
        )
