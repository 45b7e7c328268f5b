"""The output heads of an encoder: the masked-LM head and the pooler with its binary head.

MLM head (BERT's ``cls.predictions``): dense ``[h, h]`` + GELU + norm, then the decoder, the
word embedding's table (tied) with its own bias, split over TP by vocabulary rows like gpt's
output layer. Binary head (NSP / sentence order): the pooler (dense + tanh on the first
token) and a ``[2, h]`` linear. Both run on the whole sequence, replicated over TP: under
sequence parallelism the hidden states are gathered first (``mtl.models.bert.model``).

Sequence classification (``model.num_labels``, HF's BertForSequenceClassification): the same
pooler, dropout, and a ``[num_labels, h]`` linear ``classifier``. It too is replicated: a few
thousand weights on one token per sample, less than the collectives a split would cost; its
input, the all-reduced (and gathered) hidden states, is the same on every TP rank, so are its
gradients, and its dropout draws from the default generator, which TP ranks share
(``mtl.parallel.random.seed_everything``): the same mask everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtl.core.model_protocol import tag_init
from mtl.core.spec import ModuleSpec, build_module


def replicated_linear(in_features: int, out_features: int) -> nn.Linear:
    """A dense layer every TP rank holds whole (its inputs are replicated, so are its gradients)."""
    linear = nn.Linear(in_features, out_features)
    tag_init(linear.weight, "normal")
    tag_init(linear.bias, "zeros")
    return linear


class MaskedLMTransform(nn.Module):
    """[s, b, h] -> norm(gelu(dense(x))) [s, b, h], what the decoder reads."""

    def __init__(self, *, hidden_size: int, norm: ModuleSpec):
        super().__init__()
        self.dense = replicated_linear(hidden_size, hidden_size)
        self.norm = build_module(norm)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(hidden)))


class Pooler(nn.Module):
    """hidden [s, b, h] -> tanh(dense(hidden[0])) [b, h]: the first ([CLS]) token's summary."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.dense = replicated_linear(hidden_size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[0]))
