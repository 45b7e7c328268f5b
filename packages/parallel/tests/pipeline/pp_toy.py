"""A tiny pipelined language model for the schedule tests, and its single-process reference.

    tokens [b, s] -> embedding -> [s, b, h] -> L x tanh(linear) -> logits [s, b, V] -> CE loss

``ToyModel`` is the whole model; ``ToyChunk`` copies the part one (rank, chunk) holds, naming
every parameter by its global name so gradients from all ranks can be merged and compared.
With ``tied=True`` the output projection reuses the embedding matrix: one parameter in the
reference, two flagged copies (first and last stage) in the pipeline.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from mtl.parallel.param_layout import set_param_layout

VOCAB, HIDDEN, SEQ, MICRO_BATCH = 16, 8, 4, 2
TENSOR_SHAPE = (SEQ, MICRO_BATCH, HIDDEN)  # [s, b, h] passed between stages


class ToyModel(nn.Module):
    def __init__(self, num_layers: int, tied: bool, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.tied = tied
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(num_layers))
        self.head = None if tied else nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(tokens).transpose(0, 1)  # [b, s] -> [s, b, h]
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
        head = self.embedding.weight if self.tied else self.head.weight
        return hidden @ head.t()  # [s, b, h] -> [s, b, V]


class ToyChunk(nn.Module):
    """Layers ``[start, end)`` of ``full``; the embedding if ``pre_process``, the head if
    ``post_process``. Parameters are named ``embedding``, ``layer{i}_weight`` ... ``head``."""

    def __init__(self, full: ToyModel, start: int, end: int, pre_process: bool, post_process: bool):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.params = nn.ParameterDict()
        if pre_process:
            self.params["embedding"] = copy.deepcopy(full.embedding.weight)
            set_param_layout(self.params["embedding"], shared_embedding=full.tied)
        for i in range(start, end):
            self.params[f"layer{i}_weight"] = copy.deepcopy(full.layers[i].weight)
            self.params[f"layer{i}_bias"] = copy.deepcopy(full.layers[i].bias)
        self.layer_ids = list(range(start, end))
        if post_process and not (full.tied and pre_process):  # one stage: the tie is one tensor
            source = full.embedding.weight if full.tied else full.head.weight
            self.params["head"] = copy.deepcopy(source)
            set_param_layout(self.params["head"], shared_embedding=full.tied)
        self.input_tensor = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.pre_process:
            hidden = F.embedding(tokens, self.params["embedding"]).transpose(0, 1)  # [s, b, h]
        else:
            hidden = self.input_tensor
        for i in self.layer_ids:
            hidden = torch.tanh(F.linear(hidden, self.params[f"layer{i}_weight"], self.params[f"layer{i}_bias"]))
        if self.post_process:
            head = self.params["head"] if "head" in self.params else self.params["embedding"]
            return hidden @ head.t()  # [s, b, V]
        return hidden


def make_micro_batches(num_micro_batches: int, seed: int = 1) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "tokens": torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen),
            "labels": torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen),
        }
        for _ in range(num_micro_batches)
    ]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; logits [s, b, V], labels [b, s]."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.t().reshape(-1))


def forward_step(data_iterator, model_chunk):
    """The schedules' forward_step: every chunk reads the micro-batch, the last uses its labels."""
    batch = next(data_iterator)
    output = model_chunk(batch["tokens"])

    def loss_func(logits):
        loss = lm_loss(logits, batch["labels"])
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def global_grads(full: ToyModel) -> dict[str, torch.Tensor]:
    """The reference gradients under the chunk naming."""
    grads = {"embedding": full.embedding.weight.grad.clone()}
    for i, layer in enumerate(full.layers):
        grads[f"layer{i}_weight"] = layer.weight.grad.clone()
        grads[f"layer{i}_bias"] = layer.bias.grad.clone()
    if full.tied:
        grads["head"] = grads["embedding"]
    else:
        grads["head"] = full.head.weight.grad.clone()
    return grads


def reference(num_layers: int, tied: bool, num_micro_batches: int) -> tuple[list[float], dict]:
    """Per-micro-batch losses and accumulated gradients of the mean loss, in one process."""
    full = ToyModel(num_layers, tied)
    losses = []
    for batch in make_micro_batches(num_micro_batches):
        loss = lm_loss(full(batch["tokens"]), batch["labels"])
        (loss / num_micro_batches).backward()
        losses.append(loss.item())
    return losses, global_grads(full)
