"""The initial values of the mixer's SSM parameters, which are not Gaussian: Mamba-2's A in
[1, 16] (stored as log), dt in [0.001, 0.1] log-uniformly (stored as softplus's inverse, the dt
bias), and PyTorch's default uniform init of the depthwise convolution. Each is drawn from
(seed, global name) over the whole global tensor, as ``mtl.models.initialization`` does for the
others, so every layout starts from the same weights."""

from __future__ import annotations

import math

import torch
from torch import nn

from mtl.models.initialization import parameter_seed
from mtl.models.param_layout import box, parameter_entries

DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4
A_RANGE = (1.0, 16.0)

_ATTRIBUTE = "ssm_init"  # the name of the rule below a mixer parameter is drawn by


def a_log(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.empty(shape).uniform_(*A_RANGE, generator=generator).log()


def dt_bias(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    log_dt = torch.rand(shape, generator=generator) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)
    dt = log_dt.exp().clamp(min=DT_FLOOR)
    return dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt


def conv_weight(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    bound = 1.0 / math.sqrt(shape[-1])  # fan-in of a depthwise kernel: its width
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


RULES = {"a_log": a_log, "dt_bias": dt_bias, "conv_weight": conv_weight}


def mark_ssm_init(param: nn.Parameter, rule: str) -> nn.Parameter:
    setattr(param, _ATTRIBUTE, rule)
    return param


@torch.no_grad()
def initialize_ssm_parameters(model: nn.Module, seed: int, topology) -> None:
    """Overwrite each marked parameter with this rank's box of its rule's global value (after
    ``initialize_parameters``, which filled them with the placeholder their tag says)."""
    for entry in parameter_entries(model, topology):
        rule = getattr(entry.param, _ATTRIBUTE, None)
        if rule is None or entry.param.is_meta:
            continue
        generator = torch.Generator().manual_seed(parameter_seed(seed, entry.global_name))
        full = RULES[rule](entry.global_shape, generator)
        local = entry.view(entry.param.data)
        local.copy_(box(full, local.shape, entry.global_offset))
