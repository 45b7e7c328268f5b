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

import threading
from contextlib import contextmanager

import torch
from torch import nn

# The hook on nn.Module.register_parameter is installed once and stays: it acts only on a
# thread inside parameters_on_meta. Swapping the method in and out per load would move the
# parameters of every other thread building a module meanwhile, and two loads overlapping
# could restore each other's swap, leaving it installed for good.
_install_lock = threading.Lock()
_on_meta = threading.local()  # .depth: how many parameters_on_meta this thread is inside
_register = nn.Module.register_parameter  # torch's, kept before the hook replaces it


def _dressed_as(new: nn.Parameter, old: nn.Parameter) -> nn.Parameter:
    """``new`` with ``old``'s class (a Parameter subclass stays one) and attributes (such as
    tensor-parallel layout tags)."""
    if type(old) is not nn.Parameter:
        new.__class__ = type(old)
    new.__dict__.update(old.__dict__)
    return new


def _register_maybe_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    if getattr(_on_meta, "depth", 0) and param is not None and param.device.type != "meta":
        param = _dressed_as(nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad), param)
    _register(module, name, param)


@contextmanager
def parameters_on_meta():
    """Inside it, parameters that this thread registers on any module go to the meta device;
    other threads build modules as usual. It nests."""
    with _install_lock:
        if nn.Module.register_parameter is not _register_maybe_on_meta:
            nn.Module.register_parameter = _register_maybe_on_meta
    _on_meta.depth = getattr(_on_meta, "depth", 0) + 1
    try:
        yield
    finally:
        _on_meta.depth -= 1


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    """Zeroed parameters of ``dtype`` (None: as built) on ``device`` for every meta one, tied
    parameters staying tied; buffers moved to ``device`` as they are. Parameters without
    gradient keep the dtype they were built in, as training's weights cast keeps them (an MoE
    router's fp32 expert bias: in bf16 it would pick other experts than the trained model)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in made:
                cast = dtype is not None and param.requires_grad and param.is_floating_point()
                real = nn.Parameter(torch.zeros(param.shape, dtype=dtype if cast else param.dtype, device=device),
                                    requires_grad=param.requires_grad)
                made[id(param)] = _dressed_as(real, param)
            module._parameters[name] = made[id(param)]
    return model.to(device)
