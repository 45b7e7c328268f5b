"""Test support: run a few training steps of a tiny GPT under a given layout and return
what the equivalence tests compare, the losses and every parameter's gradient at full shape.

Used by this package's tests on CPU (gloo) and by the GPU checks (NCCL), so it lives in
the package rather than beside the tests."""

from __future__ import annotations

import torch

from mtl.core.config_io import load_config
from mtl.models.param_layout import gather_global_state
from mtl.train.loop import train

TINY = [
    "model.num_layers=4", "model.hidden_size=32", "model.num_attention_heads=4",
    "model.num_query_groups=2", "model.seq_length=16", "model.vocab_size=512",
    "model.make_vocab_size_divisible_by=128", "data.dataset='mock'", "data.tokenizer='byte'",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.iters=3", "train.lr=1e-3",
    "train.warmup_iters=0", "train.eval_interval=0", "train.clip_grad=1.0", "train.seed=7",
    "train.device='cpu'", "logging.callbacks=[]",
]


def run_tiny(overrides: list[str], with_grads: bool = True) -> dict:
    cfg = load_config(None, [*TINY, *overrides])
    result = train(cfg, progress=False)
    run = result.run
    grads: dict[str, torch.Tensor] = {}
    if with_grads:
        for chunk in run.chunks:  # TP-gathered; each pipeline stage reports its own layers
            grads.update(gather_global_state(getattr(chunk, "module", chunk), run.topology, grads=True))
    return {"losses": result.losses, "grads": grads, "last_stage": run.topology.is_last_stage}


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The union of every rank's full-shape gradients; ranks holding the same parameter
    (data/context-parallel replicas, tied embedding copies) must agree."""
    full: dict[str, torch.Tensor] = {}
    for result in per_rank:
        for name, grad in result["grads"].items():
            if name in full:
                torch.testing.assert_close(grad, full[name], atol=1e-6, rtol=1e-5, msg=lambda m: f"replicas of {name} differ: {m}")
            full[name] = grad
    return full
