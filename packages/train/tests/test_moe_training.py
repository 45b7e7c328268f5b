"""MoE models in the training loop: the routers' metrics reach the metric sinks, and under fp16
loss scaling the auxiliary losses get the loss scale in backward (as the LM loss does), so
unscaling leaves their gradient intact."""

import json

import torch

from mtl.core.config_io import load_config
from mtl.train.loop import train
from mtl.train.testing import TINY

MOE = [o for o in TINY if not o.startswith("train.iters")] + ["model.num_experts=4", "model.moe_top_k=2"]
ROUTER = "layers.0.mlp.router.weight"


def _rows(tmp_path, overrides):
    train(load_config(None, [*MOE, "train.iters=4", "logging.interval=2", f"logging.dir='{tmp_path}'",
                             "logging.callbacks=['jsonl']", *overrides]), progress=False)
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_router_metrics_are_logged(tmp_path):
    rows = _rows(tmp_path / "dropless", [])
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:
        # 4 MoE layers, coefficient 0.01: a balanced router gives 0.01 per layer
        assert 0.02 < row["moe_aux_loss"] < 0.08, row
        assert row["moe_dropped_tokens"] == 0 and row["moe_dropped_fraction"] == 0
    capped = _rows(tmp_path / "capped", ["model.moe_capacity_factor=0.5"])
    for row in capped:  # half an even share of slots per expert: about half the slots dropped
        assert row["moe_dropped_tokens"] > 0 and 0.4 <= row["moe_dropped_fraction"] < 1.0, row


def _router_grad(precision: str, aux_coeff: float) -> torch.Tensor:
    extra = ["train.initial_loss_scale=1024.0"] if precision == "fp16" else []
    result = train(load_config(None, [*MOE, "train.iters=1", f"train.precision='{precision}'", "train.clip_grad=0.0",
                                      f"model.moe_aux_loss_coeff={aux_coeff}", *extra]), progress=False)
    assert result.skipped_steps == 0
    router = dict(result.run.chunks[0].module.named_parameters())[ROUTER]
    return router.main_grad.clone()


def test_aux_loss_gradient_survives_fp16_loss_scaling():
    """The aux loss's share of the router gradient (coefficient 1 minus coefficient 0) is
    the same under fp16 with a loss scale of 1024 as in bf16. Without the scale it would come
    out of unscaling 1024 times too small."""
    shares = {p: (_router_grad(p, 1.0) - _router_grad(p, 0.0)).norm() for p in ("bf16", "fp16")}
    assert shares["bf16"] > 0
    assert abs(shares["fp16"] / shares["bf16"] - 1.0) < 0.1, shares
