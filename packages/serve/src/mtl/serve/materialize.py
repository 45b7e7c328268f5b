"""A model built without its weights, then given empty ones in the serving dtype on the device.

Building a model for serving the training way (fp32 on the host, random init, then moved and
cast) peaks at the fp32 model plus its cast copy, and initialises weights that the checkpoint
overwrites at once. Here, while the model is built, every parameter goes to the meta device
as it is registered (one parameter's fp32 storage lives for a moment; initialisation on meta
is free); buffers stay real, so values computed at construction (rotary frequencies) are
kept. ``materialize`` then gives each parameter a zeroed tensor of the serving dtype on the
device, which the checkpoint load fills: the peak is the model in that dtype. Zeroed, not
empty: what no checkpoint holds (the rows padding the vocabulary) is zero as after init,
never stray bits that could be inf or NaN."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def parameters_on_meta():
    """Inside it, parameters registered on any module are moved to the meta device (their
    attributes, such as tensor-parallel layout tags, travel with them)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            param = meta
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    """Zeroed parameters of ``dtype`` (None: as built) on ``device`` for every meta one, tied
    parameters staying tied; buffers moved to ``device`` as they are."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in made:
                real = nn.Parameter(torch.zeros(param.shape, dtype=dtype or param.dtype, device=device),
                                    requires_grad=param.requires_grad)
                real.__dict__.update(param.__dict__)
                made[id(param)] = real
            module._parameters[name] = made[id(param)]
    return model.to(device)
