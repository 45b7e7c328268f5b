"""Layout-independent initialization: the same global weights whatever the parallel layout.

Each parameter is drawn from its own generator, seeded by (seed, global name), as the full
global tensor; every rank copies its box of it (``param_layout.parameter_entries``). A model
built at tp=1 and one built at tp=2 therefore start bit-identical, and a pipeline stage's
tied output weight starts equal to the word embedding (the same global name).

How a parameter starts is said by the module that creates it, as ``param.init_kind``
(``tag_init``; kinds in ``mtl.core.model_protocol.INIT_KINDS``), so a new module or family
needs no name pattern here. Megatron's rules: norm weights "ones", biases "zeros", the
projections that write into the residual stream (attention ``linear_proj``, MLP ``linear_fc2``)
"residual_output" = normal with ``init_std / sqrt(2 * num_layers)``, everything else "normal"
with ``init_std``. mtl's own modules tag every parameter; a parameter without a tag (a
third-party backend's leaf) falls back to the old name rule (``kind_from_name``).
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from mtl.core.config import RunConfig
from mtl.core.errors import PluginError
from mtl.core.model_protocol import INIT_KINDS, tag_init
from mtl.models.param_layout import box, parameter_entries
from mtl.parallel.param_layout import param_layout

__all__ = ["INIT_KINDS", "initial_value", "initialize_parameters", "kind_from_name", "output_init_std",
           "tag_init", "tag_weights"]

# The name rule for untagged parameters only (the projections that write into the residual stream).
RESIDUAL_OUTPUT_MODULES = ("linear_proj", "linear_fc2")


def output_init_std(config: RunConfig) -> float:
    """Megatron's scaled init of the layers that write into the residual stream: each layer
    adds two of them, so their std shrinks with sqrt(2 * num_layers) to keep it bounded."""
    return config.model.init_std / math.sqrt(2.0 * config.model.num_layers)


def parameter_seed(seed: int, global_name: str) -> int:
    """A 63-bit seed from (seed, name), stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def tag_weights(linear: nn.Module, kind: str) -> None:
    """Tag the weight(s) of a backend's linear with ``kind`` (its biases carry the linear's own
    "zeros"; state with ``requires_grad = False`` is not initialised). The linear cannot know
    its role, so the module using it calls this: "residual_output" for ``linear_proj`` and
    ``linear_fc2``, "normal" for the others."""
    for name, param in linear.named_parameters():
        if name.rpartition(".")[2] == "weight" and param.requires_grad:
            tag_init(param, kind)


def kind_from_name(global_name: str) -> str:
    """The init kind of an untagged parameter, from its name (the rule before tags existed):
    a bias is zeros, a weight of a module named ``*norm`` ones, ``linear_proj`` / ``linear_fc2``
    residual_output, anything else normal."""
    module_path, _, leaf = global_name.rpartition(".")
    module_name = module_path.rpartition(".")[2]
    if "bias" in leaf:
        return "zeros"
    if module_name.endswith("norm"):
        return "ones"
    return "residual_output" if module_name in RESIDUAL_OUTPUT_MODULES else "normal"


def initial_value(global_name: str, global_shape: tuple[int, ...], seed: int, config, kind: str) -> torch.Tensor:
    """The full fp32 global tensor a parameter of this init ``kind`` starts from."""
    if kind == "zeros":
        return torch.zeros(global_shape)
    if kind == "ones":
        return torch.ones(global_shape)
    if kind not in INIT_KINDS:
        raise PluginError(f"parameter {global_name}: init_kind = {kind!r} is not one of {INIT_KINDS} (set by the module that made it)")
    std = output_init_std(config) if kind == "residual_output" else config.model.init_std
    generator = torch.Generator().manual_seed(parameter_seed(seed, global_name))
    return torch.empty(global_shape).normal_(0.0, std, generator=generator)


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: int, topology) -> None:
    """Fill every parameter of ``model`` (a ``LanguageModel`` or a stage of one) with this
    rank's box of its layout-independent initial value, by its ``init_kind``."""
    for entry in parameter_entries(model, topology):
        if entry.param.is_meta:  # shapes only (e.g. `mtl train --dry-run`): nothing to fill, nothing to draw
            continue
        if not entry.param.requires_grad:  # a backend's state (an FP8 amax history): its module set it
            continue
        if param_layout(entry.param).vocab_rows is not None:
            entry.param.data.zero_()  # padding rows: zero, and never read (see param_layout)
        local = entry.view(entry.param.data)
        kind = getattr(entry.param, "init_kind", None) or kind_from_name(entry.global_name)
        full = initial_value(entry.global_name, entry.global_shape, seed, model.config, kind)
        local.copy_(box(full, local.shape, entry.global_offset))
