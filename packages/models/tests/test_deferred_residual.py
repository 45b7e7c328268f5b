"""The block leaves each layer's MLP residual add to the next layer (``TransformerLayer``'s
``pending``; under ``train.compile`` it then runs in the next layer's norm kernel). Eager, that
must not change a bit: the same output, the same gradients, dropout included, as calling each
layer on the summed residual stream."""

import pytest
import torch
from torch import nn

from mtl.models.gpt import build_gpt
from mtl.models.initialization import initialize_parameters


class PlainLayer(nn.Module):
    """A layer of the plain contract only: a fourth argument is a TypeError."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden, rotary=None, inference_context=None):
        return self.layer(hidden, rotary, inference_context)


def _run(model, hidden, rotary, chained: bool):
    torch.manual_seed(5)  # the dropout masks
    x = hidden
    if chained:
        for layer in model.layers.values():
            x = layer(x, rotary)
    else:
        x = model.layers(x, rotary)
    params = list(model.layers.parameters())
    grads = torch.autograd.grad(x.float().square().sum(), [hidden, *params])
    return x.detach(), grads


@pytest.mark.parametrize("plain", [(), (1,), (0, 2)], ids=["all-defer", "plain-middle", "plain-ends"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_deferred_adds_give_the_chained_layers_numbers(make_config, backend, single, style, dtype, plain):
    """``plain``: layers that keep the plain contract ``(hidden, ...) -> hidden`` (a plugin
    family's layer class): the block hands them the summed stream."""
    config = make_config(style, model={"num_layers": 3, "hidden_dropout": 0.2})
    model = build_gpt(config, single, backend).train().to(dtype)
    initialize_parameters(model, 9, single)
    for index in plain:
        model.layers[str(index)] = PlainLayer(model.layers[str(index)])
    hidden = torch.randn(16, 2, 32, dtype=dtype, requires_grad=True)
    positions = torch.arange(16).expand(2, 16)
    rotary = model.rotary(positions) if model.rotary is not None else None

    chained_out, chained_grads = _run(model, hidden, rotary, chained=True)
    block_out, block_grads = _run(model, hidden, rotary, chained=False)

    assert torch.equal(block_out, chained_out)
    assert len(block_grads) == len(chained_grads) > 1
    for block_grad, chained_grad in zip(block_grads, chained_grads):
        assert torch.equal(block_grad, chained_grad)


def test_a_layer_with_pending_returns_the_stream_and_its_mlp_output(make_config, backend, single):
    model = build_gpt(make_config("gpt2"), single, backend).eval()
    initialize_parameters(model, 9, single)
    layer = model.layers["0"]
    hidden, pending = torch.randn(2, 16, 2, 32).unbind(0)
    with torch.no_grad():
        stream, mlp_out = layer(hidden, None, None, pending)
        assert torch.equal(stream + mlp_out, layer(hidden + pending))
