"""Aux-loss-free balancing in training: with ``model.moe_router_expert_bias`` the trainer moves each
router's bias after every step (the rule and its sum over data-parallel ranks:
packages/models/tests/test_moe_expert_bias.py): after 3 steps each bias is a sum of three steps of
-rate, 0 or +rate, off zero, and the counts start again from zero."""

import torch

from mtl.core.config_io import load_config
from mtl.train.loop import train
from mtl.train.testing import MOE_TINY, TINY

RATE = 0.01


def test_the_trainer_moves_the_expert_biases_each_step():
    overrides = ["model.moe_router='sigmoid'", "model.moe_router_expert_bias=true",
                 f"model.moe_router_bias_update_rate={RATE}", "train.iters=3"]
    result = train(load_config(None, [*TINY, *MOE_TINY, *overrides]), progress=False)
    model = getattr(result.run.chunks[0], "module", result.run.chunks[0])
    routers = {name: module for name, module in model.named_modules() if name.endswith("mlp.router")}
    assert sorted(routers) == ["layers.0.mlp.router", "layers.1.mlp.router"]
    for name, router in routers.items():
        steps = router.expert_bias.detach() / RATE
        assert (steps - steps.round()).abs().max() < 1e-4 and steps.abs().max() <= 3, (name, steps)
        assert steps.abs().sum() > 0, name
        assert not router.tokens_since_update.any(), name  # counted afresh for the next step
