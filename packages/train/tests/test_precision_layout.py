"""Megatron's precision layout (``train.params_dtype`` = the precision, the default): bf16
weights for compute, fp32 main weights in the optimizer, fp32 gradient accumulation in
``main_grad``. Checked against the autocast layout (fp32 weights), for an exact resume, for
checkpoints that hold the fp32 main weights, and across layouts."""

from __future__ import annotations

import torch

from mtl.ckpt import load
from mtl.ckpt.sharded import ShardedTensor
from mtl.core.config_io import load_config
from mtl.train.loop import train
from mtl.train.testing import TINY, run_layout, run_tiny

BF16 = [o for o in TINY if not o.startswith("train.iters")] + ["train.precision='bf16'", "train.iters=6"]
# bf16 rounds every matmul input; the two layouts round different tensors (the weights once
# per step here, per micro-batch under autocast), so losses agree to about bf16's precision.
LAYOUT_LOSS_RTOL = 2e-3


def _train(overrides: list[str]):
    return train(load_config(None, [*BF16, *overrides]), progress=False)


def test_bf16_weights_fp32_main_weights_and_gradients():
    result = _train(["train.iters=2"])
    model, optimizer = result.run.chunks[0], result.run.optimizer
    params = [p for p in model.module.parameters() if p.requires_grad]
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert {p.main_grad.dtype for p in params} == {torch.float32}
    assert all(p.grad is None for p in params)  # each micro-batch's bf16 grad went into main_grad
    assert optimizer.has_main_params
    for entry in optimizer.entries:  # the model's weights are the main weights, rounded
        assert entry.piece.dtype == torch.float32
        assert torch.equal(entry.model_view, entry.piece.detach().to(torch.bfloat16).view_as(entry.model_view))


def test_bf16_weights_match_the_autocast_layout():
    main = _train([])
    autocast = _train(["train.params_dtype='fp32'"])
    for step, loss in autocast.losses.items():
        assert abs(main.losses[step] - loss) / loss < LAYOUT_LOSS_RTOL, (step, main.losses, autocast.losses)


def test_resume_is_exact_and_checkpoints_hold_the_fp32_main_weights(tmp_path):
    straight = _train([])
    ckpt = tmp_path / "ckpt"
    first = _train([f"ckpt.save='{ckpt}'", "train.exit_interval=3"])
    main = {e.name: e.piece.detach().clone() for e in first.run.optimizer.entries}
    second = _train([f"ckpt.load='{ckpt}'", f"ckpt.save='{ckpt}'"])
    assert [second.losses[s] for s in range(4, 7)] == [straight.losses[s] for s in range(4, 7)]
    # the stored model weight is fp32 and equals the optimizer's main weight, not its bf16 copy
    name = "layers.1.mlp.linear_fc2.weight"
    template = {"w": ShardedTensor(f"model.{name}", torch.zeros_like(main[name]), tuple(main[name].shape), (0, 0))}
    load(template, str(ckpt), iteration=3)
    assert torch.equal(template["w"].data, main[name])
    assert not torch.equal(main[name], main[name].to(torch.bfloat16).float())  # really finer than bf16


def test_autocast_checkpoint_resumes_with_bf16_weights(tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = _train(["train.params_dtype='fp32'", f"ckpt.save='{ckpt}'", "train.exit_interval=3"])
    weights = {name: p.detach().clone() for name, p in saved.run.chunks[0].module.named_parameters()}
    resumed = _train([f"ckpt.load='{ckpt}'", "train.exit_interval=3", "train.iters=6"])
    assert sorted(resumed.losses) == [4, 5, 6]
    # the fp32 weights became the main weights exactly (checked before any step: a fresh load)
    loaded = _train([f"ckpt.load='{ckpt}'", "train.iters=3"]).run.optimizer
    for entry in loaded.entries:
        assert torch.equal(entry.piece.detach(), weights[entry.name])


def test_layouts_match_one_process_in_bf16():
    reference = run_tiny(["train.precision='bf16'"], with_grads=False)
    for layout in ("tp2_sp", "pp2", "dp2_distopt"):
        results = run_layout(layout, ["train.precision='bf16'"])
        losses = next(r["losses"] for r in results if r["last_stage"])
        for step, loss in reference["losses"].items():
            assert abs(losses[step] - loss) / loss < 1e-4, (layout, losses, reference["losses"])
