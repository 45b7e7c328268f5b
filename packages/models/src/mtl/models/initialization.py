"""Layout-independent initialization: the same global weights whatever the parallel layout.

Each parameter is drawn from its own generator, seeded by (seed, global name), as the full
global tensor; every rank copies its box of it (``param_layout.parameter_entries``). A model
built at tp=1 and one built at tp=2 therefore start bit-identical, and a pipeline stage's
tied output weight starts equal to the word embedding (the same global name).

Rules (Megatron's): norm weights one, biases zero, the two projections that write into the
residual stream (attention ``linear_proj`` and MLP ``linear_fc2``) normal with
``init_std / sqrt(2 * num_layers)``, everything else normal with ``init_std``.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from mtl.core.config import RunConfig
from mtl.models.param_layout import box, parameter_entries

RESIDUAL_OUTPUT_MODULES = ("linear_proj", "linear_fc2")


def output_init_std(config: RunConfig) -> float:
    """Megatron's scaled init of the layers that write into the residual stream: each layer
    adds two of them, so their std shrinks with sqrt(2 * num_layers) to keep it bounded."""
    return config.model.init_std / math.sqrt(2.0 * config.model.num_layers)


def parameter_seed(seed: int, global_name: str) -> int:
    """A 63-bit seed from (seed, name), stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(global_name: str, global_shape: tuple[int, ...], seed: int, config) -> torch.Tensor:
    """The full fp32 global tensor a parameter starts from."""
    module_path, _, leaf = global_name.rpartition(".")
    module_name = module_path.rpartition(".")[2]
    if "bias" in leaf:
        return torch.zeros(global_shape)
    if module_name.endswith("norm"):
        return torch.ones(global_shape)
    std = output_init_std(config) if module_name in RESIDUAL_OUTPUT_MODULES else config.model.init_std
    generator = torch.Generator().manual_seed(parameter_seed(seed, global_name))
    return torch.empty(global_shape).normal_(0.0, std, generator=generator)


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: int, topology) -> None:
    """Fill every parameter of ``model`` (a GPTModel or a stage of one) with this rank's box
    of its layout-independent initial value."""
    for entry in parameter_entries(model, topology):
        if entry.param.is_meta:  # shapes only (e.g. `mtl train --dry-run`): nothing to fill, nothing to draw
            continue
        if not entry.param.requires_grad:  # a backend's state (an FP8 amax history): its module set it
            continue
        if hasattr(entry.param, "vocab_rows"):
            entry.param.data.zero_()  # padding rows: zero, and never read (see param_layout)
        local = entry.view(entry.param.data)
        full = initial_value(entry.global_name, entry.global_shape, seed, model.config)
        local.copy_(box(full, local.shape, entry.global_offset))
