"""Which parameters get weight decay: the one rule both optimizer paths use.

As Megatron: biases and every 1-D parameter (norm weights and biases) are not decayed;
matrices and embeddings are.
"""

from __future__ import annotations

from torch import nn


def uses_weight_decay(name: str, param: nn.Parameter) -> bool:
    return param.dim() > 1 and not name.endswith("bias")

