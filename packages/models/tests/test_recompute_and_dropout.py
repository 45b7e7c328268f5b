"""Activation recompute ("full", "selective") gives the gradients of no recompute, dropout
included: the recomputed forward must draw the same masks."""

import pytest
import torch

from mtl.models.gpt import build_gpt
from mtl.models.initialization import initialize_parameters
from mtl.models.param_layout import gather_global_state

DROPOUT = {"attention_dropout": 0.2, "hidden_dropout": 0.2}


def grads_with(make_config, backend, single, style, recompute):
    config = make_config(style, model=DROPOUT, train={"recompute": recompute})
    model = build_gpt(config, single, backend).train()
    initialize_parameters(model, 9, single)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(1234)  # the dropout masks
    loss = model(ids, labels=ids.roll(-1, dims=1))
    loss.mean().backward()
    return loss.detach(), gather_global_state(model, single, grads=True)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_recompute_gives_the_same_gradients(make_config, backend, single, style):
    ref_loss, ref_grads = grads_with(make_config, backend, single, style, "none")
    for recompute in ("full", "selective"):
        loss, grads = grads_with(make_config, backend, single, style, recompute)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=f"{recompute} {name}")


def test_dropout_is_active_in_training_only(make_config, backend, single):
    model = build_gpt(make_config("llama", model=DROPOUT), single, backend)
    initialize_parameters(model, 9, single)
    ids = torch.randint(0, 100, (1, 16))
    model.eval()
    assert torch.equal(model(ids), model(ids))
    model.train()
    assert not torch.equal(model(ids), model(ids))
