"""The residual deferral (``residual_deferral.py``, applied under ``train.compile``) leaves each
layer's MLP residual add to the next layer's step. Eager, that must not change a bit: the same
output and the same gradients, dropout included, as the block's plain loop; and it must leave a
block whose layers have only the plain forward (a plugin family's) as it is."""

import pytest
import torch
from torch import nn

from mtl.core.errors import MtlError
from mtl.models.gpt import build_gpt
from mtl.models.gpt.layer_calls import compile_units, installed_calls
from mtl.models.gpt.recompute import apply_full_recompute
from mtl.models.gpt.residual_deferral import DeferredResidualStep, apply_residual_deferral, is_deferred
from mtl.models.initialization import initialize_parameters


class PlainLayer(nn.Module):
    """A layer of the plain contract only: no branch methods."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden, rotary=None, inference_context=None):
        return self.layer(hidden, rotary, inference_context)


def _run(model, hidden, rotary):
    torch.manual_seed(5)  # the dropout masks
    out = model.layers(hidden, rotary)
    grads = torch.autograd.grad(out.float().square().sum(), [hidden, *model.layers.parameters()])
    return out.detach(), grads


def _model(make_config, backend, single, style, dtype, **train):
    model_overrides = {"num_layers": 3, "hidden_dropout": 0.2}
    if style == "llama-fused-rope":  # no QK-norm: the rotation runs inside rotary_qkv
        style, model_overrides["qk_norm"] = "llama", False
    config = make_config(style, model=model_overrides, train=train)
    model = build_gpt(config, single, backend).train().to(dtype)
    initialize_parameters(model, 9, single)
    hidden = torch.randn(16, 2, 32, dtype=dtype, requires_grad=True)
    rotary = model.rotary(torch.arange(16).expand(2, 16)) if model.rotary is not None else None
    return model, hidden, rotary


def _assert_same(actual, expected):
    (out, grads), (expected_out, expected_grads) = actual, expected
    assert torch.equal(out, expected_out)
    assert len(grads) == len(expected_grads) > 1
    for grad, expected_grad in zip(grads, expected_grads):
        assert torch.equal(grad, expected_grad)


@pytest.mark.parametrize("recompute", [False, True], ids=["", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", ["gpt2", "llama", "llama-fused-rope"])
def test_deferred_steps_give_the_plain_loops_numbers(make_config, backend, single, style, dtype, recompute):
    model, hidden, rotary = _model(make_config, backend, single, style, dtype)
    assert installed_calls(model.layers) is None  # eager: the block's own plain loop
    plain = _run(model, hidden, rotary)

    assert apply_residual_deferral(model.layers) and is_deferred(model.layers)
    if recompute:
        apply_full_recompute(model.layers)
    _assert_same(_run(model, hidden, rotary), plain)


def test_a_compiled_model_defers_and_compiles_the_steps(make_config, backend, single):
    model = build_gpt(make_config("llama", train={"compile": True, "recompute": "full"}), single, backend)
    assert is_deferred(model.layers)
    units = compile_units(model.layers)
    assert [type(unit) for unit in units] == [DeferredResidualStep] * 2
    assert [unit.layer for unit in units] == list(model.layers.values())
    assert model.compile_units()[:2] == units
    # the steps are not children of the model: parameter names do not change
    assert all(name.startswith(("embedding.", "layers.0.", "layers.1.", "final_norm.", "output_layer."))
               for name, _ in model.named_parameters())


def test_a_block_with_a_plain_layer_keeps_the_plain_loop(make_config, backend, single):
    model, hidden, rotary = _model(make_config, backend, single, "gpt2", torch.float32)
    model.layers["1"] = PlainLayer(model.layers["1"])
    plain = _run(model, hidden, rotary)
    assert not apply_residual_deferral(model.layers)
    assert installed_calls(model.layers) is None and compile_units(model.layers) == list(model.layers.values())
    apply_full_recompute(model.layers)  # recompute still applies, around the plain calls
    _assert_same(_run(model, hidden, rotary), plain)


def test_the_deferral_is_applied_before_other_call_changes(make_config, backend, single):
    model, _, _ = _model(make_config, backend, single, "gpt2", torch.float32)
    apply_full_recompute(model.layers)
    with pytest.raises(MtlError, match="apply the residual deferral first"):
        apply_residual_deferral(model.layers)


def test_a_step_returns_the_stream_and_its_mlp_output(make_config, backend, single):
    model = build_gpt(make_config("gpt2"), single, backend).eval()
    initialize_parameters(model, 9, single)
    layer = model.layers["0"]
    hidden, pending = torch.randn(2, 16, 2, 32).unbind(0)
    with torch.no_grad():
        stream, mlp_out = DeferredResidualStep(layer)(hidden, pending)
        assert torch.equal(stream + mlp_out, layer(hidden + pending))
